"""Run under mpiexec -n 2: GS data-parallel training; saves each rank's params.

Each rank sees different data; after training the replicas must be equal.
"""

import gradient_scaling  # NOQA

import os
import sys

import numpy as np

import chainer
import chainermn

from test_training import build  # NOQA
from test_training import digits  # NOQA

from gradient_scaling.chainer import training  # NOQA


def main():
    out = sys.argv[1]
    comm = chainermn.create_communicator('naive')
    config = training.ScalingConfig(scaling='gs', update_interval=3)
    model, optimizer, scaler = build(config, seed=0)
    comm.bcast_data(model)
    train = digits('train')
    if comm.rank == 0:
        train = chainermn.scatter_dataset(train, comm, shuffle=True, seed=0)
    else:
        train = chainermn.scatter_dataset(None, comm, shuffle=True, seed=0)
    it = chainer.iterators.SerialIterator(train, 16, shuffle=False)
    updater = training.ScalingUpdater(it, optimizer, scaler, config,
                                      communicator=comm)
    trainer = chainer.training.Trainer(updater, (30, 'iteration'), out=out)
    trainer.run()
    arrays = {name.replace('/', '_'): p.array
              for name, p in model.namedparams()}
    arrays['__skips'] = np.array(updater.skips)
    np.savez(os.path.join(out, 'rank{}.npz'.format(comm.rank)), **arrays)


if __name__ == '__main__':
    main()
