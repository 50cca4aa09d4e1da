"""What each scaling mode does in PyTorch, behind the scaler's verbs.

One class per kind of recipe (:mod:`gradient_scaling.core.recipes`); the
:class:`~gradient_scaling.torch.scaler.GradientScaler` holds one and never
asks which: each says how the loss is scaled, what the scale on a
parameter's ``.grad`` is, what a step contributes to the decision and how
its state moves when the step is decided.

=========================  =====================================================
recipe                     strategy
=========================  =====================================================
none / fp32                :class:`Unscaled`: nothing scaled, never checked
fixed                      :class:`FixedScale`: ``loss * S``, never checked
dynamic, dynamic-          :class:`DynamicScale`: ``torch.amp.GradScaler``'s
gradscaler                 growth and backoff (with a floor and a ceiling
                           unless ``bounded=False``)
gs, amax-*                 :class:`PerTensor`: the gradient-scaling hook
=========================  =====================================================

A loss-scaled mode decides per optimizer, as GradScaler does: its
:meth:`~Unscaled.payload` unscales and checks that optimizer's gradients
(every parameter it steps, in the model or not) in one fused read. Gradient
scaling decides per step: its gradients landed unscaled during the
backward, and its pass result covers every leaf of the graph, so one
decision (and one set of scales, and the buffers put back) serves every
optimizer.
"""

import torch

from gradient_scaling.core import recipes
from gradient_scaling.core import scale_state
from gradient_scaling.core import step as step_module
from gradient_scaling.core.step import PassResult
from gradient_scaling.torch import unscaling
from gradient_scaling.torch.hook import GradientScaling

__all__ = ['Unscaled', 'FixedScale', 'DynamicScale', 'PerTensor', 'make']


class _Payload(object):
    """A loss-scaled step's contribution to the decision."""

    def __init__(self, result):
        self.result = result

    def quiet(self):
        return self.result.finite

    def to_dict(self):
        return {'result': self.result.to_dict()}

    @classmethod
    def from_dict(cls, values):
        return cls(PassResult.from_dict(values['result']))


class Unscaled(object):

    """No scaling and no check (``GradScaler(enabled=False)``)."""

    checks = False
    per_step = False
    loss_scale = 1.0

    def __init__(self, recipe, model):
        self.recipe = recipe
        self.guard = step_module.OverflowGuard(recipe.mode,
                                               getattr(recipe, 'patience',
                                                       10))
        self._losses = []

    def scale(self, outputs, ranked=False):
        self._losses.extend(_tensors(outputs))
        return outputs if self.loss_scale == 1.0 else _times(
            outputs, self.loss_scale)

    def grad_factor(self):
        """The factor on ``.grad`` after the backward (before unscaling)."""
        return self.loss_scale

    def payload(self, named_params, unscale=True):
        """Unscales the gradients of ``named_params`` ((name, parameter)
        pairs: one optimizer's), unchecked (``unscale=False``: leaves
        them as they are, for an optimizer that unscales them itself)."""
        if unscale:
            unscaling.unscale((p.grad, self.loss_scale)
                              for _, p in named_params if p.grad is not None)
        return _Payload(PassResult())

    def transition(self, payloads, result):
        return False

    def after_update(self):
        """The step is over: the losses it scaled are forgotten."""
        self._losses = []

    def scale_text(self):
        return 'loss scale {:g}'.format(self.loss_scale)

    def report(self):
        return []

    def site_scales(self):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class FixedScale(Unscaled):

    """Fixed-LS: ``loss * loss_scale``, never checked (the paper's)."""

    def __init__(self, recipe, model):
        super().__init__(recipe, model)
        self.loss_scale = recipe.loss_scale


class DynamicScale(Unscaled):

    """``torch.amp.GradScaler``'s dynamic loss scaling, checked, with a
    floor and a ceiling (the Chainer adapter's
    :class:`~gradient_scaling.chainer.scalers.GradScalerLossScaling`
    transition table). A data fault (a non-finite loss) skips and changes
    no scale. ``recipe.bounded=False`` is GradScaler exactly: no floor, no
    ceiling, every skip backs off, no error however many."""

    checks = True

    def __init__(self, recipe, model):
        super().__init__(recipe, model)
        self.dynamic = scale_state.DynamicLossScale(recipe)
        if not recipe.bounded:
            self.guard = step_module.OverflowGuard(recipe.mode, None)

    @property
    def loss_scale(self):
        return self.dynamic.loss_scale

    def payload(self, named_params, unscale=True):
        """Unscales (unless ``unscale`` is False) and checks one
        optimizer's gradients in one read."""
        losses = [t.detach() for t in self._losses]
        grads = [(n, p.grad) for n, p in named_params if p.grad is not None]
        scale = self.loss_scale if unscale else 1.0
        if unscaling.unscale([(g, scale) for _, g in grads], losses,
                             check=True):
            return _Payload(PassResult())
        return _Payload(step_module.pass_result(losses, grads))

    def transition(self, payloads, result):
        return self.dynamic.transition(result)

    def retune(self, recipe):
        """New growth settings (``set_growth_factor``...), the state kept."""
        self.recipe = self.dynamic.recipe = recipe

    def state_dict(self):
        return dict({'scale': self.dynamic.loss_scale,
                     'clean_steps': self.dynamic.clean_steps},
                    **{'guard/' + k: v
                       for k, v in self.guard.state_dict().items()})

    def load_state_dict(self, state):
        self.dynamic.load_state_dict({'loss_scale': state['scale'],
                                      'clean_steps': state['clean_steps']})
        guard = {k[len('guard/'):]: v for k, v in state.items()
                 if k.startswith('guard/')}
        if guard:  # (a GradScaler's state has none: the counts start anew)
            self.guard.load_state_dict(guard)


class PerTensor(object):

    """Gradient scaling (and Transformer Engine's amax recipes): the
    :class:`~gradient_scaling.torch.hook.GradientScaling` hook attaches to
    the loss's graph; every gradient tensor has its own scale inside the
    backward, and the gradients land in ``.grad`` unscaled."""

    checks = True
    per_step = True

    def __init__(self, recipe, model):
        self.recipe = recipe
        self.hook = GradientScaling(model, recipe=recipe)
        self.guard = self.hook.guard

    def scale(self, outputs, ranked=False):
        """Attaches the hook to ``outputs``' graph (with several ranks,
        each gradient is checked as it lands, before it is averaged)."""
        self.hook.hold_step()
        self.hook.check_on_landing = ranked
        self.hook.attach(outputs)
        return outputs

    def grad_factor(self):
        return 1.0

    def payload(self, named_params=None, unscale=True):
        """The step's payload (its passes' results, the scales staged):
        one for every optimizer (its gradients landed unscaled)."""
        return self.hook.step_payload()

    def transition(self, payloads, result):
        return self.hook.controller.transition(payloads, result)

    def after_update(self):
        """Nothing: the gradients landed unscaled."""

    def scale_text(self):
        return self.hook.controller.scale_text()

    def report(self):
        return self.hook.report()

    def site_scales(self):
        """The committed local scale of every site."""
        return dict(self.hook.table.scales)

    def state_dict(self):
        return self.hook.state_dict()

    def load_state_dict(self, state):
        self.hook.load_state_dict(state)


_STRATEGIES = {
    recipes.NoScalingRecipe: Unscaled,
    recipes.FixedLossScalingRecipe: FixedScale,
    recipes.GradScalerRecipe: DynamicScale,
    recipes.GradientScalingRecipe: PerTensor,
    recipes.AmaxRecipe: PerTensor,
}


def make(recipe, model):
    """The strategy that applies ``recipe`` to ``model`` (None: the sites
    are named from the graph)."""
    cls = _STRATEGIES.get(type(recipe))
    if cls is None:
        raise ValueError('{} has no PyTorch strategy (Chainer\'s own Dyn-LS '
                         'is Chainer only; use dynamic-gradscaler)'.format(
                             type(recipe).__name__))
    return cls(recipe, model)


def _tensors(outputs):
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for o in outputs for t in _tensors(o)]


def _times(outputs, scale):
    if isinstance(outputs, torch.Tensor):
        return outputs * scale
    return type(outputs)(_times(o, scale) for o in outputs)
