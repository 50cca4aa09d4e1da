"""One recipe per scaling mode: every setting defined, checked and documented once.

As Transformer Engine's ``DelayedScaling`` / ``Float8CurrentScaling``
dataclasses do, a recipe holds every setting of one way of scaling
gradients, validated once (in ``__post_init__``), and is handed whole to
the code that applies it: an adapter's scaler or hook reads its fields and
never re-checks them, and the training loop never asks which recipe it
holds. :data:`MODES` is the one table of mode names, for both adapters.
The command line is not the core's business: the examples' options are
:mod:`gradient_scaling.options`.

========================  =====================================================
mode                      recipe
========================  =====================================================
``fp32``, ``none``        :class:`NoScalingRecipe`: nothing scaled, never checked
``fixed``                 :class:`FixedLossScalingRecipe` (the paper's Fixed-LS)
``dynamic``               :class:`DynamicLossScalingRecipe` (Chainer's Dyn-LS)
``dynamic-gradscaler``    :class:`GradScalerRecipe` (``torch.amp.GradScaler``'s)
``gs``                    :class:`GradientScalingRecipe` (the paper's method)
``amax-delayed``,         :class:`AmaxRecipe` (Transformer Engine's FP8
``amax-current``          per-tensor recipes)
========================  =====================================================

.. admonition:: Example

    >>> from gradient_scaling.core import recipes
    >>> recipe = recipes.for_mode('gs', update_interval=10)
    >>> recipe.underflow_rate, recipe.update_interval, recipe.checks_steps
    (0.001, 10, True)
    >>> recipes.for_mode('fixed', loss_scale=-1)
    Traceback (most recent call last):
    ...
    ValueError: loss_scale must be a finite number > 0, got -1

"""

import dataclasses
import typing

from gradient_scaling.core import _validate
from gradient_scaling.core import formats
from gradient_scaling.core import rules

__all__ = ['Recipe', 'NoScalingRecipe', 'FixedLossScalingRecipe',
           'DynamicLossScalingRecipe', 'GradScalerRecipe',
           'GradientScalingRecipe', 'AmaxRecipe', 'MODES', 'ESTIMATORS',
           'CAST_RULES', 'for_mode', 'own_settings', 'hook_recipe']

#: How GS chooses a site's scale (:mod:`gradient_scaling.core.estimators`).
ESTIMATORS = ('model', 'measured', 'hybrid')
#: Which up-casts are cast sites.
CAST_RULES = ('softmax', 'all', 'none')


def setting(default, check=None):
    """A recipe field: its default and its check (``check(value, name)``
    returns the value, normalised, or raises ValueError)."""
    return dataclasses.field(default=default, metadata={'check': check})


def _choice(choices):
    return lambda value, name: _validate.choice(value, name, choices)


def _boolean(value, name):
    if not isinstance(value, bool):
        raise ValueError('{} must be True or False, got {!r}'.format(
            name, value))
    return value


def _non_negative_count(value, name):
    return _validate.count(value, name, minimum=0)


def _scale_range(value, name):
    low, high = (_validate.positive(s, name) for s in value)
    if not (low <= 1 <= high and rules.pow2_floor(low) == low
            and rules.pow2_floor(high) == high):
        raise ValueError('{} must be two powers of two around 1, got '
                         '{!r}'.format(name, value))
    return (low, high)


def _format_name(value, name):
    return formats.get(value).name


@dataclasses.dataclass(frozen=True)
class Recipe(object):

    """Base of the recipes: ``mode`` names it, ``__post_init__`` checks it.

    Attributes:
        mode (str): The mode's name (``--scaling``), one of the class's
            :attr:`modes`.

    """

    #: Mode names this recipe serves.
    modes: typing.ClassVar[tuple] = ()
    #: Whether its steps are checked (and skipped when not finite).
    checks_steps: typing.ClassVar[bool] = False
    #: Under a simulation, the lost gradient values are counted for it
    #: (the hook recipes report them; others with ``--count-underflow``).
    reports_underflow: typing.ClassVar[bool] = False
    #: Like Transformer Engine, only a GEMM's inputs are stored in the low
    #: format (its outputs stay FP32), and casts to it saturate.
    keeps_gemm_outputs_fp32: typing.ClassVar[bool] = False
    #: Every gradient tensor has its own scale (the hook's recipes).
    per_tensor: typing.ClassVar[bool] = False

    mode: str = ''

    def __post_init__(self):
        mode = self.mode or self.modes[0]
        object.__setattr__(self, 'mode', _validate.choice(
            mode, 'mode', self.modes))
        for f in dataclasses.fields(self):
            check = f.metadata.get('check')
            if check is not None:
                object.__setattr__(self, f.name,
                                   check(getattr(self, f.name), f.name))


@dataclasses.dataclass(frozen=True)
class NoScalingRecipe(Recipe):

    """No scaling and no check: ``fp32`` training, or ``none`` in low
    precision (the paper's baselines; Chainer's semantics)."""

    modes = ('none', 'fp32')


@dataclasses.dataclass(frozen=True)
class FixedLossScalingRecipe(Recipe):

    """Fixed-LS: one static loss scale, never checked (Chainer's)."""

    modes = ('fixed',)

    loss_scale: float = setting(128.0, _validate.positive)


@dataclasses.dataclass(frozen=True)
class DynamicLossScalingRecipe(Recipe):

    """Dyn-LS as Chainer runs it: from 1, doubling every step until the
    first overflow, then growing by ``2 ** (1 / dynamic_interval)`` per
    step,
    halving on overflow, within ``[1, 65504]``."""

    modes = ('dynamic',)
    checks_steps = True

    dynamic_interval: int = setting(1000, _validate.count)
    patience: int = setting(10, _validate.count)


@dataclasses.dataclass(frozen=True)
class GradScalerRecipe(Recipe):

    """Dynamic loss scaling with ``torch.amp.GradScaler``'s semantics, with a
    floor and a ceiling (see the scalers' transition tables).

    ``bounded=False`` is GradScaler exactly: no floor and no ceiling (the
    scale may reach 0 or overflow float32), every skipped step backs off
    (GradScaler cannot tell a data fault), and no number of skips raises.
    The default keeps ``min_scale`` <= scale <= ``max_scale``, leaves the
    scale alone on a data fault, and raises
    :class:`~gradient_scaling.core.scaler.GradientOverflowError` after
    ``patience`` skips in a row with nothing left to lower.
    """

    modes = ('dynamic-gradscaler',)
    checks_steps = True

    init_scale: float = setting(2.0 ** 16, _validate.positive)
    growth_factor: float = setting(2.0, _validate.greater_than_one)
    backoff_factor: float = setting(0.5, _validate.rate)
    growth_interval: int = setting(2000, _validate.count)
    min_scale: float = setting(2.0 ** -24, _validate.positive)
    max_scale: float = setting(2.0 ** 24, _validate.positive)
    patience: int = setting(10, _validate.count)
    bounded: bool = setting(True, _boolean)

    def __post_init__(self):
        super().__post_init__()
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError('need min_scale <= init_scale <= max_scale, got '
                             '{!r}, {!r}, {!r}'.format(
                                 self.min_scale, self.init_scale,
                                 self.max_scale))


@dataclasses.dataclass(frozen=True)
class _HookRecipe(Recipe):

    """What every recipe applied by the gradient-scaling hook has: where it
    scales, in which format, and how a step's faults are handled.

    Attributes:
        update_interval (int): Steps between statistics refreshes (the
            paper: 100); a refresh also measures backed-off weight paths.
        fmt (str): Format the gradients are stored in (``--format``):
            ``'float16'``, ``'bfloat16'``, ``'float8_e5m2'`` or
            ``'float8_e4m3'``.
        cast_rule (str): ``'softmax'`` scales up-casts that feed a softmax
            (the paper), ``'all'`` every up-cast, ``'none'`` none.
        apply_scales (bool): If False the hook only observes: it computes
            and reports what it would do, with every scale kept at 1.
        measure_underflow (bool): Measure the actual underflow rate at each
            site on refresh passes (one more pass over the gradient).
        patience (int): Skipped steps in a row, with nothing left to
            back off, before ``GradientOverflowError``.
        weight_backoff (float): Factor by which a parameter's
            weight-gradient path is scaled down when it overflows (an
            extension of the paper, which scales only the data path).
        weight_backoff_floor (float): Smallest weight-path scale.
        weight_headroom (float): At a refresh, a backed-off weight path is
            regrown to keep its largest value this many times below the
            format's maximum.
        scale_range (tuple of float): Floor and ceiling of every
            accumulated scale (powers of two around 1).

    """

    update_interval: int = setting(100, _validate.count)
    fmt: str = setting('float16', _format_name)
    cast_rule: str = setting('softmax', _choice(CAST_RULES))
    apply_scales: bool = setting(True, _boolean)
    measure_underflow: bool = setting(True, _boolean)
    patience: int = setting(10, _validate.count)
    weight_backoff: float = setting(256.0, _validate.greater_than_one)
    weight_backoff_floor: float = setting(2.0 ** -24, _validate.positive)
    weight_headroom: float = setting(4.0, _validate.positive)
    scale_range: tuple = setting((2.0 ** -64, 2.0 ** 64), _scale_range)
    checks_steps = True
    reports_underflow = True
    per_tensor = True

    def __post_init__(self):
        super().__post_init__()
        if self.weight_headroom < 1 or self.weight_backoff_floor > 1:
            raise ValueError('need weight_headroom >= 1 and '
                             'weight_backoff_floor <= 1, got {!r} and {!r}'
                             .format(self.weight_headroom,
                                     self.weight_backoff_floor))

    @property
    def estimator_name(self):
        raise NotImplementedError

    #: Every site's scale is computed at every pass (no cache).
    every_pass = False
    #: The data and weight GEMMs share one scaled incoming gradient (the
    #: tensor Transformer Engine quantizes) instead of the weight path
    #: keeping the incoming scale (the paper).
    weight_path_shares_data_scale = False


@dataclasses.dataclass(frozen=True)
class GradientScalingRecipe(_HookRecipe):

    """GS, the paper's method (Zhao et al., IJCAI 2020, Algorithm 1).

    Attributes:
        underflow_rate (float): Target underflow rate ``gamma'`` in (0, 1).
        estimator (str): How a site's scale is chosen: ``'model'`` (the
            paper's Theorems 1-2), ``'measured'`` (the exact underflow of
            every power of two, from an exponent histogram at each refresh)
            or ``'hybrid'`` (the larger of the two).

    """

    modes = ('gs',)

    underflow_rate: float = setting(1e-3, _validate.rate)
    estimator: str = setting('model', _choice(ESTIMATORS))

    @property
    def estimator_name(self):
        return self.estimator


@dataclasses.dataclass(frozen=True)
class AmaxRecipe(_HookRecipe):

    """Transformer Engine's per-tensor FP8 recipes, the baseline FP8 users
    know: every GEMM's incoming gradient is scaled to
    ``lambda_max / (amax * 2**margin)``, ``amax`` its own (``amax-current``)
    or the largest of the last ``amax_history`` steps' (``amax-delayed``),
    computed every pass; data and weight GEMMs share it.

    Attributes:
        amax_history (int): Steps the delayed recipe remembers (TE: 1024).
        amax_margin (int): Powers of two left free below ``lambda_max``.

    """

    modes = ('amax-delayed', 'amax-current')

    amax_history: int = setting(1024, _validate.count)
    amax_margin: int = setting(0, _non_negative_count)
    every_pass = True
    weight_path_shares_data_scale = True
    keeps_gemm_outputs_fp32 = True

    @property
    def delayed(self):
        return self.mode == 'amax-delayed'

    @property
    def estimator_name(self):
        return self.mode


_RECIPES = (NoScalingRecipe, FixedLossScalingRecipe,
            DynamicLossScalingRecipe, GradScalerRecipe,
            GradientScalingRecipe, AmaxRecipe)
#: Mode name -> recipe class, in ``--scaling``'s order.
MODES = {'fp32': NoScalingRecipe, 'none': NoScalingRecipe}
MODES.update((mode, cls) for cls in _RECIPES for mode in cls.modes)


def for_mode(mode, **settings):
    """The recipe of ``mode`` with ``settings`` (its fields) set.

    Raises:
        ValueError: For an unknown mode, a setting the mode does not have,
            or a value its check refuses.

    """
    cls = MODES.get(mode)
    if cls is None:
        raise ValueError('unknown scaling {!r}; valid: {}'.format(
            mode, ', '.join(MODES)))
    names = {f.name for f in dataclasses.fields(cls)} - {'mode'}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise ValueError('--scaling {} has no setting {} (it has: {})'.format(
            mode, ', '.join(unknown), ', '.join(sorted(names)) or 'none'))
    return cls(mode=mode, **settings)


def own_settings(mode, settings):
    """The part of ``settings`` that belongs to ``mode``'s recipe.

    Settings of other modes are left out (as the command line ignores the
    options of modes it does not run); a name no recipe has is an error.
    """
    every = {f.name for cls in _RECIPES for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - every)
    if unknown:
        raise ValueError('no scaling mode has a setting {}; valid: {}'.format(
            ', '.join(unknown), ', '.join(sorted(every - {'mode'}))))
    names = {f.name for f in dataclasses.fields(MODES[mode])}
    return {k: v for k, v in settings.items() if k in names}


def hook_recipe(estimator='model', amax_history=None, amax_margin=None,
                **settings):
    """The recipe a gradient-scaling hook's keyword arguments describe.

    ``estimator`` 'model', 'measured' or 'hybrid' gives a
    :class:`GradientScalingRecipe`; Transformer Engine's 'amax-current' or
    'amax-delayed' an :class:`AmaxRecipe` (with ``amax_history`` and
    ``amax_margin``). The other settings are the recipe's fields.
    """
    amax = {'amax_history': amax_history, 'amax_margin': amax_margin}
    amax = {k: v for k, v in amax.items() if v is not None}
    if estimator in AmaxRecipe.modes:
        # GS's target means nothing to the amax recipes; accepted unused,
        # as the hook always did.
        settings.pop('underflow_rate', None)
        return for_mode(estimator, **dict(settings, **amax))
    if estimator not in ESTIMATORS:
        raise ValueError('estimator must be one of {}, got {!r}'.format(
            ', '.join(repr(e) for e in ESTIMATORS + AmaxRecipe.modes),
            estimator))
    # amax settings mean nothing to GS's own estimators; accepted unused,
    # as the hook always did.
    return for_mode('gs', estimator=estimator, **settings)
