"""One decision on every rank, from tensors: no pickling in the step.

With ``torch.distributed`` the gradients are averaged by whatever the
user trains with (``DistributedDataParallel``, FSDP), and they land
unscaled, so a rank's gradients are the true ones whatever scales it
chose. What the ranks must still agree on is the step's decision and the
scales they commit: :func:`exchange` gives every rank every rank's
payload (:class:`~gradient_scaling.core.scaler.Payload`, or a
loss-scaled mode's), and the scalers decide from those the same way on
every rank (the committed scale of a site is the smallest any rank
staged).

A step with nothing to tell beyond "finite" (a cached pass: no scales
staged, nothing overflowed) costs one all-reduce of one integer. Any other
step (a refresh, a skipped step) then gathers each rank's payload as a
JSON document of names and numbers, sent as bytes: two small
``all_gather`` calls, no ``pickle`` (``all_gather_object`` would unpickle
what another process sent).
"""

import json

import torch
import torch.distributed as dist

__all__ = ['exchange', 'all_true']


def exchange(payload, group):
    """Every rank's payload, in rank order (only this rank's when no rank
    has anything to tell but a finite step).

    Args:
        payload: This rank's payload: ``quiet()``, ``to_dict()`` and the
            class method ``from_dict``.
        group: The ``torch.distributed`` process group.

    """
    device = _device(group)
    flag = torch.tensor([0 if payload.quiet() else 1], dtype=torch.int64,
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return [payload]
    data = json.dumps(payload.to_dict(), sort_keys=True).encode('utf-8')
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [type(payload).from_dict(json.loads(
        g[:int(n.item())].cpu().numpy().tobytes().decode('utf-8')))
        for g, n in zip(gathered, sizes)]


def all_true(flag, group):
    """Whether ``flag`` is true on every rank (one all-reduce)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int64,
                         device=_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def _device(group):
    """Where the group's collectives take tensors (NCCL: the current
    CUDA device; gloo and the others: the CPU)."""
    if dist.get_backend(group) == 'nccl':
        return torch.device('cuda', torch.cuda.current_device())
    return torch.device('cpu')
