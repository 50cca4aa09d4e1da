"""The documentation's code runs: every ```python block of the pages below,
in order, in one namespace per page, after a prelude that defines what the
text leaves to the reader (a model, a batch, a loader)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHAINER_PRELUDE = '''
import chainer, numpy as np
import chainer.functions as F, chainer.links as L

class MyModel(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(4, 3)

    def forward(self, x, t):
        y = self.fc(x.astype(self.fc.W.dtype))
        return F.softmax_cross_entropy(F.cast(y, np.float32), t)

rng = np.random.default_rng(0)
x = rng.standard_normal((8, 4)).astype(np.float32)
t = rng.integers(0, 3, 8).astype(np.int32)
'''

TORCH_PRELUDE = '''
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1),
                            torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.Linear(64, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.functional.cross_entropy
x, t = torch.randn(8, 3, 4, 4), torch.randint(0, 3, (8,))
loader = [(x, t), (x, t)]
'''

# page -> (prelude, {block index: code run just before that block})
PAGES = {
    'docs/chainer.md': (CHAINER_PRELUDE, {1: 'loss = model(x, t)'}),
    'docs/pytorch.md': (TORCH_PRELUDE, {}),
    # The README's PyTorch block, then its Chainer block.
    # (the PyTorch loop leaves x, t bound to its last batch)
    'README.md': (TORCH_PRELUDE + CHAINER_PRELUDE, {1: (
        'x = rng.standard_normal((8, 4)).astype(np.float32)\n'
        't = rng.integers(0, 3, 8).astype(np.int32)')}),
}
NEEDS_TORCH = ('docs/pytorch.md', 'README.md')


def python_blocks(path):
    with open(os.path.join(ROOT, path)) as f:
        return re.findall(r'```python\n(.*?)```', f.read(), re.S)


@pytest.mark.parametrize('page', sorted(PAGES))
def test_the_pages_python_blocks_run(page, tmp_path, monkeypatch):
    if page in NEEDS_TORCH:
        pytest.importorskip('torch')
    monkeypatch.chdir(tmp_path)
    prelude, before = PAGES[page]
    blocks = python_blocks(page)
    assert blocks, page
    namespace = {}
    exec(prelude, namespace)
    for i, block in enumerate(blocks):
        if i in before:
            exec(before[i], namespace)
        exec(compile(block, '{} block {}'.format(page, i), 'exec'),
             namespace)


def markdown_pages():
    pages = ['README.md'] + sorted(
        os.path.join('docs', name) for name in os.listdir(
            os.path.join(ROOT, 'docs')) if name.endswith('.md'))
    return [p for p in pages if os.path.exists(os.path.join(ROOT, p))]


@pytest.mark.parametrize('page', markdown_pages())
def test_every_relative_link_resolves(page):
    # [text](path) and ![alt](path), relative to the page; web links and
    # anchors within a page are not files.
    with open(os.path.join(ROOT, page)) as f:
        text = re.sub(r'```.*?```', '', f.read(), flags=re.S)
    base = os.path.dirname(os.path.join(ROOT, page))
    broken = []
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
        path = target.split('#')[0]
        if not path or re.match(r'[a-z]+:', path):
            continue
        if not os.path.exists(os.path.normpath(os.path.join(base, path))):
            broken.append(target)
    assert not broken, (page, broken)
