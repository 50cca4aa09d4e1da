"""Several processes: ``torchrun --nproc_per_node N examples/torch/train.py``.

Each process trains on its own share of every batch
(:class:`~torch_example.data.BatchStream`); the
:class:`~gradient_scaling.torch.GradientScaler` takes one decision for all
and averages the gradients itself, at one scale per parameter (it refuses
``DistributedDataParallel``). As DDP does, every process starts from
rank 0's weights and takes rank 0's BatchNorm statistics after each step,
so the replicas stay identical and a snapshot of rank 0 is the whole
run's; evaluation counts are summed over the processes. The backend is
gloo on CPUs and NCCL on GPUs.

>>> world = World.start(gpu=-1)     # one process without torchrun
>>> world.rank, world.size
(0, 1)
"""

import os

import numpy as np
import torch
import torch.distributed as dist

__all__ = ['World', 'largest_difference']


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
    def start(cls, gpu):
        """The world of this process, joined (torchrun's environment)."""
        size = int(os.environ.get('WORLD_SIZE', '1'))
        local = int(os.environ.get('LOCAL_RANK', '0'))
        device = torch.device('cuda', gpu + local) if gpu >= 0 else \
            torch.device('cpu')
        if size == 1:
            return cls(device=device)
        if device.type == 'cuda':
            torch.cuda.set_device(device)
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
        return cls(dist.get_rank(), size, dist.group.WORLD, device)

    @property
    def main(self):
        """Whether this process prints and writes (rank 0)."""
        return self.rank == 0

    def log(self, *values):
        if self.main:
            print(*values, flush=True)

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

    def close(self):
        if self.group is not None:
            dist.destroy_process_group()


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
