"""GradientScaler: ``torch.amp.GradScaler``'s verbs for every scaling mode.

Replace ``torch.amp.GradScaler`` by it and change nothing else::

    scaler = GradientScaler(model)                 # mode='gs' by default
    for x, t in loader:
        optimizer.zero_grad()
        with torch.autocast('cuda', dtype=torch.float16):
            loss = loss_fn(model(x), t)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)                 # optional: clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        taken = scaler.step(optimizer)             # True if not skipped
        scaler.update()

The step, as in the Chainer adapter (docs/DESIGN.md, 6): the backward's
result is decided once (combined over ``torch.distributed`` ranks before
anyone acts on it); a finite step is unscaled (each gradient divided by
its own scale, in FP32) and taken; a non-finite one is skipped and changes
nothing: parameters, optimizer state, and every buffer of every module
(BatchNorm's running statistics, which the forward pass already moved, are
put back). A data fault (a non-finite loss, input or forward activation)
changes no scale; a scale fault backs off what overflowed; ``patience``
skips in a row with nothing left to back off raise
:class:`~gradient_scaling.core.step.GradientOverflowError`, on every rank.

Per optimizer, as GradScaler's ``OptState``:

=============  ==============================  =================================
stage          call                            then
=============  ==============================  =================================
``ready``      :meth:`unscale_`                ``unscaled`` (the step decided)
``ready``      :meth:`step`                    ``stepped`` (unscaled first)
``unscaled``   :meth:`step`                    ``stepped``
any            :meth:`update`                  every optimizer ``ready`` again
=============  ==============================  =================================

``unscale_`` twice, ``unscale_`` after ``step``, ``step`` twice, or
``update`` with no ``step`` since the last one raise ``RuntimeError``.
"""

import torch
import torch.distributed as dist

from gradient_scaling.core import recipes
from gradient_scaling.core import step as step_module
from gradient_scaling.core import telemetry
from gradient_scaling.core.step import PassResult
from gradient_scaling.torch import agreement
from gradient_scaling.torch import strategies
from gradient_scaling.torch import unscaling
from gradient_scaling.torch.hook import unwrapped
from gradient_scaling.torch.module_state import ModuleState

__all__ = ['GradientScaler', 'MODES']

#: PyTorch's modes: ``dynamic`` is GradScaler's own semantics.
MODES = ('fp32', 'none', 'fixed', 'dynamic', 'gs', 'amax-delayed',
         'amax-current')


class GradientScaler(object):

    """Gradient scaling (or a baseline) with GradScaler's verbs.

    Args:
        model (torch.nn.Module): The model trained (names the sites; its
            buffers are put back when a step is skipped).
        mode (str): One of :data:`MODES`.
        recipe (~gradient_scaling.core.recipes.Recipe): Every setting at
            once, or ``**settings``: the recipe's fields (``underflow_rate``,
            ``update_interval``, ``fmt``, ``estimator``, ``loss_scale``,
            ``init_scale``, ``growth_interval``, ...).
        process_group: A ``torch.distributed`` group; by default the
            world, when ``torch.distributed`` is initialized with several
            ranks. Every rank then takes the same decision and commits the
            same scales (:mod:`~gradient_scaling.torch.agreement`). The
            gradients are averaged by what the model is trained with, as
            with GradScaler: ``DistributedDataParallel`` (the scaler may
            be given the wrapper or its module) or FSDP's
            ``fully_shard``; under GS they land unscaled, so these read
            true gradients.

    """

    def __init__(self, model, mode='gs', recipe=None, process_group=None,
                 **settings):
        if recipe is None:
            if mode not in MODES:
                raise ValueError('mode must be one of {}, got {!r}'.format(
                    ', '.join(MODES), mode))
            mode = 'dynamic-gradscaler' if mode == 'dynamic' else mode
            if mode in ('gs', 'amax-delayed', 'amax-current'):
                recipe = recipes.hook_recipe(
                    estimator=settings.pop('estimator', 'model')
                    if mode == 'gs' else mode, **settings)
            else:
                recipe = recipes.for_mode(mode, **settings)
        elif settings:
            raise ValueError('pass a recipe or settings, not both')
        self.model = model
        self.recipe = recipe
        self.strategy = strategies.make(recipe, unwrapped(model))
        self.process_group = process_group
        self.state = ModuleState(unwrapped(model))
        self._stages = {}
        self._decided = None  # (payloads, result) of the step
        # The buffers are captured before the first module that has some
        # runs in a step, whoever calls it (a LightningModule's
        # training_step calling self.net(x), a DDP wrapper).
        self._capture = [m.register_forward_pre_hook(self._forward)
                         for m in self.state.owners()]
        self._model_params = set(model.parameters())

    @property
    def guard(self):
        return self.strategy.guard

    def _forward(self, module, inputs):
        if not self.state.captured:
            self.state.capture()

    def _world(self):
        if self.process_group is not None:
            return self.process_group
        if dist.is_available() and dist.is_initialized() and \
                dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

    # -- the verbs ---------------------------------------------------------

    def scale(self, outputs):
        """The loss (or losses) to call ``backward`` on."""
        return self.strategy.scale(outputs, ranked=self._world() is not None)

    def unscale_(self, optimizer):
        """Decides the step, which leaves every gradient of the model
        divided by its scale (in FP32 for FP32 parameters); divides those
        of ``optimizer``'s other parameters by theirs."""
        stage = self._stages.get(id(optimizer), 'ready')
        if stage == 'unscaled':
            raise RuntimeError('unscale_() has already been called on this '
                               'optimizer since the last update()')
        if stage == 'stepped':
            raise RuntimeError('unscale_() is being called after step()')
        for group in optimizer.param_groups:
            for param in group['params']:
                if param.grad is not None:
                    _check_dtype(param)
        payloads, result = self._decide()
        if result.finite:
            unscaling.unscale(
                (p.grad, self.strategy.scale_of(p))
                for group in optimizer.param_groups for p in group['params']
                if p.grad is not None and p not in self._model_params)
        self._stages[id(optimizer)] = 'unscaled'

    def step(self, optimizer, *args, **kwargs):
        """Takes ``optimizer``'s step if the backward was finite; returns
        whether it did. A skipped step puts the modules' buffers back."""
        stage = self._stages.get(id(optimizer), 'ready')
        if stage == 'stepped':
            raise RuntimeError('step() has already been called since the '
                               'last update()')
        if stage == 'ready':
            self.unscale_(optimizer)
        _, result = self._decided
        self._stages[id(optimizer)] = 'stepped'
        if result.finite:
            optimizer.step(*args, **kwargs)
            return True
        self.state.restore()
        return False

    def update(self):
        """The mode's transition for the decided step (grow, back off,
        commit the scales staged); every optimizer is ready again.

        Raises:
            GradientOverflowError: When overflow persists.

        """
        if self._decided is None or 'stepped' not in self._stages.values():
            raise RuntimeError('update() needs a step() since the last '
                               'update()')
        payloads, _ = self._decided
        self._decided, self._stages = None, {}
        self.state.captured = False
        self.strategy.after_update()
        step_module.decide(payloads, self.guard, self.strategy.transition,
                           self.strategy.scale_text)

    def _decide(self):
        """Every rank's payload and the combined result, once per step
        (the same on every rank)."""
        if self._decided is None:
            payload = self.strategy.payload(self.model)
            group = self._world()
            if group is None or not self.strategy.checks:
                payloads = [payload]
            else:
                payloads = agreement.exchange(payload, group)
            result = PassResult.combine(p.result for p in payloads)
            self._decided = (payloads, result)
        return self._decided

    # -- state ---------------------------------------------------------------

    def report(self):
        """Gradient scaling's telemetry, one record per site as of its
        last refresh (empty for a loss-scaling mode)."""
        return self.strategy.report()

    def to_csv(self, file=None):
        """Writes :meth:`report` as CSV to a path or file; returns the
        text."""
        return telemetry.write_csv(self.report(), file)

    def get_scale(self):
        """The loss scale (a float), or, for gradient scaling, the
        committed local scale of every site (a dict)."""
        return self.strategy.get_scale()

    def state_dict(self):
        """The mode's state between steps (plain Python values)."""
        return {'mode': self.recipe.mode,
                'state': self.strategy.state_dict()}

    def load_state_dict(self, state):
        if state.get('mode') != self.recipe.mode:
            raise ValueError('a state of mode {!r}, this scaler is {!r}'
                             .format(state.get('mode'), self.recipe.mode))
        self.strategy.load_state_dict(state['state'])


def _check_dtype(param):
    if param.grad.dtype in (torch.float16, torch.bfloat16):
        raise ValueError('Attempting to unscale FP16 gradients: keep the '
                         'parameters in FP32 (torch.autocast casts them '
                         'where it computes in low precision)')
