"""PyTorch Lightning runs for tests/test_torch_frameworks.py.

A small regression ``LightningModule`` whose ``training_step`` calls an
inner ``self.net`` (Linear, BatchNorm, ReLU, Linear), so the module's own
``forward`` never runs, trained with Lightning's fp16 autocast on the CPU
and the scaler under test in ``MixedPrecision('16-mixed', 'cpu',
scaler=...)``.

Run as a script, it is the DDP test's trainer: ``python
torch_lightning_runs.py KIND OUT`` trains with ``strategy='ddp'`` on two
CPU processes (gloo), each rank on its own half of the data, rank 1 with
a batch that overflows at step ``FAULT_STEP``, and writes what each rank
saw to ``OUT/rank<r>.json``.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins import MixedPrecision

N_BATCHES = 4
BATCH = 16
FAULT_STEP = 2


class Regression(pl.LightningModule):

    """y = sum(x) by a two-layer net with BatchNorm, SGD; ``fault_step``:
    the global step whose batch is multiplied by 1e6 (an fp16 overflow
    in the first Linear, so BatchNorm sees inf)."""

    def __init__(self, fault_step=None, lr=0.05):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.fault_step = fault_step
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.fault_step:
            x = x * 1e6
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(seed=0, n_batches=N_BATCHES):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * BATCH, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


class Record(pl.Callback):

    """Each batch's loss, whether the weights moved, the inner net's
    state before and after the batch at ``watch`` (a global step), and
    the scaler's state_dict when training starts."""

    def __init__(self, watch=None):
        self.losses, self.moved = [], []
        self.watch = watch
        self.around_watch = []
        self.scaler_state_at_start = None

    def on_train_start(self, trainer, module):
        scaler = trainer.precision_plugin.scaler
        self.scaler_state_at_start = plain(scaler.state_dict())

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._before = _copy(module.net.state_dict())
        if trainer.global_step == self.watch:
            self.around_watch = [self._before]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        after = module.net.state_dict()
        self.losses.append(float(outputs['loss']))
        self.moved.append(not all(torch.equal(after[k], self._before[k])
                                  for k in after if 'weight' in k))
        if len(self.around_watch) == 1:
            self.around_watch.append(_copy(after))


def _copy(state):
    return {k: v.detach().clone() for k, v in state.items()}


def plain(state):
    """A state_dict as JSON text (tensors as lists), for equality that
    holds for NaN too (GS's telemetry holds NaN where nothing was
    measured)."""
    def convert(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        raise TypeError(type(value))
    return json.dumps(state, sort_keys=True, default=convert)


def trainer(scaler, root, record, max_epochs, **kwargs):
    """A quiet CPU Trainer with Lightning's fp16 autocast and ``scaler``.

    LightningEnvironment is named: Lightning otherwise probes MPI, which
    fails where mpi4py is installed without an MPI library (this venv).
    """
    return pl.Trainer(
        accelerator='cpu', max_epochs=max_epochs, callbacks=[record],
        plugins=[MixedPrecision('16-mixed', 'cpu', scaler=scaler),
                 LightningEnvironment()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), **kwargs)


def fit(make_scaler, root, max_epochs=3, ckpt_path=None, save=None,
        seed=0, fault_step=None, **kwargs):
    """Trains a fresh Regression (seeded) with ``make_scaler(module)``;
    returns the module, its Record and the scaler. ``save``: a path for
    a checkpoint at the end."""
    torch.manual_seed(seed)
    module = Regression(fault_step=fault_step)
    record = Record(watch=fault_step)
    scaler = make_scaler(module)
    run = trainer(scaler, root, record, max_epochs, **kwargs)
    run.fit(module, loader(), ckpt_path=ckpt_path)
    if save is not None:
        run.save_checkpoint(save)
    return module, record, scaler


def ddp_main(kind_name, out):
    """Both ranks: DDP training, rank 1 overflowing at FAULT_STEP."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dropin_scalers import KINDS, loss_scale_settings, make
    kind = {k.name: k for k in KINDS}[kind_name]

    class RankFault(Regression):
        def training_step(self, batch, batch_idx):
            self.fault_step = FAULT_STEP if self.global_rank == 1 else None
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    module = RankFault()
    record = Record()
    scaler = make(kind, module, **loss_scale_settings(kind))
    run = trainer(scaler, out, record, max_epochs=2, strategy='ddp',
                  devices=2)
    run.fit(module, loader(n_batches=2 * N_BATCHES))
    with open(os.path.join(out, 'rank{}.json'.format(run.global_rank)),
              'w') as f:
        json.dump({'losses': record.losses, 'moved': record.moved,
                   'weights': [p.detach().double().sum().item()
                               for p in module.parameters()],
                   'buffers': [b.double().sum().item()
                               for b in module.buffers()
                               if b.is_floating_point()]}, f)


if __name__ == '__main__':
    ddp_main(sys.argv[1], sys.argv[2])
