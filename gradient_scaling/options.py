"""The command-line options of the recipes' settings (the examples' ``--scaling``,
``--loss-scale``, ...) and the simulated precisions both frameworks'
examples offer: the command line kept out of the core.

A recipe (:mod:`gradient_scaling.core.recipes`) holds a setting's default
and its check; this module holds only what a command line adds: the flag,
how its text is parsed and its help. :func:`add_arguments` adds
``--scaling`` (the modes of :data:`~gradient_scaling.core.recipes.MODES`)
and the flags of every mode's settings; :func:`from_args` gives the recipe
the parsed options describe, checked by the recipe itself.

.. admonition:: Example

    >>> import argparse
    >>> from gradient_scaling import options
    >>> parser = argparse.ArgumentParser()
    >>> _ = options.add_arguments(parser)
    >>> args = parser.parse_args(['--scaling', 'fixed', '--loss-scale', '64'])
    >>> options.from_args(args)
    FixedLossScalingRecipe(mode='fixed', loss_scale=64.0)

"""

import argparse
import collections
import dataclasses

from gradient_scaling.core import block_formats_recipes
from gradient_scaling.core import formats
from gradient_scaling.core import recipes

__all__ = ['Flag', 'FLAGS', 'SUMMARIES', 'BLOCK_PRECISIONS',
           'SIMULATED_FORMATS', 'add_arguments', 'from_args']

#: The block-scaling recipes as ``--precision`` values (sim-mxfp8-e4m3,
#: ..., sim-nvfp4), the same in both frameworks' examples.
BLOCK_PRECISIONS = {'sim-' + name: name
                    for name in block_formats_recipes.names()}
#: The format each simulated precision stores gradients in (GS's
#: ``--format`` default; for a block recipe the one a per-tensor scaler
#: scales its gradients for).
SIMULATED_FORMATS = {
    'sim-fp16': 'float16', 'sim-bf16': 'bfloat16',
    'sim-fp8-e5m2': 'float8_e5m2', 'sim-fp8-e4m3': 'float8_e4m3'}
SIMULATED_FORMATS.update(
    (precision, block_formats_recipes.get(name).scaler_format)
    for precision, name in BLOCK_PRECISIONS.items())

#: A setting's command-line flag: its text parsed by ``parse``, the help
#: (``%(default)s``: the recipe's default), the choices if any.
Flag = collections.namedtuple('Flag', 'flag parse help choices')

#: Recipe field -> its flag, in the order of the help text.
FLAGS = collections.OrderedDict([
    ('loss_scale', Flag('--loss-scale', float,
                        'Fixed-LS scale (default: %(default)s)', None)),
    ('dynamic_interval', Flag('--dynamic-interval', int,
                              'Dyn-LS growth interval (default: '
                              '%(default)s)', None)),
    ('update_interval', Flag(
        '--update-interval', int, 'GS statistics refresh interval, in '
        'iterations (default: %(default)s, as in the paper)', None)),
    ('fmt', Flag('--format', str, 'format GS scales gradients for '
                 '(default: the format of --precision, float16 for '
                 'mixed16)', formats.names())),
    ('underflow_rate', Flag('--underflow-rate', float,
                            'GS target underflow rate (default: '
                            '%(default)s)', None)),
    ('estimator', Flag(
        '--gs-estimator', str, "how GS picks each scale: model (the "
        "paper's Theorems 1-2), measured (the exact underflow of every "
        'power of two, from an exponent histogram at each refresh), hybrid '
        '(the larger of the two) (default: %(default)s)',
        recipes.ESTIMATORS)),
    ('amax_history', Flag('--amax-history', int,
                          'amax-delayed: steps of amax remembered (default: '
                          '%(default)s, as Transformer Engine)', None)),
    ('amax_margin', Flag('--amax-margin', int,
                         "amax-*: powers of two left free below the "
                         "format's maximum (default: %(default)s)", None)),
])

#: Recipe class -> one line for ``--scaling``'s help.
SUMMARIES = collections.OrderedDict([
    (recipes.NoScalingRecipe,
     'fp32: FP32 training; none: low precision without scaling'),
    (recipes.FixedLossScalingRecipe, 'fixed: Fixed-LS (--loss-scale)'),
    (recipes.DynamicLossScalingRecipe,
     "dynamic: the paper's Dyn-LS, as Chainer runs it (--dynamic-interval)"),
    (recipes.GradScalerRecipe,
     'dynamic-gradscaler: GradScaler-style dynamic scaling'),
    (recipes.GradientScalingRecipe, 'gs: gradient scaling'),
    (recipes.AmaxRecipe, "amax-delayed, amax-current: Transformer Engine's "
     'per-tensor FP8 amax recipes'),
])


def _flagged_fields(modes):
    """(flag, field) of every recipe field with a flag, each flag once,
    in the order of :data:`FLAGS`."""
    names = {f.name: f for cls in dict.fromkeys(modes.values())
             for f in dataclasses.fields(cls)}
    return [(FLAGS[name], names[name]) for name in FLAGS if name in names]


def _argument_type(flag, f):
    """An argparse type for field ``f``: the text parsed, then checked by
    the recipe's check; text that does not parse gets the check's own
    message (the valid values)."""
    parse, check = flag.parse, f.metadata['check']

    def convert(text):
        try:
            try:
                value = parse(text)
            except ValueError:
                check(text, f.name)  # raises, naming what is valid
                raise ValueError('{} must be a {}, got {!r}'.format(
                    f.name, parse.__name__, text)) from None
            return check(value, f.name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = f.name
    return convert


def add_arguments(parser, default_mode='gs', modes=None):
    """Adds ``--scaling`` and every recipe's flagged settings to ``parser``.

    Every flag's default is None (the recipe's own default applies), so
    :func:`from_args` can tell a given option from an absent one.
    """
    modes = recipes.MODES if modes is None else modes
    group = parser.add_argument_group('gradient scaling')
    summaries = dict.fromkeys(SUMMARIES[cls] for cls in modes.values())
    group.add_argument('--scaling', choices=list(modes), default=default_mode,
                       help='; '.join(summaries) +
                       ' (default: %(default)s)')
    for flag, f in _flagged_fields(modes):
        help_text = flag.help.replace('%(default)s', str(f.default))
        if flag.choices:
            group.add_argument(flag.flag, choices=flag.choices,
                               default=None, help=help_text)
        else:
            group.add_argument(flag.flag, type=_argument_type(flag, f),
                               default=None, metavar=f.name.upper(),
                               help=help_text)
    return group


def from_args(args, modes=None, **defaults):
    """The recipe ``args`` (parsed by :func:`add_arguments`) describe.

    Options not given take ``defaults`` (e.g. ``fmt`` from the precision)
    and then the recipe's own defaults; options of other modes are ignored.
    """
    modes = recipes.MODES if modes is None else modes
    cls = modes[args.scaling]
    settings = {}
    for f in dataclasses.fields(cls):
        value = None
        if f.name in FLAGS:
            value = getattr(args, FLAGS[f.name].flag[2:].replace('-', '_'),
                            None)
        if value is None:
            value = defaults.get(f.name)
        if value is not None:
            settings[f.name] = value
    return cls(mode=args.scaling, **settings)
