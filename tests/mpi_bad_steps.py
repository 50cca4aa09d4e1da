"""Run under mpiexec -n 2: faults on rank 1 only; every rank must agree.

    python mpi_bad_steps.py OUT SCALING persistent   # rank 1 NaN every step
    python mpi_bad_steps.py OUT SCALING single       # one data, one scale fault

Writes OUT/rank<r>.npz (parameters, skips, scaler state) or, when the run
ends with GradientOverflowError, OUT/rank<r>.raised (the message). Chainer's
and ChainerMN's global except hooks are not installed: a rank that raised
while the other waited in a collective would hang the job.
"""

import gradient_scaling  # NOQA

import os
import sys
import warnings

import numpy as np

import chainer
import chainermn

from fault_nets import batches  # NOQA
from fault_nets import build  # NOQA
from fault_nets import ListIterator  # NOQA

from gradient_scaling.chainer import training  # NOQA
from gradient_scaling.core.scaler import GradientOverflowError  # NOQA


def main():
    out, scaling, scenario = sys.argv[1:4]
    comm = chainermn.create_communicator('naive')
    model, optimizer, scaler, config = build(scaling, 'sim-fp16', seed=0,
                                             update_interval=3)
    comm.bcast_data(model)
    data = batches(8, seed=1 + comm.rank)  # each rank its own data
    updater = training.ScalingUpdater(ListIterator(data), optimizer, scaler,
                                      config, communicator=comm)
    warnings.simplefilter('ignore')
    try:
        for i in range(40):
            if comm.rank == 1:
                if scenario == 'persistent':
                    model.fault = ('input', np.nan)
                elif scenario == 'single' and i == 3:
                    model.fault = ('input', np.nan)
                elif scenario == 'single' and i == 6:
                    model.fault = ('gradient', np.inf)
            updater.update()
    except GradientOverflowError as e:
        with open(os.path.join(out, 'rank{}.raised'.format(comm.rank)),
                  'w') as f:
            f.write('{} {}'.format(updater.iteration, e))
        return
    serializer = chainer.serializers.DictionarySerializer()
    scaler.serialize(serializer)
    arrays = {'param' + name.replace('/', '_'): p.array
              for name, p in model.namedparams()}
    # GS's telemetry (records/) is each rank's own measurement; the state
    # that decides the scales must agree.
    arrays.update({'scaler_' + k.replace('/', '_'): np.asarray(v)
                   for k, v in serializer.target.items()
                   if not k.startswith('records/')})
    arrays['skips'] = np.array(updater.skips)
    np.savez(os.path.join(out, 'rank{}.npz'.format(comm.rank)), **arrays)


if __name__ == '__main__':
    main()
