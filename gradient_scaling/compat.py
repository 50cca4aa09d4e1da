"""Restore what Chainer 7.8.1 and ChainerCV 0.13.1 expect from their world.

Both packages are frozen; the world moved on.  This module must be imported
before ``chainer`` (``import gradient_scaling`` does it first) and restores
*only names that are missing*, so it never changes behaviour where they exist:

* NumPy >= 1.24 removed the aliases ``np.bool``, ``np.int``, ``np.float``,
  ``np.complex``, ``np.object`` and ``np.str`` (ChainerCV's VOC loader uses
  ``np.bool``, ``F.resize_images`` uses ``np.float``).  They were aliases of
  the Python builtins, and are restored as such.
* NumPy 2 removed ``np.sctypes`` (``chainer.functions.as_strided``).
* Python 3.12 has no ``distutils`` and NumPy 2 no ``numpy.distutils``;
  ``chainer._environment_check`` imports ``numpy.distutils.system_info``
  (only used on macOS) and ``pkg_resources`` (setuptools may be absent).

:func:`install` is idempotent and runs on import.  :data:`RESTORED` lists
what was restored in this process, for diagnostics.
"""

import importlib
import importlib.metadata
import sys
import types
import warnings

import numpy

__all__ = ['RESTORED', 'install']

RESTORED = []

_REMOVED_ALIASES = {
    'bool': bool, 'int': int, 'float': float, 'complex': complex,
    'object': object, 'str': str,
}


def _missing_attr(module, name):
    # numpy >= 1.24 raises AttributeError from its module __getattr__ for the
    # expired aliases; hasattr is the honest test of "missing".
    with warnings.catch_warnings():
        # numpy 1.2x warns that np.bool etc. will become scalar types.
        warnings.simplefilter('ignore', FutureWarning)
        try:
            getattr(module, name)
        except AttributeError:
            return True
    return False


def _importable(name):
    if name in sys.modules:
        return True
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _restore_numpy_aliases():
    for name, value in _REMOVED_ALIASES.items():
        if _missing_attr(numpy, name):
            setattr(numpy, name, value)
            RESTORED.append('numpy.' + name)


def _restore_sctypes():
    if not _missing_attr(numpy, 'sctypes'):
        return
    numpy.sctypes = {
        'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
        'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
        'float': [numpy.float16, numpy.float32, numpy.float64,
                  numpy.longdouble],
        'complex': [numpy.complex64, numpy.complex128, numpy.clongdouble],
        'others': [bool, object, bytes, str, numpy.void],
    }
    RESTORED.append('numpy.sctypes')


def _restore_numpy_distutils():
    if _importable('numpy.distutils.system_info'):
        return
    distutils_module = types.ModuleType('numpy.distutils')
    system_info = types.ModuleType('numpy.distutils.system_info')
    # Chainer asks for the BLAS configuration only to warn about macOS's
    # Accelerate; "unknown" is the truthful answer.
    system_info.get_info = lambda name, notfound_action=0: {}
    distutils_module.system_info = system_info
    sys.modules['numpy.distutils'] = distutils_module
    sys.modules['numpy.distutils.system_info'] = system_info
    numpy.distutils = distutils_module
    RESTORED.append('numpy.distutils')


class _ResolutionError(Exception):
    pass


class _DistributionNotFound(_ResolutionError):
    pass


class _VersionConflict(_ResolutionError):
    pass


def _split_requirement(requirement):
    for i, char in enumerate(requirement):
        if char in '<>=!~ ;[':
            return requirement[:i], requirement[i:]
    return requirement, ''


def _pkg_resources_require(requirement):
    name, specifier = _split_requirement(requirement)
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise _DistributionNotFound(requirement)
    if specifier.strip():
        try:
            from packaging.requirements import Requirement
        except ImportError:
            return []
        if not Requirement(requirement).specifier.contains(
                version, prereleases=True):
            raise _VersionConflict(requirement, version)
    return []


class _Distribution(object):

    def __init__(self, name):
        try:
            self.version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise _DistributionNotFound(name)
        self.project_name = name


class _WorkingSet(object):

    def find(self, requirement):
        name = getattr(requirement, 'name', None) or _split_requirement(
            str(requirement))[0]
        try:
            return _Distribution(name)
        except _DistributionNotFound:
            return None


def _restore_pkg_resources():
    if _importable('pkg_resources'):
        return
    module = types.ModuleType('pkg_resources')
    # What Chainer and ChainerCV use of it: the three errors, require,
    # get_distribution and WorkingSet().find.
    vars(module).update(
        ResolutionError=_ResolutionError, VersionConflict=_VersionConflict,
        DistributionNotFound=_DistributionNotFound,
        require=_pkg_resources_require, get_distribution=_Distribution,
        WorkingSet=_WorkingSet)
    sys.modules['pkg_resources'] = module
    RESTORED.append('pkg_resources')


def _restore_distutils():
    if _importable('distutils'):
        return
    try:
        # setuptools ships the real distutils for Python >= 3.12.
        import setuptools._distutils as real
    except ImportError:
        return
    sys.modules['distutils'] = real
    RESTORED.append('distutils')


def install():
    """Restore the missing names; safe to call any number of times."""
    if getattr(install, 'done', False):
        return
    _restore_numpy_aliases()
    _restore_sctypes()
    _restore_distutils()
    _restore_numpy_distutils()
    _restore_pkg_resources()
    install.done = True


install()
