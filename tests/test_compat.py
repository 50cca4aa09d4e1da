"""The compat module restores only what is missing, and chainer works."""

import subprocess
import sys

import numpy

from gradient_scaling import compat


def test_aliases_are_the_builtins_or_numpy_own():
    # Either numpy had the name already (numpy 2's np.bool is np.bool_) or
    # compat restored the builtin that numpy < 1.24 aliased.
    for name, builtin in compat._REMOVED_ALIASES.items():
        value = getattr(numpy, name)
        if 'numpy.' + name in compat.RESTORED:
            assert value is builtin
        else:
            assert value is not None


def test_sctypes_available_and_complete():
    assert numpy.float32 in numpy.sctypes['float']
    assert numpy.int64 in numpy.sctypes['int']
    assert numpy.uint8 in numpy.sctypes['uint']


def test_install_does_not_touch_existing_names():
    sentinel_sctypes = numpy.sctypes
    before = list(compat.RESTORED)
    compat.install.done = False
    compat.install()
    assert numpy.sctypes is sentinel_sctypes
    assert compat.RESTORED == before


def test_pkg_resources_shim_semantics(monkeypatch):
    # Exercise the shim even where setuptools provides the real module.
    assert compat._Distribution('numpy').version == numpy.__version__
    compat._pkg_resources_require('numpy')
    try:
        compat._pkg_resources_require('numpy<0.1')
    except compat._VersionConflict:
        pass
    else:
        raise AssertionError('expected a version conflict')
    try:
        compat._pkg_resources_require('surely-not-installed-pkg-xyz')
    except compat._DistributionNotFound:
        pass
    else:
        raise AssertionError('expected DistributionNotFound')


def test_chainer_and_chainercv_import_and_run_in_fresh_process():
    code = (
        'import gradient_scaling, chainer, chainercv, numpy as np\n'
        'import chainer.functions as F\n'
        'from chainercv.datasets.voc import voc_utils\n'
        'x = chainer.Variable(np.arange(6, dtype=np.float32).reshape(1,1,2,3))\n'
        'y = F.resize_images(x, (4, 6))\n'
        'y2 = F.as_strided(x, (2,), (1,))\n'
        'print(y.shape, y2.shape, np.array([1,0], dtype=np.bool).dtype)\n')
    out = subprocess.run([sys.executable, '-c', code], check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == '(1, 1, 4, 6) (2,) bool'
