"""Every touch of a Chainer private lives in gradient_scaling/_chainer_internals.

A private attribute (``x._name``) that the project's own code never defines
belongs to someone else (Chainer, ChainerCV, NumPy...). Only
``_chainer_internals`` (and ``compat``, which restores what NumPy and
setuptools removed) may use such names; everything else goes through it.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = os.path.join(ROOT, 'gradient_scaling')
ALLOWED_MODULES = {'_chainer_internals.py', 'compat.py'}


def _modules():
    return sorted(f for f in os.listdir(LIBRARY) if f.endswith('.py'))


def _tree(name):
    with open(os.path.join(LIBRARY, name)) as f:
        return ast.parse(f.read(), name)


def _private(name):
    return name.startswith('_') and not (name.startswith('__')
                                         and name.endswith('__'))


def own_private_names():
    """Private names the library defines (outside the allowed modules,
    whose assignments to Chainer objects do not make a name ours)."""
    names = set()
    for module in _modules():
        if module in ALLOWED_MODULES:
            continue
        for node in ast.walk(_tree(module)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(
                    node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx,
                                                          ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split('.')[0])
    return {n for n in names if _private(n)}


def foreign_private_uses(module, own):
    uses = []
    for node in ast.walk(_tree(module)):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and node.attr not in own):
            uses.append('{}:{}: .{}'.format(module, node.lineno, node.attr))
    return uses


def test_only_chainer_internals_touches_foreign_privates():
    own = own_private_names()
    uses = [u for m in _modules() if m not in ALLOWED_MODULES
            for u in foreign_private_uses(m, own)]
    assert uses == []


def test_the_check_would_catch_a_touch(tmp_path):
    # The scanner itself: a module reading Chainer's _loss_scale is caught.
    tree = ast.parse('def f(p):\n    return p._loss_scale\n')
    found = [n.attr for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and _private(n.attr)
             and n.attr not in own_private_names()]
    assert found == ['_loss_scale']
    # and _chainer_internals really does touch them
    assert foreign_private_uses('_chainer_internals.py', own_private_names())


@pytest.mark.parametrize('module', ['hook.py', 'training.py', 'scalers.py',
                                    'simulation.py', 'update.py', 'step.py'])
def test_core_modules_exist(module):
    assert module in _modules()
