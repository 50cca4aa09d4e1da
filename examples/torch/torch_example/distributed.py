"""Several processes: ``torchrun --nproc_per_node N examples/torch/train.py``.

Each process trains on its own share of every batch
(:class:`~torch_example.data.BatchStream`) through
``DistributedDataParallel`` (:meth:`World.data_parallel`), which starts
every process from rank 0's weights and averages the gradients during the
backward, as any PyTorch user trains; the
:class:`~gradient_scaling.torch.GradientScaler`'s gradients land unscaled,
so DDP averages true gradients, and the scaler takes one decision for all.
Every process takes rank 0's BatchNorm statistics after each step, so the
replicas stay identical and a snapshot of rank 0 is the whole run's;
evaluation counts are summed over the processes. The backend is gloo on
CPUs and NCCL on GPUs.

A :class:`World` is left with ``with``: after a normal end every process
waits for the others, then the group is destroyed and its threads
stopped (:meth:`World.close`); a collective that waits longer than
:data:`TIMEOUT` for another process fails instead of hanging.

>>> with World.start(gpu=-1) as world:     # one process without torchrun
...     world.rank, world.size
(0, 1)
"""

import datetime
import gc
import importlib
import os

import numpy as np
import torch
import torch.distributed as dist

__all__ = ['TIMEOUT', 'World', 'largest_difference']

# How long a collective waits for the other processes (torch's default
# is 30 minutes): longer than any step, evaluation or snapshot of the
# example, short enough that a process stuck or gone does not leave the
# others waiting for half an hour (torchrun also stops them all as soon
# as one fails).
TIMEOUT = datetime.timedelta(minutes=10)


class World(object):

    """This process among those ``torchrun`` started (alone without it).

    Attributes:
        rank, size (int): This process's rank and how many there are.
        group: The process group (None for one process).
        device (torch.device): This process's device: the CPU, or GPU
            ``--gpu`` plus the local rank.

    """

    def __init__(self, rank=0, size=1, group=None, device=None):
        self.rank, self.size, self.group = rank, size, group
        self.device = device or torch.device('cpu')

    @classmethod
    def start(cls, gpu, timeout=TIMEOUT):
        """The world of this process, joined (torchrun's environment);
        leave it with ``with`` or :meth:`close`."""
        size = int(os.environ.get('WORLD_SIZE', '1'))
        local = int(os.environ.get('LOCAL_RANK', '0'))
        device = torch.device('cuda', gpu + local) if gpu >= 0 else \
            torch.device('cpu')
        if size == 1:
            return cls(device=device)
        if device.type == 'cuda':
            torch.cuda.set_device(device)
        # Imported before the group exists: torch.distributed.nn's
        # collectives take ``group.WORLD`` as a default argument value,
        # read on import, and torch imports the module lazily (with
        # torch._dynamo, when the optimizer is made); imported after
        # init_process_group it would hold the group for good, and close
        # could not end the backend's threads.
        importlib.import_module('torch.distributed.nn')
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo',
                                timeout=timeout)
        return cls(dist.get_rank(), size, dist.group.WORLD, device)

    @property
    def main(self):
        """Whether this process prints and writes (rank 0)."""
        return self.rank == 0

    def log(self, *values):
        if self.main:
            print(*values, flush=True)

    def data_parallel(self, module):
        """``module`` as trained in this world: wrapped in
        ``DistributedDataParallel`` with several processes (rank 0's weights
        everywhere; the BatchNorm statistics are :meth:`broadcast_state`'s
        after each step), itself with one."""
        if self.group is None:
            return module
        return torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[self.device.index]
            if self.device.type == 'cuda' else None,
            process_group=self.group, broadcast_buffers=False)

    def broadcast_state(self, module, parameters=True):
        """Gives every process rank 0's buffers (and parameters)."""
        if self.group is None:
            return
        tensors = list(module.buffers())
        if parameters:
            tensors += list(module.parameters())
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor.data, 0, group=self.group)

    def sum(self, values):
        """``values`` (a NumPy array) summed over the processes."""
        if self.group is None:
            return values
        tensor = torch.as_tensor(values, device=self.device)
        dist.all_reduce(tensor, group=self.group)
        return tensor.cpu().numpy()

    def replica_difference(self, module):
        """The largest difference of any parameter or buffer between this
        process and rank 0 (0.0: identical bit for bit, NaNs alike)."""
        if self.group is None:
            return 0.0
        flat = torch.cat([t.detach().double().flatten() for t in
                          list(module.parameters()) + list(module.buffers())])
        flats = [torch.empty_like(flat) for _ in range(self.size)]
        dist.all_gather(flats, flat, group=self.group)
        return largest_difference([f.cpu().numpy() for f in flats])

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        self.close(clean=kind is None)
        return False

    def close(self, clean=True):
        """Leaves the process group (nothing to do for one process).

        ``clean`` (the run ended normally on every process): the
        processes first wait for each other (a barrier), so that none
        tears its connections down while another is still in a
        collective. After an exception there is no barrier (the others
        are elsewhere); this process's group goes, and its peers fail
        on their next collective, or torchrun stops them.

        Then the group is destroyed and, its last references collected,
        its backend: gloo's worker threads end here, while the
        interpreter is fully alive. ``destroy_process_group`` alone does
        not stop them while anything still refers to the group (the
        scaler, in a cycle with the model's hooks until the garbage is
        collected; torch.distributed.nn, see :meth:`start`); they then
        live on into the interpreter's finalization, and one that only
        then drops the tensors of the last collective (which needs the
        GIL) is ended inside a C++ destructor: the process aborts,
        "terminate called without an active exception". Call it once
        the training's objects are unreachable (``with`` around a
        function that trains).
        """
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            if clean:
                dist.barrier(group=group, device_ids=[self.device.index]
                             if self.device.type == 'cuda' else None)
        finally:
            del group
            dist.destroy_process_group()
            gc.collect()  # the last references: the backend's threads end


def largest_difference(flats):
    """The largest absolute difference between ``flats[0]`` and any other
    array, NaN equal to NaN and infinities to themselves (inf if only one
    of two values is NaN or infinite)."""
    worst = 0.0
    for other in flats[1:]:
        same = (flats[0] == other) | (np.isnan(flats[0]) & np.isnan(other))
        if not same.all():
            with np.errstate(invalid='ignore'):
                gap = np.abs(flats[0] - other)[~same]
            worst = max(worst, float(np.nan_to_num(gap, nan=np.inf).max()))
    return worst
