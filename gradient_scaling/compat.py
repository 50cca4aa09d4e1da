"""Restore what Chainer 7.8.1 and ChainerCV 0.13.1 expect from their world.

Both packages are frozen; the world moved on.  Importing this module
restores *only names that are missing*, so it never changes behaviour where
they exist:

* NumPy >= 1.24 removed the aliases ``np.bool``, ``np.int``, ``np.float``,
  ``np.complex``, ``np.object`` and ``np.str`` (ChainerCV's VOC loader uses
  ``np.bool``, ``F.resize_images`` uses ``np.float``).  They were aliases of
  the Python builtins, and are restored as such.
* NumPy 2 removed ``np.sctypes`` (``chainer.functions.as_strided``).
* Python 3.12 has no ``distutils`` and NumPy 2 no ``numpy.distutils``;
  ``chainer._environment_check`` imports ``numpy.distutils.system_info``
  (only used on macOS).
* setuptools >= 77 (the one PyTorch's install brings) has no
  ``pkg_resources``, which Chainer (``_environment_check``,
  ``testing.with_requires``) and ChainerCV (its ``__version__``) import.
  The stand-in answers what they ask of it from :mod:`importlib.metadata`
  and ``packaging``, as pkg_resources would: ``require`` and
  ``WorkingSet().require`` resolve a requirement and its dependencies or
  raise ``DistributionNotFound`` / ``VersionConflict`` (both
  ``ResolutionError``); ``get_distribution(name).version``.

It runs only where Chainer runs: ``import gradient_scaling`` does not import
it, but leaves a finder that imports it right before ``chainer`` or
``chainercv`` is first imported; the Chainer adapter's modules import it
first.  A PyTorch user's NumPy is never touched.  :func:`install` is
idempotent; :data:`RESTORED` lists what was restored in this process.

.. admonition:: Example

    >>> from gradient_scaling import compat
    >>> compat.install()    # already done by the import; does nothing
    >>> import numpy, pkg_resources   # the real one or the stand-in
    >>> numpy.float32 in numpy.sctypes['float']
    True
    >>> pkg_resources.get_distribution('numpy').version == numpy.__version__
    True
    >>> try:
    ...     pkg_resources.require('numpy<1.0')
    ... except pkg_resources.VersionConflict:
    ...     print('numpy', numpy.__version__, 'is too new')
    numpy ... is too new

"""

import importlib
import importlib.machinery
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


def _stand_in_module(name, doc):
    # A spec, so that importlib.util.find_spec(name) answers as for any
    # imported module instead of raising ValueError.
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None,
                                                     origin=__name__)
    return module


def _restore_numpy_distutils():
    if _importable('numpy.distutils.system_info'):
        return
    doc = 'Stand-in from {}: what Chainer 7.8.1 uses of it.'.format(__name__)
    distutils_module = _stand_in_module('numpy.distutils', doc)
    system_info = _stand_in_module('numpy.distutils.system_info', doc)
    # Chainer asks for the BLAS configuration only to warn about macOS's
    # Accelerate; "unknown" is the truthful answer.
    system_info.get_info = lambda name, notfound_action=0: {}
    distutils_module.system_info = system_info
    sys.modules['numpy.distutils'] = distutils_module
    sys.modules['numpy.distutils.system_info'] = system_info
    numpy.distutils = distutils_module
    RESTORED.append('numpy.distutils')


# The pkg_resources stand-in.  Names and messages follow setuptools'
# pkg_resources/__init__.py, which Chainer and ChainerCV were written for.

class _ResolutionError(Exception):
    """A requirement cannot be met (pkg_resources.ResolutionError)."""

    def __repr__(self):
        return self.__class__.__name__.lstrip('_') + repr(self.args)


class _VersionConflict(_ResolutionError):
    """``(dist, req)``: the installed ``dist`` does not meet ``req``."""

    dist = property(lambda self: self.args[0])
    req = property(lambda self: self.args[1])

    def report(self):
        return '{} is installed but {} is required'.format(self.dist,
                                                            self.req)


class _ContextualVersionConflict(_VersionConflict):
    """A version conflict of a dependency: ``(dist, req, required_by)``."""

    required_by = property(lambda self: self.args[2])


class _DistributionNotFound(_ResolutionError):
    """``(req, requirers)``: nothing installed provides ``req``."""

    req = property(lambda self: self.args[0])
    requirers = property(lambda self: self.args[1])

    def report(self):
        requirers = ', '.join(sorted(self.requirers or ()))
        return 'The {!r} distribution was not found and is required by ' \
            '{}'.format(str(self.req), requirers or 'the application')

    __str__ = report


class _UnknownExtra(_ResolutionError):
    """A requirement names an extra that its distribution does not declare."""


def _packaging():
    try:
        import packaging.requirements
        import packaging.utils
    except ImportError:
        raise ImportError(
            "the pkg_resources stand-in of gradient_scaling.compat needs "
            "'packaging' (a dependency of matplotlib): pip install packaging")
    return packaging


def _requirement(text):
    """A ``packaging`` Requirement from a string or a Requirement."""
    return _packaging().requirements.Requirement(str(text))


def _canonical(name):
    return _packaging().utils.canonicalize_name(name)


def _parse_requirements(items):
    """Requirements from strings (one a line) or nested iterables of them."""
    if isinstance(items, str):
        for line in items.splitlines():
            line = line.strip()
            if line and not line.startswith('#'):
                yield _requirement(line)
    elif hasattr(items, 'specifier'):
        yield _requirement(items)
    else:
        for item in items:
            yield from _parse_requirements(item)


def _same_requirement(req):
    # What makes two pkg_resources Requirements equal.
    return (_canonical(req.name), str(req.specifier), frozenset(req.extras),
            str(req.marker), req.url)


def _meets(dist, req):
    # pkg_resources' Requirement.__contains__: pre-releases count.
    return req.specifier.contains(dist.version, prereleases=True)


def _marker_holds(req, extras):
    return req.marker is None or any(
        req.marker.evaluate({'extra': extra or ''}) for extra in extras)


class _Distribution(object):
    """An installed distribution (pkg_resources.Distribution's fields)."""

    def __init__(self, installed):
        self.installed = installed  # an importlib.metadata.Distribution
        self.project_name = installed.metadata['Name']
        self.key = self.project_name.lower()
        self.version = installed.version
        self.location = str(installed.locate_file(''))

    def __str__(self):
        return '{} {}'.format(self.project_name, self.version)

    def __repr__(self):
        return '{} ({})'.format(self, self.location)

    def requires(self, extras=()):
        """What this distribution needs, itself and with ``extras``.

        Raises:
            UnknownExtra: If it declares no such extra.

        """
        declared = {_canonical(extra) for extra in
                    self.installed.metadata.get_all('Provides-Extra') or ()}
        for extra in extras:
            if _canonical(extra) not in declared:
                raise _UnknownExtra('{} has no such extra feature {!r}'.format(
                    self, extra))
        return [req for req in map(_requirement, self.installed.requires or ())
                if _marker_holds(req, (None,) + tuple(extras))]


class _WorkingSet(object):
    """The distributions installed on ``entries`` (default: ``sys.path``)."""

    def __init__(self, entries=None):
        self.entries = list(sys.path if entries is None else entries)

    def _installed(self, name):
        found = importlib.metadata.distributions(name=name, path=self.entries)
        installed = next(iter(found), None)
        return None if installed is None else _Distribution(installed)

    def find(self, req):
        """The distribution installed for ``req``, or None.

        Raises:
            VersionConflict: If it is installed at another version.

        """
        req = _requirement(req)
        dist = self._installed(req.name)
        if dist is not None and not _meets(dist, req):
            raise _VersionConflict(dist, req)
        return dist

    def resolve(self, requirements):
        """The distributions that ``requirements`` need, dependencies too.

        In pkg_resources' order (the last requirement first, then breadth
        first), a distribution once per requirement naming it.

        Raises:
            DistributionNotFound: If one is not installed.
            VersionConflict: If one is installed at a version not required.

        """
        pending = list(requirements)[::-1]
        processed, required_by, extras_of = set(), {}, {}
        needed = []
        while pending:
            req = pending.pop(0)
            same = _same_requirement(req)
            if same in processed or not _marker_holds(
                    req, extras_of.get(same, ()) + (None,)):
                continue
            dist = self._installed(req.name)
            if dist is None:
                raise _DistributionNotFound(req, required_by.get(same))
            needed.append(dist)
            if not _meets(dist, req):
                if required_by.get(same):
                    raise _ContextualVersionConflict(dist, req,
                                                     required_by[same])
                raise _VersionConflict(dist, req)
            dependencies = dist.requires(req.extras)[::-1]
            pending.extend(dependencies)
            for dependency in dependencies:
                key = _same_requirement(dependency)
                required_by.setdefault(key, set()).add(req.name)
                extras_of[key] = tuple(req.extras)
            processed.add(same)
        return needed

    def require(self, *requirements):
        """:meth:`resolve` for requirement strings, as Chainer calls it."""
        return self.resolve(list(_parse_requirements(requirements)))


def _require(*requirements):
    return _WorkingSet().require(*requirements)


def _get_distribution(dist):
    if isinstance(dist, _Distribution):
        return dist
    working_set = _WorkingSet()
    return working_set.find(dist) or working_set.require(str(dist))[0]


def _restore_pkg_resources():
    if _importable('pkg_resources'):
        return
    module = _stand_in_module('pkg_resources', (
        "Stand-in for setuptools' pkg_resources, from {}: what Chainer "
        '7.8.1 and ChainerCV 0.13.1 use of it.'.format(__name__)))
    vars(module).update(
        ResolutionError=_ResolutionError, VersionConflict=_VersionConflict,
        DistributionNotFound=_DistributionNotFound,
        ContextualVersionConflict=_ContextualVersionConflict,
        UnknownExtra=_UnknownExtra, Distribution=_Distribution,
        WorkingSet=_WorkingSet, parse_requirements=_parse_requirements,
        require=_require, get_distribution=_get_distribution)
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
