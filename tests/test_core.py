"""The core is framework-free: it imports and runs with Chainer, CuPy and
PyTorch blocked, and no core module imports them."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, 'gradient_scaling', 'core')
FRAMEWORKS = ('chainer', 'chainercv', 'cupy', 'torch')


def core_modules():
    return sorted(f[:-3] for f in os.listdir(CORE) if f.endswith('.py'))


@pytest.mark.parametrize('module', core_modules())
def test_no_core_module_imports_a_framework(module):
    with open(os.path.join(CORE, module + '.py')) as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split('.')[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split('.')[0])
            if node.module.startswith('gradient_scaling.'):
                assert node.module.startswith('gradient_scaling.core'), \
                    node.module
    assert not imported & set(FRAMEWORKS), imported & set(FRAMEWORKS)


BLOCKED_RUN = r'''
import importlib, json, sys
for name in %(frameworks)r:
    sys.modules[name] = None  # "import chainer" now raises ImportError
import numpy as np
import gradient_scaling
from gradient_scaling.core import recipes
from gradient_scaling.core.controller import ScaleController
from gradient_scaling.core.scaler import PassResult
for module in %(modules)r:
    importlib.import_module('gradient_scaling.core.' + module)

controller = ScaleController(recipes.GradientScalingRecipe(update_interval=2))
rng = np.random.default_rng(0)
grad = rng.normal(0, 1e-7, (32, 10)).astype(np.float32)
weight = rng.normal(0, 0.05, (10, 64)).astype(np.float32)
for step in range(3):
    scales = controller.begin_pass()
    cast = scales.cast(scales.cast_key(), grad, 1.0)
    beta, finite = scales.gemm('fc', grad * cast, weight, 10, cast,
                                       lambda: (grad * cast) @ weight)
    common = scales.branch([cast, cast * beta], [grad, grad * beta])
    assert controller.end_pass(PassResult())
    controller.conclude([controller.payload()])
state = json.loads(json.dumps(controller.state_dict()))
restored = ScaleController(recipes.GradientScalingRecipe(update_interval=2))
restored.load_state_dict(state)
assert restored.table.scales == controller.table.scales
# Telemetry is not state: the records stay with the controller that made
# them, and a restored one reports nothing until its next refresh.
assert not any(k.startswith('records') for k in state), sorted(state)
assert len(controller.records) == 3 and len(restored.records) == 0
try:
    gradient_scaling.GradientScaling
except ImportError as e:
    hook_error = str(e)
else:
    hook_error = None
print(json.dumps({
    'loaded': sorted(m for m in %(frameworks)r
                     if sys.modules.get(m) is not None),
    'scales': sorted(controller.table.scales.items()),
    'age': controller.age, 'hook_error': hook_error}))
'''


def test_the_core_runs_with_every_framework_blocked():
    code = BLOCKED_RUN % {'frameworks': FRAMEWORKS,
                          'modules': core_modules()}
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report['loaded'] == []
    # cast, GEMM and branch sites, all powers of two > 1 here
    keys = [k for k, _ in report['scales']]
    assert keys == ['branch#0', 'cast#0', 'fc'], keys
    assert all(v > 1 for _, v in report['scales'])
    assert report['age'] == 1  # refreshed at step 3 (interval 2)
    # The Chainer names say what is missing.
    assert 'chainer' in report['hook_error']


TORCH_WITHOUT_CHAINER = r'''
import json, sys
for name in ('chainer', 'chainercv', 'cupy'):
    sys.modules[name] = None
import torch
from gradient_scaling.torch import GradientScaler
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                            torch.nn.Linear(8, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = GradientScaler(model, update_interval=1)
loss = torch.nn.functional.cross_entropy(
    model(torch.randn(16, 4)), torch.randint(0, 3, (16,))) * 1e-7
scaler.scale(loss).backward()
scaler.step(optimizer)
taken = scaler.step_taken
scaler.update()
print(json.dumps({'taken': taken, 'sites': sorted(scaler.site_scales()),
                  'chainer': sys.modules.get('chainer') is not None}))
'''


def test_the_pytorch_adapter_runs_without_chainer():
    pytest.importorskip('torch')
    out = subprocess.run([sys.executable, '-c', TORCH_WITHOUT_CHAINER],
                         cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {'taken': True, 'sites': ['2.weight', 'cast#0'],
                      'chainer': False}
