"""The compat module restores only what is missing, only where Chainer runs.

``import gradient_scaling`` (and the PyTorch adapter) leave NumPy and
``sys.modules`` alone; ``import chainer`` after it gets the restored names
first and works; the ``pkg_resources`` stand-in answers what Chainer and
ChainerCV ask, as setuptools' module would. The import checks run in fresh
processes: this one imported the compat module already (tests/conftest.py).
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy
import pytest

from gradient_scaling import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What compat may add to NumPy: none of it may appear before Chainer does.
NUMPY_SHIM_NAMES = sorted(set(compat._REMOVED_ALIASES)
                          | {'sctypes', 'distutils'})

#: Put first in a fresh process: setuptools >= 77, which has no
#: pkg_resources, whatever this interpreter's setuptools is.
WITHOUT_PKG_RESOURCES = '''
import sys
class NoPkgResources(object):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'pkg_resources':
            raise ModuleNotFoundError('No module named %r' % name, name=name)
sys.meta_path.insert(0, NoPkgResources())
'''


def run_python(code, pythonpath=None):
    """Runs ``code`` in a fresh interpreter; its last line, read as JSON."""
    env = dict(os.environ)
    if pythonpath:
        env['PYTHONPATH'] = os.pathsep.join(
            [str(pythonpath)] + [p for p in [env.get('PYTHONPATH')] if p])
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_distribution(folder, name, version, *metadata_lines):
    """An installed distribution as importlib.metadata and pkg_resources
    see one: a ``.dist-info`` folder with its METADATA, and no code."""
    dist_info = folder / '{}-{}.dist-info'.format(name.replace('-', '_'),
                                                  version)
    dist_info.mkdir()
    (dist_info / 'METADATA').write_text('\n'.join(
        ['Metadata-Version: 2.1', 'Name: ' + name, 'Version: ' + version]
        + list(metadata_lines)) + '\n')


# -- in this process (compat imported by conftest) -------------------------

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


# -- the pkg_resources stand-in, next to the real one where it exists -------

def _real_pkg_resources():
    if ('pkg_resources' in compat.RESTORED
            or importlib.util.find_spec('pkg_resources') is None):
        return None
    return importlib.import_module('pkg_resources')


IMPLEMENTATIONS = [
    pytest.param('stand-in', id='stand-in'),
    pytest.param('real', id='setuptools', marks=pytest.mark.skipif(
        _real_pkg_resources() is None,
        reason='this setuptools has no pkg_resources (>= 77, as PyTorch '
               'brings): only the stand-in can be checked')),
]


def _pkg_resources(implementation):
    """The stand-in's names, or the real module: one interface."""
    if implementation == 'real':
        return _real_pkg_resources()
    return type('StandIn', (), dict(
        WorkingSet=compat._WorkingSet, require=compat._require,
        get_distribution=compat._get_distribution,
        ResolutionError=compat._ResolutionError,
        VersionConflict=compat._VersionConflict,
        DistributionNotFound=compat._DistributionNotFound,
        UnknownExtra=compat._UnknownExtra))


@pytest.fixture
def probe_site(tmp_path):
    """Installed distributions: an app that needs a library (a
    pre-release, which pkg_resources accepts) and, with its extra, a
    distribution that is not installed; a top that needs the app and an
    older library."""
    write_distribution(tmp_path, 'probe-app', '1.0',
                       'Requires-Dist: probe-lib>=2.0',
                       'Requires-Dist: probe-absent; extra == "full"',
                       'Requires-Dist: probe-absent; python_version < "3"',
                       'Provides-Extra: full')
    write_distribution(tmp_path, 'probe-lib', '2.1rc1')
    write_distribution(tmp_path, 'probe-top', '1.0',
                       'Requires-Dist: probe-app',
                       'Requires-Dist: probe-lib<2')
    return tmp_path


def _outcome(pkg_resources, call):
    """What a call returns (the projects, canonical names) or raises."""
    from packaging.utils import canonicalize_name
    try:
        found = call()
    except pkg_resources.VersionConflict as e:
        return ('VersionConflict', str(e.dist.version),
                sorted(getattr(e, 'required_by', ())))
    except pkg_resources.DistributionNotFound as e:
        return 'DistributionNotFound', str(e.req), sorted(e.requirers or ())
    except pkg_resources.UnknownExtra:
        return 'UnknownExtra'
    if isinstance(found, list):
        return [canonicalize_name(dist.project_name) for dist in found]
    return found and (canonicalize_name(found.project_name), found.version)


def _requirement(implementation, text):
    # The real WorkingSet.find takes a parsed Requirement only.
    if implementation == 'real':
        return _real_pkg_resources().Requirement.parse(text)
    return text


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_working_set_resolves_as_pkg_resources(probe_site, implementation):
    pkg_resources = _pkg_resources(implementation)
    working_set = pkg_resources.WorkingSet([str(probe_site)])

    def outcome(*requirements):
        return _outcome(pkg_resources,
                        lambda: working_set.require(*requirements))

    # A dependency comes with its requirer; a pre-release meets >=2.0.
    assert outcome('probe-app') == ['probe-app', 'probe-lib']
    # pkg_resources' order: the last requirement first, then breadth
    # first; a distribution once per requirement that names it.
    assert outcome('probe-app>=1.0', 'probe-lib==2.1rc1') == \
        ['probe-lib', 'probe-app', 'probe-lib']
    assert outcome('probe-lib\n# a comment line\nprobe-app') == \
        ['probe-app', 'probe-lib', 'probe-lib']
    assert outcome('probe-lib<2') == ('VersionConflict', '2.1rc1', [])
    assert outcome('probe-top') == ('VersionConflict', '2.1rc1',
                                    ['probe-top'])
    assert outcome('probe-app[full]') == \
        ('DistributionNotFound', 'probe-absent; extra == "full"',
         ['probe-app'])
    assert outcome('probe-app[nosuch]') == 'UnknownExtra'
    assert outcome('not-installed-anywhere>=1') == \
        ('DistributionNotFound', 'not-installed-anywhere>=1', [])
    # A requirement whose marker is false here asks for nothing.
    assert outcome('not-installed-anywhere; python_version < "3"') == []

    def found(text):
        return _outcome(pkg_resources, lambda: working_set.find(
            _requirement(implementation, text)))

    assert found('probe-lib') == ('probe-lib', '2.1rc1')
    assert found('probe-app>=1') == ('probe-app', '1.0')
    assert found('probe-lib<2') == ('VersionConflict', '2.1rc1', [])
    assert found('not-installed-anywhere') is None


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_require_and_get_distribution_read_sys_path(implementation):
    pkg_resources = _pkg_resources(implementation)
    version = pkg_resources.get_distribution('numpy').version
    assert version == numpy.__version__
    assert _outcome(pkg_resources, lambda: pkg_resources.get_distribution(
        'numpy<1.0')) == ('VersionConflict', numpy.__version__, [])
    assert _outcome(pkg_resources, lambda: pkg_resources.get_distribution(
        'not-installed-anywhere')) == \
        ('DistributionNotFound', 'not-installed-anywhere', [])
    needed = _outcome(pkg_resources, lambda: pkg_resources.require(
        'chainercv'))
    assert needed[0] == 'chainercv'
    assert {'chainer', 'numpy', 'pillow'} <= set(needed)


def test_stand_in_errors_read_like_pkg_resources():
    with pytest.raises(compat._VersionConflict) as conflict:
        compat._require('numpy<1.0')
    assert conflict.value.report() == \
        'numpy {} is installed but numpy<1.0 is required'.format(
            numpy.__version__)
    assert repr(conflict.value).startswith('VersionConflict(numpy ')
    with pytest.raises(compat._DistributionNotFound) as missing:
        compat._get_distribution('not-installed-anywhere')
    assert str(missing.value) == ("The 'not-installed-anywhere' distribution "
                                  "was not found and is required by the "
                                  "application")
    assert isinstance(missing.value, compat._ResolutionError)


# -- in fresh processes ------------------------------------------------------

LIBRARY_IMPORT = '''
import json, sys, types, warnings
import numpy
before = dict(vars(numpy))
had_pkg_resources = 'pkg_resources' in sys.modules
import importlib, pkgutil
for name in %(modules)r:
    module = importlib.import_module(name)
    if name.endswith('.core'):
        for found in pkgutil.iter_modules(module.__path__, name + '.'):
            importlib.import_module(found.name)
after = dict(vars(numpy))

def numpy_submodule(key):
    # Importing numpy.typing (SciPy does) adds 'typing': not a patch.
    return (isinstance(after[key], types.ModuleType)
            and sys.modules.get('numpy.' + key) is after[key])

print(json.dumps({
    'added': sorted(k for k in set(after) - set(before)
                    if not numpy_submodule(k)),
    'added shim names': sorted(set(after) - set(before) & set(%(shims)r)),
    'removed': sorted(set(before) - set(after)),
    'replaced': sorted(k for k in before if k in after
                       and after[k] is not before[k]),
    'pkg_resources added': ('pkg_resources' in sys.modules
                            and not had_pkg_resources),
    'imported': sorted(m for m in ('gradient_scaling.compat', 'chainer',
                                   'chainercv', 'numpy.distutils')
                       if m in sys.modules)}))
'''


@pytest.mark.parametrize('modules', [
    ['gradient_scaling'],
    ['gradient_scaling.core'],
    ['torch', 'gradient_scaling.torch'],
], ids=['gradient_scaling', 'core', 'torch'])
def test_importing_the_library_leaves_numpy_and_sys_modules_alone(modules):
    if 'torch' in modules and importlib.util.find_spec('torch') is None:
        pytest.skip('PyTorch is not installed (make setup-test installs it '
                    'on Python 3.11 only)')
    report = run_python(LIBRARY_IMPORT % {'modules': modules,
                                          'shims': NUMPY_SHIM_NAMES})
    assert report == {'added': [], 'added shim names': [], 'removed': [],
                      'replaced': [], 'pkg_resources added': False,
                      'imported': []}


CHAINER_AFTER_LIBRARY = '''
import importlib, json, sys, warnings
import numpy as np
import gradient_scaling
with warnings.catch_warnings():
    warnings.simplefilter('ignore', FutureWarning)
    missing = [name for name in %(shims)r if not hasattr(np, name)]
compat_before = 'gradient_scaling.compat' in sys.modules
importlib.import_module(%(first)r)
import chainer, chainercv
import chainer.functions as F
from chainercv.datasets.voc import voc_utils
from gradient_scaling import compat
x = chainer.Variable(np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3))
print(json.dumps({
    'compat before': compat_before, 'done': compat.install.done,
    'missing, not restored': [name for name in missing if name != 'distutils'
                              and 'numpy.' + name not in compat.RESTORED],
    'resized': list(F.resize_images(x, (4, 6)).shape),
    'strided': list(F.as_strided(x, (2,), (1,)).shape),
    'np.bool': str(np.array([1, 0], dtype=np.bool).dtype)}))
'''


@pytest.mark.parametrize('first', ['chainer', 'chainercv'])
def test_import_chainer_after_the_library_restores_first(first):
    # The README's promise: import gradient_scaling, then chainer (or
    # ChainerCV first), on NumPy 2 and without setuptools' pkg_resources.
    report = run_python(CHAINER_AFTER_LIBRARY % {
        'first': first, 'shims': NUMPY_SHIM_NAMES})
    assert report == {'compat before': False, 'done': True,
                      'missing, not restored': [], 'resized': [1, 1, 4, 6],
                      'strided': [2], 'np.bool': 'bool'}


def test_library_imported_after_chainer_restores_at_once():
    # Too late to precede Chainer, not too late for what it looks up at run
    # time (ChainerCV's VOC loader reads np.bool when it loads a mask).
    report = run_python(textwrap.dedent('''
        import json, sys, types
        sys.modules['chainer'] = types.ModuleType('chainer')
        import gradient_scaling
        print(json.dumps('gradient_scaling.compat' in sys.modules))'''))
    assert report is True


def test_a_blocked_chainer_stays_blocked():
    # tests/test_core.py blocks Chainer with sys.modules['chainer'] = None:
    # that is not "imported", and the import still fails.
    report = run_python(textwrap.dedent('''
        import json, sys
        sys.modules['chainer'] = None
        import gradient_scaling
        try:
            import chainer
        except ImportError:
            failed = True
        else:
            failed = False
        print(json.dumps(['gradient_scaling.compat' in sys.modules,
                          failed]))'''))
    assert report == [False, True]


CHAINER_ASKS_PKG_RESOURCES = '''
import importlib.metadata, io, json, sys, unittest, warnings
%(without)s
import gradient_scaling
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    import chainer  # runs chainer._environment_check.check()
import chainercv
import pkg_resources
from chainer import testing
from gradient_scaling import compat

ran = []


class Case(unittest.TestCase):

    @testing.with_requires('numpy>=1.0')
    def test_numpy_1(self):
        ran.append('numpy_1')

    @testing.with_requires('numpy>=999')
    def test_numpy_999(self):
        ran.append('numpy_999')

    @testing.with_requires('not-installed-anywhere')
    def test_missing(self):
        ran.append('missing')

    @testing.without_requires('numpy>=999')
    def test_without_numpy_999(self):
        ran.append('without_numpy_999')


result = unittest.TextTestRunner(stream=io.StringIO()).run(
    unittest.defaultTestLoader.loadTestsFromTestCase(Case))
print(json.dumps({
    'stand-in': 'pkg_resources' in compat.RESTORED,
    'ran': sorted(ran),
    'skipped': sorted(test.id().rsplit('.', 1)[1]
                      for test, _ in result.skipped),
    'environment warnings': [
        line.strip() for w in caught for line in str(w.message).splitlines()
        if 'compatible' in line or 'Failed to check' in line],
    'chainercv version': [chainercv.__version__,
                          importlib.metadata.version('chainercv')]}))
'''


@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_chainer_and_chainercv_get_what_they_ask_of_pkg_resources(
        tmp_path, implementation):
    # A CuPy older than Chainer 7.8.1 wants: import chainer warns about it
    # (VersionConflict, then get_distribution('cupy').version); the other
    # optional packages are absent (DistributionNotFound), silently.
    write_distribution(tmp_path, 'cupy', '6.0.0')
    without = WITHOUT_PKG_RESOURCES if implementation == 'stand-in' else ''
    report = run_python(CHAINER_ASKS_PKG_RESOURCES % {'without': without},
                        pythonpath=tmp_path)
    assert report == {
        'stand-in': implementation == 'stand-in',
        'ran': ['numpy_1', 'without_numpy_999'],
        'skipped': ['test_missing', 'test_numpy_999'],
        'environment warnings': [
            'CuPy (cupy) version 6.0.0 may not be compatible with this '
            'version of Chainer.'],
        'chainercv version': ['0.13.1', '0.13.1']}


CHAINER_STYLE_TESTS = '''
import unittest

import numpy

import chainer
import chainer.functions as F
from chainer import testing


@testing.parameterize(*testing.product({
    'dtype': [numpy.float16, numpy.float32],
}))
@testing.with_requires('numpy>=1.10')
class TestVariableGrad(unittest.TestCase):

    def test_grad_of_a_sum(self):
        x = chainer.Variable(numpy.ones((2, 3), dtype=self.dtype))
        F.sum(x * 2).backward()
        numpy.testing.assert_array_equal(
            x.grad, numpy.full((2, 3), 2, dtype=self.dtype))

    @testing.with_requires('numpy>=999')
    def test_needs_a_future_numpy(self):
        raise AssertionError('with_requires should have skipped this')


testing.run_module(__name__, __file__)
'''


def test_a_chainer_style_test_module_collects_and_passes(tmp_path):
    # Chainer's wheel ships no tests; this module is written as its
    # test_variable.py is (parameterize, with_requires on the class and on
    # a method); a conftest imports the library, nothing else.
    (tmp_path / 'conftest.py').write_text('import gradient_scaling  # NOQA\n')
    (tmp_path / 'test_variable_style.py').write_text(CHAINER_STYLE_TESTS)
    out = subprocess.run(
        [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
         '-rs', str(tmp_path)], cwd=str(tmp_path), capture_output=True,
        text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert '2 passed, 2 skipped' in out.stdout, out.stdout
    assert 'SKIPPED [2] ' in out.stdout, out.stdout
    assert 'requires: numpy>=999' in out.stdout, out.stdout
