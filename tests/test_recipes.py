"""Recipes: every setting defined, checked and turned into an option once."""

import argparse
import dataclasses
import re

import numpy as np
import pytest

from gradient_scaling import options
from gradient_scaling.core import recipes


def parse(argv, default_mode='gs'):
    parser = argparse.ArgumentParser()
    options.add_arguments(parser, default_mode=default_mode)
    return parser.parse_args(argv)


def test_every_mode_has_its_recipe_with_the_papers_defaults():
    assert list(recipes.MODES) == [
        'fp32', 'none', 'fixed', 'dynamic', 'dynamic-gradscaler', 'gs',
        'amax-delayed', 'amax-current']
    gs = recipes.for_mode('gs')
    assert (gs.underflow_rate, gs.update_interval, gs.fmt, gs.estimator) \
        == (1e-3, 100, 'float16', 'model')
    assert recipes.for_mode('fixed').loss_scale == 128.0
    assert recipes.for_mode('dynamic').dynamic_interval == 1000
    scaler = recipes.for_mode('dynamic-gradscaler')
    assert (scaler.init_scale, scaler.growth_interval, scaler.min_scale) == (
        2.0 ** 16, 2000, 2.0 ** -24)
    amax = recipes.for_mode('amax-delayed')
    assert (amax.delayed, amax.amax_history, amax.amax_margin) == (
        True, 1024, 0)
    assert not recipes.for_mode('amax-current').delayed
    checks = {m: recipes.for_mode(m).checks_steps for m in recipes.MODES}
    assert checks == {'fp32': False, 'none': False, 'fixed': False,
                      'dynamic': True, 'dynamic-gradscaler': True,
                      'gs': True, 'amax-delayed': True, 'amax-current': True}


@pytest.mark.parametrize('mode, settings, message', [
    ('gs', {'underflow_rate': 1.5}, r'underflow_rate must be a number in'),
    ('gs', {'update_interval': True}, 'update_interval must be an integer'),
    ('gs', {'estimator': 'oracle'}, "estimator must be one of 'model'"),
    ('gs', {'fmt': 'float12'}, 'unknown format'),
    ('gs', {'cast_rule': 'some'}, "cast_rule must be one of 'softmax'"),
    ('gs', {'scale_range': (0.5, 3.0)}, 'two powers of two around 1'),
    ('gs', {'weight_headroom': 0.5}, 'weight_headroom >= 1'),
    ('gs', {'apply_scales': 1}, 'apply_scales must be True or False'),
    ('fixed', {'loss_scale': -1}, 'loss_scale must be a finite number > 0'),
    ('dynamic', {'dynamic_interval': 0}, 'dynamic_interval must be an'),
    ('dynamic-gradscaler', {'init_scale': 2.0 ** 30},
     'min_scale <= init_scale <= max_scale'),
    ('amax-current', {'amax_margin': -1}, 'amax_margin must be an integer'),
    ('gs', {'loss_scale': 8}, '--scaling gs has no setting loss_scale'),
    ('magic', {}, "unknown scaling 'magic'"),
])
def test_each_check_names_the_setting_and_the_valid_values(mode, settings,
                                                           message):
    with pytest.raises(ValueError, match=message):
        recipes.for_mode(mode, **settings)


def test_numpy_scalars_become_python_numbers():
    gs = recipes.for_mode('gs', underflow_rate=np.float32(1e-3),
                          update_interval=np.int64(5))
    assert type(gs.underflow_rate) is float and type(gs.update_interval) \
        is int
    assert gs.update_interval == 5


def test_recipes_are_frozen_and_replace_checks_again():
    gs = recipes.for_mode('gs')
    with pytest.raises(dataclasses.FrozenInstanceError):
        gs.update_interval = 3
    assert dataclasses.replace(gs, update_interval=3).update_interval == 3
    with pytest.raises(ValueError, match='update_interval'):
        dataclasses.replace(gs, update_interval=0)


def test_own_settings_drops_other_modes_and_refuses_unknown_names():
    settings = {'update_interval': 3, 'loss_scale': 8.0}
    assert recipes.own_settings('gs', settings) == {'update_interval': 3}
    assert recipes.own_settings('fixed', settings) == {'loss_scale': 8.0}
    with pytest.raises(ValueError, match='no scaling mode has a setting '
                       'updat_interval'):
        recipes.own_settings('gs', {'updat_interval': 3})


def test_hook_recipe_from_the_hooks_keyword_arguments():
    assert recipes.hook_recipe(update_interval=3) == recipes.for_mode(
        'gs', update_interval=3)
    amax = recipes.hook_recipe(estimator='amax-delayed', amax_history=5)
    assert isinstance(amax, recipes.AmaxRecipe) and amax.amax_history == 5
    with pytest.raises(ValueError, match='estimator must be one of'):
        recipes.hook_recipe(estimator='oracle')


def test_options_are_generated_from_the_fields_once():
    """The flags are the command line's (gradient_scaling.options); the
    defaults and checks the recipes' own: the core knows no argparse."""
    import gradient_scaling.core.recipes as core_recipes
    assert 'argparse' not in vars(core_recipes)
    assert all(set(f.metadata) <= {'check'}
               for cls in set(recipes.MODES.values())
               for f in dataclasses.fields(cls))
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    text = parser.format_help()
    group = text[text.index('gradient scaling:'):]
    flags = re.findall(r'^  (--[a-z-]+)', group, flags=re.M)
    assert flags == ['--scaling', '--loss-scale', '--dynamic-interval',
                     '--update-interval', '--format', '--underflow-rate',
                     '--gs-estimator', '--amax-history', '--amax-margin']
    assert 'Fixed-LS scale (default: 128.0)' in text
    assert 'as in the paper' in text and 'default: 100' in text


def test_from_args_takes_given_options_then_defaults():
    args = parse(['--update-interval', '7', '--loss-scale', '64'])
    assert options.from_args(args) == recipes.for_mode('gs',
                                                       update_interval=7)
    args = parse(['--scaling', 'fixed', '--loss-scale', '64'])
    assert options.from_args(args) == recipes.for_mode('fixed',
                                                       loss_scale=64.0)
    # a default from elsewhere (the precision's format), unless given
    args = parse(['--scaling', 'amax-current'])
    assert options.from_args(args, fmt='float8_e5m2').fmt == 'float8_e5m2'
    args = parse(['--format', 'bfloat16'])
    assert options.from_args(args, fmt='float8_e5m2').fmt == 'bfloat16'


@pytest.mark.parametrize('argv, message', [
    (['--update-interval', 'x'], 'update_interval must be an integer >= 1'),
    (['--update-interval', '0'], 'update_interval must be an integer >= 1'),
    (['--underflow-rate', 'high'], r'underflow_rate must be a number in'),
    (['--loss-scale', 'inf'], 'loss_scale must be a finite number > 0'),
    (['--amax-margin', '-2'], 'amax_margin must be an integer >= 0'),
    (['--gs-estimator', 'oracle'], 'invalid choice'),
])
def test_option_errors_are_the_recipes_own(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert re.search(message, capsys.readouterr().err)
