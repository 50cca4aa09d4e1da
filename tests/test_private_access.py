"""Every touch of a foreign private name lives in one module per framework.

A private attribute (``x._name``) that the project's own code never defines
belongs to someone else (Chainer, ChainerCV, PyTorch, NumPy...). Only the
adapters' internals modules (``gradient_scaling/chainer/_internals.py``,
``gradient_scaling/torch/_internals.py``) and ``gradient_scaling/compat.py``
(which restores what NumPy and setuptools removed) may use such names;
everything else -- the library, the examples, the scripts and these tests
-- goes through them.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The project's own Python code, scanned recursively.
SCANNED = ('gradient_scaling', 'example_common', 'example_data',
           'chainer_links', 'examples', 'scripts', 'tests', 'tools')
ALLOWED = {os.path.join('gradient_scaling', 'chainer', '_internals.py'),
           os.path.join('gradient_scaling', 'torch', '_internals.py'),
           os.path.join('gradient_scaling', 'compat.py'),
           # ChainerCV's own module, rebuilt by tools/build_frozen_wheels.py
           os.path.join('tools', 'chainercv_patch', '_nms_gpu_post.py')}


def _modules():
    found = []
    for top in SCANNED:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            found.extend(os.path.relpath(os.path.join(folder, f), ROOT)
                         for f in files if f.endswith('.py'))
    return sorted(found)


def _tree(path):
    with open(os.path.join(ROOT, path)) as f:
        return ast.parse(f.read(), path)


def _private(name):
    return name.startswith('_') and not (name.startswith('__')
                                         and name.endswith('__'))


#: Underscore names that are documented public API (namedtuple's).
DOCUMENTED = {'_replace', '_asdict', '_fields', '_make'}


def own_private_names(modules):
    """Private names the project defines. In the allowed modules only their
    own functions, classes and module-level names count: their assignments
    to foreign objects do not make a name ours."""
    names = set(DOCUMENTED)
    for module in modules:
        tree = _tree(module)
        if module in ALLOWED:
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets
                                 if isinstance(t, ast.Name))
            continue
        for node in ast.walk(tree):
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
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
    return {n for n in names if _private(n)}


def foreign_private_uses(tree, own, label='<string>'):
    return ['{}:{}: .{}'.format(label, node.lineno, node.attr)
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _private(node.attr)
            and node.attr not in own]


def test_only_the_internals_modules_touch_foreign_privates():
    modules = _modules()
    own = own_private_names(modules)
    uses = [u for m in modules if m not in ALLOWED
            for u in foreign_private_uses(_tree(m), own, m)]
    assert uses == []


def test_the_scan_covers_every_part_of_the_project():
    modules = _modules()
    for top in SCANNED:
        assert any(m.startswith(top + os.sep) for m in modules), top
    assert os.path.join('tests', 'test_private_access.py') in modules
    assert os.path.join('examples', 'segnet', 'train.py') in modules


def test_the_check_would_catch_a_touch():
    # A module reading Chainer's _loss_scale is caught...
    own = own_private_names(_modules())
    tree = ast.parse('def f(p):\n    return p._loss_scale\n')
    assert foreign_private_uses(tree, own) == ['<string>:2: ._loss_scale']
    # ...and the internals module really does touch such names.
    internals = os.path.join('gradient_scaling', 'chainer', '_internals.py')
    assert foreign_private_uses(_tree(internals), own)


@pytest.mark.parametrize('module', ['hook.py', 'training.py', 'scalers.py',
                                    'simulation.py', 'update.py'])
def test_adapter_modules_exist(module):
    assert os.path.isfile(os.path.join(ROOT, 'gradient_scaling', 'chainer',
                                       module))
