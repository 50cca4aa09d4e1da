"""GradientScaler: ``torch.amp.GradScaler`` with per-tensor gradient scaling.

Replace ``torch.amp.GradScaler`` by it and change nothing else::

    scaler = GradientScaler(model)                 # mode='gs' by default
    for x, t in loader:
        optimizer.zero_grad()
        with torch.autocast('cuda', dtype=torch.float16):
            loss = loss_fn(model(x), t)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)                 # optional: clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                     # None when skipped
        scaler.update()

It takes GradScaler's constructor (``GradientScaler('cuda',
init_scale=...)``), has every public method of GradScaler with its
meaning, and reads and writes GradScaler's ``state_dict`` keys, so that a
GradScaler checkpoint resumes into ``mode='dynamic'`` and back. Where GS
has no single loss scale, the meaning is the one that keeps user code
right: the gradients land in ``.grad`` unscaled, so the factor on them,
:meth:`get_scale`, is 1 (each site's own scale: :meth:`site_scales`).

The step, as in the Chainer adapter (docs/DESIGN.md, 6): the backward's
result is decided once (the same on every ``torch.distributed`` rank); a
finite step is taken; a non-finite one is skipped and changes nothing:
parameters, optimizer state, and every buffer of every module of the
model (BatchNorm's running statistics, which the forward pass already
moved, are put back). A data fault (a non-finite loss, input or forward
activation) changes no scale; a scale fault backs off what overflowed;
``patience`` skips in a row with nothing left to back off raise
:class:`~gradient_scaling.core.scaler.GradientOverflowError`, on every rank
(``mode='dynamic', bounded=False``: GradScaler's own behaviour, never).

Per optimizer, as GradScaler's ``OptState``: the stages of
:class:`~gradient_scaling.core.scaler.Scaler` (the step's policy, the same
as the Chainer adapter's; this class adds PyTorch's verbs: the fused
unscale and check, the collectives, the modules' buffers).
``unscale_`` twice, ``unscale_`` after ``step``, ``step`` twice, or
``update`` with no ``step`` since the last one raise ``RuntimeError``. A
loss-scaled mode decides per optimizer (GradScaler: an optimizer whose own
gradients are finite steps); gradient scaling decides per step (one
backward, one set of scales: every optimizer steps or none).
"""

import dataclasses
import functools
import inspect
import math
import warnings
import weakref

import torch
import torch.distributed as dist

from gradient_scaling.core import recipes
from gradient_scaling.core import scaler as core
from gradient_scaling.core import faults
from gradient_scaling.core import telemetry
from gradient_scaling.torch import _internals as internals
from gradient_scaling.torch import agreement
from gradient_scaling.torch import native
from gradient_scaling.torch import unscaling
from gradient_scaling.torch.hook import GradientScaling
from gradient_scaling.torch.hook import unwrapped

__all__ = ['GradientScaler', 'MODES']

#: The modes (:data:`gradient_scaling.core.recipes.MODES`, the same as
#: Chainer's): ``dynamic`` is the paper's Dyn-LS, ``dynamic-gradscaler``
#: GradScaler's own dynamic loss scaling.
MODES = tuple(recipes.MODES)
#: The modes GradScaler's growth settings apply to.
_GRADSCALER = 'dynamic-gradscaler'
#: GradScaler's growth settings and their defaults.
GROWTH = (('init_scale', 2.0 ** 16), ('growth_factor', 2.0),
          ('backoff_factor', 0.5), ('growth_interval', 2000))
#: Where a GradientScaler keeps its own entries in ``state_dict()``.
PREFIX = 'gradient_scaling/'


class GradientScaler(object):

    """Gradient scaling (or a baseline) as a ``torch.amp.GradScaler``.

    Args:
        model (torch.nn.Module): The model trained, optional: names the
            sites (``layer1.0.conv1.weight``; without it, in the order the
            backward meets them: ``param#0``, ...) and has its buffers put
            back when a step is skipped. A ``DistributedDataParallel``
            wrapper or its module. Positionally: ``GradientScaler(model)``,
            ``GradientScaler(model, 'dynamic')``; or GradScaler's order,
            ``GradientScaler('cuda', 2.0 ** 16, ...)``.
        mode (str): One of :data:`MODES` (default ``'gs'``).
        device, init_scale, growth_factor, backoff_factor,
            growth_interval, enabled: GradScaler's.
            ``mode='dynamic-gradscaler'`` grows and backs off with them;
            gradient scaling keeps them (its getters and ``state_dict``
            report them) and has no use for them. ``enabled=False``:
            nothing is scaled or checked, ``step`` always steps, as
            GradScaler.
        recipe (~gradient_scaling.core.recipes.Recipe): Every setting at
            once, or ``**settings``: the recipe's fields (``underflow_rate``,
            ``update_interval``, ``fmt``, ``estimator``, ``loss_scale``,
            ``dynamic_interval``, ``bounded``, ``patience``, ...).
        process_group: A ``torch.distributed`` group; by default the
            world, when ``torch.distributed`` is initialized with several
            ranks. Every rank then takes the same decision and commits the
            same scales (:mod:`~gradient_scaling.torch.agreement`). The
            gradients are averaged by what the model is trained with, as
            with GradScaler: ``DistributedDataParallel`` or FSDP's
            ``fully_shard``; under GS they land unscaled, so these read
            true gradients.

    """

    def __init__(self, device=None, init_scale=2.0 ** 16, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, enabled=True, *,
                 model=None, mode='gs', recipe=None, process_group=None,
                 **settings):
        if isinstance(device, torch.nn.Module):
            # GradientScaler(model[, mode]): the project's own short form
            model, device = device, None
            if isinstance(init_scale, str):
                mode, init_scale = init_scale, 2.0 ** 16
        if device is not None and str(device).startswith('cuda') and \
                enabled and not torch.cuda.is_available():
            warnings.warn('GradientScaler is enabled for {!r}, but CUDA is '
                          'not available. Disabling.'.format(device))
            enabled = False
        if growth_factor <= 1.0:
            raise ValueError('The growth factor must be > 1.0, got {!r}'
                             .format(growth_factor))
        if backoff_factor >= 1.0:
            raise ValueError('The backoff factor must be < 1.0, got {!r}'
                             .format(backoff_factor))
        self._device = 'cuda' if device is None else str(device)
        self._enabled = bool(enabled)
        self._growth = {'init_scale': float(init_scale),
                        'growth_factor': float(growth_factor),
                        'backoff_factor': float(backoff_factor),
                        'growth_interval': int(growth_interval)}
        self._settings = dict(settings)
        if recipe is None:
            recipe = self._recipe(mode, settings)
        elif settings:
            raise ValueError('pass a recipe or settings, not both')
        self.model = model
        self.recipe = recipe
        self.process_group = process_group
        self._build()

    def _recipe(self, mode, settings):
        if mode not in MODES:
            raise ValueError('mode must be one of {}, got {!r}'.format(
                ', '.join(MODES), mode))
        if not self._enabled:
            return recipes.for_mode('none')
        if mode in ('gs', 'amax-delayed', 'amax-current'):
            settings = dict(settings)
            return recipes.hook_recipe(
                estimator=settings.pop('estimator', 'model')
                if mode == 'gs' else mode, **settings)
        if mode == _GRADSCALER:
            growth = dict(self._growth)
            if 'init_scale' not in settings and growth['init_scale'] > \
                    settings.get('max_scale', 2.0 ** 24) and \
                    settings.get('bounded', True):
                growth['init_scale'] = settings.get('max_scale', 2.0 ** 24)
            return recipes.for_mode(_GRADSCALER, **dict(growth, **settings))
        return recipes.for_mode(mode, **settings)

    def _build(self):
        """The policy, hook, buffers and step for ``self.model`` (also after
        unpickling, which drops the model)."""
        module = unwrapped(self.model)
        #: GS: the hook that scales every gradient tensor (None for a
        #: loss-scaled mode).
        self.hook = GradientScaling(module, recipe=self.recipe) \
            if self.recipe.per_tensor else None
        self.policy = core.policy_for(
            self.recipe, self.hook and self.hook.controller)
        self._core = core.Scaler(self.policy)
        # The buffers a skipped step puts back: where they are, found once
        # (walking the module tree costs more than the copies), read by
        # name at every capture (a buffer replaced by another tensor is the
        # one saved); a submodule added later is not included.
        self._buffer_places = [] if module is None else [
            (m, name) for m in module.modules()
            for name, _ in m.named_buffers(recurse=False)]
        self._saved_buffers = []  # their values, as captured
        self._captured_buffers = []  # the buffers saved into them
        self._buffers_captured = False  # this step's capture is done
        # Names for a failed step's message (the model's, found once).
        self._param_names = {} if module is None else {
            p: n for n, p in module.named_parameters()}
        self._losses = []  # a checked loss-scaled step's, for its check
        self._step_group = None  # (the step's process group, as scaled)
        # (whether an optimizer's groups hold a float16 gradient: one
        # native call, where built, instead of a Python read per parameter;
        # a loss-scaled mode does not build the module for it)
        self._half_gradients = native.half_gradients(
            build=self.hook is not None)
        #: Whether the last :meth:`step` was taken (None before any).
        self.step_taken = None
        # The buffers are captured before the first module that has some
        # runs in a step, whoever calls it (a LightningModule's
        # training_step calling self.net(x), a DDP wrapper).
        # (Through a weak reference: a deep copy of the model, an EMA
        # twin, must not copy the scaler with it.)
        capture = functools.partial(_capture_weakly, weakref.ref(self))
        self._capture = [] if module is None else [
            m.register_forward_pre_hook(capture)
            for m in _buffer_owners(module, self._buffer_places)]

    @property
    def guard(self):
        """The overflow policy (skip counts, patience)."""
        return self.policy.guard

    def _world(self):
        if self.process_group is not None:
            return self.process_group
        if dist.is_available() and dist.is_initialized() and \
                dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

    # -- GradScaler's verbs ------------------------------------------------

    @internals.host_side
    def scale(self, outputs):
        """The loss (or losses) to call ``backward`` on."""
        if not self._enabled:
            return outputs
        if self.hook is not None:
            # GS: the hook attaches to the outputs' graph (with several
            # ranks, each gradient is checked as it lands, before it is
            # averaged).
            self.hook.attach(outputs, hold=True)
            # (the step's process group, read once: its exchange's too)
            self._step_group = (self._world(),)
            self.hook.check_on_landing = self._step_group[0] is not None
            return outputs
        scale = self.policy.loss_scale
        if self.policy.checks:
            self._losses.extend(_tensors(outputs))
        return outputs if scale == 1.0 else _times(outputs, scale)

    @internals.host_side
    def unscale_(self, optimizer):
        """Decides ``optimizer``'s step; its ``.grad`` then hold the true
        gradients (under GS they already did: it only checks)."""
        if not self._enabled:
            return
        if self._half_gradients(optimizer.param_groups):
            raise ValueError('Attempting to unscale FP16 gradients.')
        self._decide(optimizer)

    @internals.host_side
    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step(*args, **kwargs)`` if its gradients are finite;
        returns what it returns, None when skipped. :attr:`step_taken`
        says which. An optimizer that handles the scaling itself
        (``_step_supports_amp_scaling``) gets what GradScaler gives it:
        the scaler (``grad_scaler=``) or ``grad_scale`` and ``found_inf``."""
        if not self._enabled:
            self.step_taken = True
            return optimizer.step(*args, **kwargs)
        if 'closure' in kwargs:
            raise RuntimeError('Closure use is not currently supported if '
                               'GradScaler is enabled.')
        stage = self._core.stage(id(optimizer))
        if stage == 'stepped':
            self._core.stepped(id(optimizer))  # raises
        if getattr(optimizer, '_step_supports_amp_scaling', False):
            return self._step_itself(optimizer, stage, args, kwargs)
        if stage == 'ready':
            self.unscale_(optimizer)
        _, result = self._core.decision(id(optimizer))
        self._core.stepped(id(optimizer))
        self.step_taken = result.finite
        return optimizer.step(*args, **kwargs) if result.finite else None

    def _step_itself(self, optimizer, stage, args, kwargs):
        """GradScaler's contract with an optimizer that unscales and skips
        inside its own step (fused Adam)."""
        if 'grad_scaler' in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                'GradScaler is going to stop passing itself as a keyword '
                'argument to the passed optimizer. In the near future '
                'GradScaler registers `grad_scale: Tensor` and `found_inf: '
                'Tensor` to the passed optimizer and let the optimizer use '
                'them directly.', FutureWarning, stacklevel=3)
            retval = optimizer.step(*args, **dict(kwargs, grad_scaler=self))
            self._core.stepped(id(optimizer))
            return retval
        params = _params(optimizer)
        if stage == 'ready':
            # Decided without unscaling: the optimizer divides by
            # grad_scale itself.
            finite = self._decide(optimizer, unscale=False).finite
            factor = self.policy.loss_scale
        else:
            finite = self._core.decision(id(optimizer))[1].finite
            factor = 1.0
        device = next((p.device for p in params), torch.device('cpu'))
        optimizer.grad_scale = torch.full((), factor, device=device)
        optimizer.found_inf = torch.full(
            (), 0.0 if finite else 1.0, device=device)
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        self._core.stepped(id(optimizer))
        self.step_taken = finite
        return retval

    @internals.host_side
    def update(self, new_scale=None):
        """The mode's transition for the step (grow, back off, commit the
        scales staged); every optimizer is ready again. When every
        optimizer's step was skipped, the modules' buffers are put back.
        ``new_scale`` (``mode='dynamic'``) sets the loss scale instead.

        Raises:
            GradientOverflowError: When overflow persists.

        """
        if not self._enabled:
            return
        if new_scale is not None:
            self._set_scale(new_scale)
            return
        self._core.require_stepped()
        if self._core.all_skipped:
            self._restore_buffers()  # no optimizer stepped: as if unseen
        try:
            self._core.conclude()
        finally:
            self._new_step()

    def _new_step(self):
        self._buffers_captured = False
        self._losses = []
        self._step_group = None  # (the step's process group, as scaled)

    def _capture_buffers(self):
        """Saves every buffer of the model as it is now, before the
        forward pass changes them in place (BatchNorm's ``running_mean``,
        ``running_var`` and ``num_batches_tracked``; PyTorch's own AMP
        leaves them changed when it skips a step, pytorch/pytorch#88474):
        into the same tensors as the last capture when the buffers are
        alike (one fused copy)."""
        buffers = [b for b in (getattr(m, name)
                               for m, name in self._buffer_places)
                   if b is not None]
        saved = self._saved_buffers
        with torch.no_grad():
            if len(saved) == len(buffers) and all(
                    s.shape == b.shape and s.dtype == b.dtype and
                    s.device == b.device for s, b in zip(saved, buffers)):
                if buffers:
                    internals.copy_all(saved, buffers)
            else:
                self._saved_buffers = [b.detach().clone() for b in buffers]
        self._captured_buffers = buffers
        self._buffers_captured = True

    def _restore_buffers(self):
        """Puts every buffer captured this step back, in place: the
        skipped step's batch leaves no trace."""
        if self._buffers_captured and self._saved_buffers:
            with torch.no_grad():
                internals.copy_all(self._captured_buffers,
                                   self._saved_buffers)

    def _set_scale(self, new_scale):
        if not isinstance(self.policy, core.GradScalerDynamic):
            raise ValueError(
                'update(new_scale) sets a single loss scale; mode {!r} has '
                'none ({})'.format(self.recipe.mode,
                                   'every site has its own'
                                   if self.policy.per_step else
                                   'it does not change' if not
                                   self.policy.checks else
                                   "the paper's Dyn-LS moves its own"))
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError('new_scale should be a float or a '
                                 '1-element tensor with requires_grad=False')
            new_scale = float(new_scale.item())
        self.policy.loss_scale = float(new_scale)
        self._core.reset()
        self._new_step()

    def _decide(self, optimizer, unscale=True):
        """``optimizer``'s result, the same on every rank
        (:meth:`~gradient_scaling.core.scaler.Scaler.decide`). A
        loss-scaled mode unscales (unless ``unscale`` is False) and checks
        the optimizer's gradients; gradient scaling's step was checked as
        its gradients landed, once for every optimizer (its parameters
        read only where that step is not finite)."""
        if self.hook is not None:
            return self._core.decide(
                id(optimizer), lambda: self._exchange(
                    self.hook.step_payload()),
                lambda: self._finite(_params(optimizer)))
        return self._core.decide(
            id(optimizer), lambda: self._exchange(
                self._payload(_params(optimizer), unscale)))

    def _payload(self, params, unscale):
        """A loss-scaled mode's payload for one optimizer's ``params``:
        unscaled (unless ``unscale`` is False) and, if the mode checks,
        checked in the same fused read."""
        grads = [(p, p.grad) for p in params if p.grad is not None]
        scale = self.policy.loss_scale if unscale else 1.0
        if not self.policy.checks:
            unscaling.unscale((g, scale) for _, g in grads)
            return core.Payload((core.FINITE,))
        losses = [t.detach() for t in self._losses]
        if unscaling.unscale([(g, scale) for _, g in grads], losses,
                             check=True):
            return core.Payload((core.FINITE,))
        names = {p: self._param_names.get(p, 'param#{}'.format(i))
                 for i, p in enumerate(params)}
        return core.Payload((faults.pass_result(
            losses, grads, names.get),))

    def _finite(self, params):
        """Whether every gradient of ``params`` is finite, on every rank."""
        finite = unscaling.unscale(
            [(p.grad, 1.0) for p in params if p.grad is not None],
            check=True) is not False
        group = self._world()
        if group is not None:
            return agreement.all_true(finite, group)
        return finite

    def _exchange(self, payload):
        """Every rank's payload (rank order), on every rank."""
        known = self._step_group
        group = self._world() if known is None else known[0]
        if group is None or not self.policy.checks:
            return [payload]
        return agreement.exchange(payload, group)

    # -- GradScaler's accessors --------------------------------------------

    def get_scale(self):
        """The factor on the gradients after the backward: the loss scale
        of a loss-scaled mode; 1.0 for gradient scaling, whose gradients
        land unscaled (and when disabled)."""
        if not self._enabled:
            return 1.0
        return float(self.policy.loss_scale)

    def site_scales(self):
        """Gradient scaling: the committed local scale of every site
        (``{'layer1.0.conv1.weight': 256.0, 'cast#0': 2048.0, ...}``);
        empty for a loss-scaled mode."""
        return {} if self.hook is None else dict(self.hook.table.scales)

    def is_enabled(self):
        return self._enabled

    def get_growth_factor(self):
        return self._growth['growth_factor']

    def set_growth_factor(self, new_factor):
        self._retune(growth_factor=float(new_factor))

    def get_backoff_factor(self):
        return self._growth['backoff_factor']

    def set_backoff_factor(self, new_factor):
        self._retune(backoff_factor=float(new_factor))

    def get_growth_interval(self):
        return self._growth['growth_interval']

    def set_growth_interval(self, new_interval):
        self._retune(growth_interval=int(new_interval))

    def _retune(self, **growth):
        self._growth.update(growth)
        if isinstance(self.policy, core.GradScalerDynamic):
            self.recipe = dataclasses.replace(self.recipe, **growth)
            self.policy.retune(self.recipe)

    def _get_growth_tracker(self):
        if isinstance(self.policy, core.GradScalerDynamic):
            return self.policy.clean_steps
        return 0

    # -- telemetry -----------------------------------------------------------

    def report(self):
        """Gradient scaling's telemetry, one record per site as of its
        last refresh (empty for a loss-scaling mode)."""
        return [] if self.hook is None else self.hook.report()

    def to_csv(self, file=None):
        """Writes :meth:`report` as CSV to a path or file; returns the
        text."""
        return telemetry.write_csv(self.report(), file)

    # -- state ---------------------------------------------------------------

    def state_dict(self):
        """GradScaler's entries (``scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``_growth_tracker``;
        ``scale`` is :meth:`get_scale`) and the mode's own state under
        ``gradient_scaling/`` (plain Python values); empty when disabled,
        as GradScaler's."""
        if not self._enabled:
            return {}
        state = {'scale': self.get_scale(),
                 'growth_factor': self._growth['growth_factor'],
                 'backoff_factor': self._growth['backoff_factor'],
                 'growth_interval': self._growth['growth_interval'],
                 '_growth_tracker': self._get_growth_tracker(),
                 PREFIX + 'mode': self.recipe.mode}
        state.update((PREFIX + k, v)
                     for k, v in self._core.state_dict().items())
        return state

    def load_state_dict(self, state_dict):
        """Restores :meth:`state_dict`, or a ``torch.amp.GradScaler``'s
        (into ``mode='dynamic-gradscaler'``: its scale, growth settings and
        tracker).

        Raises:
            ValueError: For another mode's state, or a GradScaler's in a
                mode without a single loss scale.

        """
        if not self._enabled:
            return
        state = state_dict
        if len(state) == 0:
            raise RuntimeError('The source state dict is empty, possibly '
                               'because it was saved from a disabled '
                               'instance of GradScaler.')
        state = _current_form(state)
        mode = state.get(PREFIX + 'mode')
        dynamic = isinstance(self.policy, core.GradScalerDynamic)
        if mode is None and not dynamic:
            raise ValueError(
                "a torch.amp.GradScaler state (one loss scale, {:g}) cannot "
                "resume mode {!r}; load it into GradientScaler(mode="
                "'dynamic-gradscaler')".format(state.get('scale', math.nan),
                                               self.recipe.mode))
        if mode is not None and mode != self.recipe.mode:
            raise ValueError('a state of mode {!r}, this scaler is {!r}'
                             .format(mode, self.recipe.mode))
        growth = {k: state[k] for k, _ in GROWTH[1:] if k in state}
        if growth:
            self._retune(**growth)
        own = {k[len(PREFIX):]: v for k, v in state.items()
               if k.startswith(PREFIX) and k != PREFIX + 'mode'}
        if mode is None:  # GradScaler's
            own = {'loss_scale': float(state['scale']),
                   'clean_steps': int(state.get('_growth_tracker', 0))}
        self._core.load_state_dict(own)

    def __getstate__(self):
        """What pickling keeps: the settings and the state, not the model
        (nor hooks on it); at the beginning of an iteration or after
        :meth:`update`, as GradScaler."""
        if not self._core.idle:
            raise RuntimeError('A GradientScaler may only be pickled at the '
                               'beginning of an iteration, or at the end '
                               'after update().')
        return {'recipe': self.recipe, 'device': self._device,
                'enabled': self._enabled, 'growth': dict(self._growth),
                'settings': dict(self._settings),
                'state': self.state_dict()}

    def __setstate__(self, pickled):
        """An unpickled scaler has no model: it scales the graphs it is
        given and checks the gradients of the optimizers it steps."""
        self._device = pickled['device']
        self._enabled = pickled['enabled']
        self._growth = pickled['growth']
        self._settings = pickled['settings']
        self.recipe = pickled['recipe']
        self.model = None
        self.process_group = None
        self._build()
        if pickled['state']:
            self.load_state_dict(pickled['state'])


def _current_form(state):
    """This project's older ``state_dict`` forms, read as today's: a
    ``{'mode', 'state'}`` pair, and ``mode='dynamic'`` when it meant
    GradScaler's dynamic loss scaling (its ``scale`` entry)."""
    if 'state' in state and 'mode' in state:
        state = dict({PREFIX + 'mode': state['mode']},
                     **{PREFIX + k: v for k, v in state['state'].items()})
    if state.get(PREFIX + 'mode') == 'dynamic' and PREFIX + 'scale' in state:
        state = {(PREFIX + 'loss_scale' if k == PREFIX + 'scale' else k): v
                 for k, v in state.items()}
        state[PREFIX + 'mode'] = _GRADSCALER
    return state


def _tensors(outputs):
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for o in outputs for t in _tensors(o)]


def _times(outputs, scale):
    if isinstance(outputs, torch.Tensor):
        return outputs * scale
    return type(outputs)(_times(o, scale) for o in outputs)


def _capture_weakly(scaler_ref, module, inputs):
    """Before a module with buffers runs: the scaler captures the
    buffers once per step."""
    scaler = scaler_ref()
    if scaler is not None and not scaler._buffers_captured:
        scaler._capture_buffers()


def _buffer_owners(module, places):
    """``module`` and every submodule that holds buffers (where a capture
    before the forward may be triggered)."""
    if not places:
        return []  # (no buffer: nothing to capture, no hook to run)
    owners = list(dict.fromkeys(m for m, _ in places))
    return owners if module in owners else [module] + owners


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group['params']]
