"""Two gloo ranks training with GradientScaler (run by
tests/test_torch_distributed.py): ``python tests/torch_distributed.py
SCENARIO OUT_JSON PORT``; each rank writes what it ended with.

Scenarios:

* ``once`` / ``persistent``: FaultNet wrapped in
  ``DistributedDataParallel`` (the scaler given the wrapper), a NaN input
  on rank 1 once / from the third step on.
* ``ddp``: float64, the loss times 2**-24 (GS's scales far from 1), each
  rank its own data; GS under DDP against plain DDP at every step, refresh
  steps and cached ones, the scaler given the wrapper's module while the
  wrapper stays in the loop (what Lightning and Accelerate do).
* ``fsdp``: the same against plain FSDP2 (``fully_shard``).
* ``ddp-compiled`` / ``fsdp-compiled``: the DDP wrapper / the FSDP2
  model under ``torch.compile`` with GS's ``compile_backend`` (aot_eager
  inside), against the same compiled without GS.
"""

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gradient_scaling import GradientOverflowError  # NOQA
from gradient_scaling.torch import GradientScaler  # NOQA
from torch_faults import FaultNet, batches, NAN  # NOQA


def faults(rank, scenario, out):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = FaultNet()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = GradientScaler(ddp, 'gs', update_interval=3,
                            patience=3)
    data = batches(8, seed=rank)  # each rank its own batches
    record = {'rank': rank, 'taken': [], 'error': None}
    start = time.time()
    try:
        for i, (x, t) in enumerate(data):
            bad = rank == 1 and (i == 3 if scenario == 'once' else i >= 2)
            model.fault = ('input', NAN) if bad else None
            optimizer.zero_grad()
            scaler.scale(ddp(x, t)).backward()
            scaler.step(optimizer)
            record['taken'].append(scaler.step_taken)
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
    record['scaler'] = committed(scaler)
    return record


def committed(scaler):
    """What sets scales (each rank's telemetry records its own
    measurements, so ``records/`` is left out)."""
    return repr(sorted(
        (k, v) for k, v in scaler.state_dict().items()
        if not k.endswith('/iteration') and '/records/' not in k))


class Tower(nn.Module):
    """conv, a residual branch, Linear, softmax: GEMM, branch and cast
    sites."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.inner = nn.Linear(6 * 4 * 4, 6 * 4 * 4)
        self.fc = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        h = F.relu(self.conv(x)).flatten(1)
        h = h + F.relu(self.inner(h))
        return self.fc(h)


def equal_to_plain(rank, scenario, out):
    """GS and plain training side by side, from the same weights on the
    same data; returns the largest gradient difference at each step."""
    torch.manual_seed(0)
    models = [Tower().double(), Tower().double()]
    models[1].load_state_dict(models[0].state_dict())
    if scenario in ('ddp', 'ddp-compiled'):
        wrapped = [nn.parallel.DistributedDataParallel(m) for m in models]
    else:
        from torch.distributed.fsdp import fully_shard
        for m in models:
            fully_shard(m.inner)
            fully_shard(m)
        wrapped = models
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = GradientScaler(models[0], 'gs', update_interval=2)
    if scenario in ('ddp-compiled', 'fsdp-compiled'):  # GS's backend
        from gradient_scaling.torch import compile_backend
        wrapped = [torch.compile(wrapped[0], backend=compile_backend(
            scaler, inner='aot_eager')),
            torch.compile(wrapped[1], backend='aot_eager')]
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    record = {'rank': rank, 'differences': [], 'scales': [],
              'gradient_reductions': 0}
    reductions = _count_collectives(record)
    for step in range(5):
        x = torch.randn(4, 3, 4, 4, generator=g, dtype=torch.double)
        t = torch.randint(0, 5, (4,), generator=g)
        for m, opt in zip(wrapped, optimizers):
            opt.zero_grad()
        loss = F.cross_entropy(wrapped[0](x), t) * 2.0 ** -24
        scaler.scale(loss).backward()
        scaler.unscale_(optimizers[0])
        plain = F.cross_entropy(wrapped[1](x), t) * 2.0 ** -24
        plain.backward()
        difference = 0.0
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            a, b = _local(p.grad), _local(q.grad)
            difference = max(difference, float((a - b).abs().max()))
        record['differences'].append(difference)
        record['scales'].append(max(
            scaler.hook.landed_scales.values()))
        scaler.step(optimizers[0])
        assert scaler.step_taken is True
        optimizers[1].step()
        scaler.update()
        record.setdefault('site_scales', []).append(
            max(scaler.site_scales().values()))
    reductions.undo()
    record['scaler'] = committed(scaler)
    record['parameters'] = [_local(p.detach()).flatten().tolist()
                            for p in models[0].parameters()]
    return record


def speculated_as_python(rank, out):
    """GS@1 in float32 (underflow not measured: its refreshes speculated)
    and the same with every refresh run by the Python callbacks, both
    under DDP, from the same weights on the same data: whether each step's
    gradients, landed scales and committed scales are the same, and how
    many reads the speculated refreshes made natively."""
    from gradient_scaling.torch import speculation
    torch.manual_seed(0)
    models = [Tower(), Tower()]
    models[1].load_state_dict(models[0].state_dict())
    wrapped = [nn.parallel.DistributedDataParallel(m) for m in models]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scalers = [GradientScaler(m, 'gs', update_interval=1,
                              measure_underflow=False) for m in models]
    prepare, native = speculation.prepare, []

    def counted(current):
        found = prepare(current)
        if found is not None:
            native.append(found)
        return found
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    record = {'rank': rank, 'same': [], 'native': 0}
    for step in range(6):
        x = torch.randn(4, 3, 4, 4, generator=g)
        t = torch.randint(0, 5, (4,), generator=g)
        steps = []
        for k, (m, w, opt, scaler) in enumerate(zip(
                models, wrapped, optimizers, scalers)):
            speculation.prepare = counted if k == 0 else (
                lambda current: None)
            try:
                opt.zero_grad()
                loss = F.cross_entropy(w(x), t) * 2.0 ** -20
                scaler.scale(loss).backward()
                scaler.step(opt)
                landed = [scaler.hook.landed_scales.get(p)
                          for p in m.parameters()]
                grads = [p.grad.clone() for p in m.parameters()]
                scaler.update()
            finally:
                speculation.prepare = prepare
            steps.append((grads, landed, dict(scaler.hook.table.scales)))
        (a, landed_a, table_a), (b, landed_b, table_b) = steps
        record['same'].append(
            all(torch.equal(p, q) for p, q in zip(a, b)) and
            landed_a == landed_b and table_a == table_b)
    record['native'] = sum(p.native_sites for p in native)
    record['scales'] = sorted(set(scalers[0].hook.table.scales.values()))
    return record


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, 'to_local') else tensor


class _count_collectives(object):
    """Counts the Python-level collectives on floating-point tensors of
    more than 16 elements (DDP's and FSDP's own run in C++, unseen; the
    scaler's agreement sends integers and bytes): the scaler must add
    none over the gradients. The collectives that pickle raise."""

    def __init__(self, record):
        self.originals = {}
        for name in ('all_gather_object', 'broadcast_object_list',
                     'gather_object', 'scatter_object_list'):
            self.originals[name] = getattr(dist, name)

            def pickles(*args, _name=name, **kwargs):
                raise AssertionError('the step pickled: ' + _name)
            setattr(dist, name, pickles)
        for name in ('all_reduce', 'all_gather', 'reduce_scatter',
                     'all_gather_into_tensor', 'reduce_scatter_tensor'):
            original = getattr(dist, name)
            self.originals[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                first = tensor[0] if isinstance(tensor, list) else tensor
                if first.is_floating_point() and first.numel() > 16:
                    record['gradient_reductions'] += 1
                return _original(tensor, *args, **kwargs)
            setattr(dist, name, counted)

    def undo(self):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def run(rank, world, scenario, port, out):
    dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{}'.format(
        port), rank=rank, world_size=world)
    try:
        if scenario in ('once', 'persistent'):
            record = faults(rank, scenario, out)
        elif scenario == 'speculated':
            record = speculated_as_python(rank, out)
        else:
            record = equal_to_plain(rank, scenario, out)
        with open('{}.{}'.format(out, rank), 'w') as f:
            json.dump(record, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == '__main__':
    scenario, out, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mp.spawn(run, args=(2, scenario, port, out), nprocs=2)
