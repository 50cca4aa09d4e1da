"""Two gloo ranks training FaultNet with GradientScaler (run by
tests/test_torch_distributed.py): ``python tests/torch_distributed.py
SCENARIO OUT_JSON``; each rank writes what it ended with."""

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gradient_scaling import GradientOverflowError  # NOQA
from gradient_scaling.torch import GradientScaler  # NOQA
from torch_faults import FaultNet, batches, NAN  # NOQA


def run(rank, world, scenario, port, out):
    dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{}'.format(
        port), rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = FaultNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradientScaler(model, 'gs', update_interval=3,
                            max_consecutive_overflows=3)
    data = batches(8, seed=rank)  # each rank its own batches
    record = {'rank': rank, 'taken': [], 'error': None}
    start = time.time()
    try:
        for i, (x, t) in enumerate(data):
            bad = rank == 1 and (i == 3 if scenario == 'once' else i >= 2)
            model.fault = ('input', NAN) if bad else None
            optimizer.zero_grad()
            scaler.scale(model(x, t)).backward()
            record['taken'].append(scaler.step(optimizer))
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                scaler.update()
    except GradientOverflowError as e:
        record['error'] = str(e)
    record['seconds'] = time.time() - start
    record['skips'] = scaler.guard.skips
    record['parameters'] = [p.detach().flatten().tolist()
                            for p in model.parameters()]
    record['buffers'] = [b.flatten().tolist() for b in model.buffers()]
    # What sets scales (each rank's telemetry records its own measurements)
    record['scaler'] = repr(sorted(
        (k, v) for k, v in scaler.state_dict()['state'].items()
        if k != 'iteration' and not k.startswith('records/')))
    with open('{}.{}'.format(out, rank), 'w') as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == '__main__':
    scenario, out, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mp.spawn(run, args=(2, scenario, port, out), nprocs=2)
