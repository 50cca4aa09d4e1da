"""The adapter's native callbacks: ``native.cpp``, built once per PyTorch.

What a pass of the PyTorch adapter spends on PyTorch's own machinery in
Python, one Python call at a time, ``native.cpp`` does in one call each:
reading a graph's structure (:func:`structure_function`: the nodes of
:func:`gradient_scaling.torch.graph.python_structure`, its signature as
bytes), putting a pass's callbacks
on its nodes and taking them off (:class:`Hooks`: no ``RemovableHandle``
per callback), and the landing hook every parameter carries for the
hook's life (:class:`Landing`: no Python call for a gradient that lands
while no pass runs, or at scale 1). What the callbacks do is the same
Python code either way; gradients and scales are the same bit for bit
(``tests/test_torch_native.py``). A small dense CPU tensor's maximum,
finiteness and product by a power of two are loops there (results that
do not depend on the order of the work: ATen's bits), and a refresh's
reads of a tensor (:mod:`gradient_scaling.torch.arrays`) are ATen's own
operations in one call each, where the module is built already
(:func:`built`).

It is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and
``ninja``) the first time a :class:`~gradient_scaling.torch.GradientScaling`
is made, into ``$GRADIENT_SCALING_CACHE`` (default
``~/.cache/gradient_scaling``), under a name that changes with the source,
the PyTorch version and the Python version; then loaded from there. Where
it cannot be built (no compiler, a PyTorch whose internals differ) the
adapter says so once (a ``RuntimeWarning``) and uses the Python
implementation below, which does the same; a compiler's refusal is kept
(``FAILED`` in the build folder), so that later processes do not compile
it again. ``GRADIENT_SCALING_NATIVE=0``
chooses the Python implementation without trying. A library that a
finished build left and a process loaded once (``loaded`` notes it) is
imported directly; processes that build (or check the build) at once take
turns on an advisory lock of the build folder
(``flock``), which the system drops however its holder ends; so a lock file
of ``torch.utils.cpp_extension`` found while that lock is held is one that
a process killed during its build left behind, and it is removed (with a
warning) rather than waited on forever.
"""

import contextlib
import functools
import hashlib
import math
import os
import shutil
import sys
import threading
import time
import warnings

import torch

__all__ = ['module', 'built', 'reason', 'Hooks', 'Landing', 'hook_set_class',
           'is_landing_hook', 'left_scaled_division', 'planned',
           'structure_function', 'finite_check', 'dtype_reader',
           'unchecked_reader', 'half_gradients', 'flagless_finite_check']

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       'native.cpp')
_lock = threading.Lock()
_loaded = []  # [module or None] once tried
_reason = []  # why the Python implementation is used


def _build_directory(name):
    root = os.environ.get('GRADIENT_SCALING_CACHE') or os.path.join(
        os.path.expanduser('~'), '.cache', 'gradient_scaling')
    return os.path.join(root, name)


#: The compiler's flags: no contraction of a product and a sum into one
#: fused operation (the module's arithmetic rounds as Python's does).
_FLAGS = ['-O2', '-ffp-contract=off']

#: How processes share a build folder (part of its name: a folder is only
#: ever used under one rule).
_PROTOCOL = 'flock-1'

#: Where no advisory lock can be taken, ``torch.utils.cpp_extension``'s
#: lock file older than this is taken as left behind (a build takes about
#: 30 s).
_STALE_SECONDS = 600

#: How long a process waits on another's build before it says so.
_SAY_WAITING_SECONDS = 5.0


def _name():
    with open(_SOURCE, 'rb') as f:
        digest = hashlib.sha256(f.read())
    digest.update('{} {}.{} {} {} {}'.format(
        torch.__version__, sys.version_info[0], sys.version_info[1],
        sys.implementation.cache_tag, ' '.join(_FLAGS),
        _PROTOCOL).encode())
    return 'gradient_scaling_native_' + digest.hexdigest()[:12]


def _find_ninja():
    """Puts the ninja of the ``ninja`` package (in a venv's ``bin``, not
    on ``PATH`` unless the venv is activated) on ``PATH`` where none is,
    for ``torch.utils.cpp_extension``; returns ninja's path or None."""
    found = shutil.which('ninja')
    if found is None:
        try:
            import ninja
            directory = ninja.BIN_DIR
        except (ImportError, AttributeError):
            directory = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(directory, 'ninja')):
            os.environ['PATH'] = directory + os.pathsep + \
                os.environ.get('PATH', '')
            found = shutil.which('ninja')
    return found


def module():
    """The compiled module, or None where the Python implementation is
    used (:func:`reason` says why). Built on the first call."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_load())
    return _loaded[0]


def built():
    """The compiled module where it was loaded already, else None (not
    built for the caller: what needs it alone may do without)."""
    return _loaded[0] if _loaded else None


def reason():
    """Why the Python implementation is used ('' when it is not)."""
    module()
    return _reason[0] if _reason else ''


def _load():
    if os.environ.get('GRADIENT_SCALING_NATIVE', '1') == '0':
        _reason.append('GRADIENT_SCALING_NATIVE=0')
        return None
    name = _name()
    directory = _build_directory(name)
    failed = os.path.join(directory, 'FAILED')
    try:
        with open(failed) as f:  # (this source and PyTorch: not again)
            _fall_back(f.read().strip() + ' (as found before: ' + failed +
                       '; delete it to build again)')
            return None
    except OSError:
        pass
    try:
        loaded = _built_already(name, directory)
        if loaded is not None:
            return loaded
        if _find_ninja() is None:
            raise RuntimeError('ninja not found')
        from torch.utils import cpp_extension
        os.makedirs(directory, exist_ok=True)
        with _turn(directory) as alone:
            _clear_left_lock(directory, alone)
            loaded = _built_already(name, directory)  # (the lock was left)
            if loaded is not None:
                return loaded
            if not os.path.exists(_library(name, directory)):
                sys.stderr.write(
                    'gradient_scaling: building the native PyTorch '
                    'callbacks (once per PyTorch version, about 30 s) in '
                    '{}\n'.format(directory))
            module = cpp_extension.load(
                name, [_SOURCE], build_directory=directory,
                extra_cflags=_FLAGS, verbose=False)
            _mark_loaded(name, directory)
            return module
    except Exception as error:  # NOQA: any failure means: Python instead
        # (a build's error: the compiler's first error lines, not the
        # command line that precedes them)
        lines = [line.strip() for line in str(error).splitlines()]
        errors = [line for line in lines if ': error' in line] or \
            [line for line in lines if 'error' in line.lower()] or lines
        text = '{}: {}'.format(type(error).__name__,
                               ' | '.join(errors[:3])[:600])
        if 'Error building extension' in str(error):
            # The compiler refused this source against this PyTorch (its
            # internals differ): said once, not compiled again each run.
            try:
                with open(failed, 'w') as f:
                    f.write(text + '\n')
            except OSError:
                pass
        _fall_back(text)
        return None


def _library(name, directory):
    return os.path.join(directory, name + (
        '.pyd' if sys.platform == 'win32' else '.so'))


def _signature(path):
    """A file's size and modification time, as text (None if absent)."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return '{} {}\n'.format(status.st_size, status.st_mtime_ns)


def _mark_loaded(name, directory):
    """Notes that the library as it is now loaded once (``loaded``: its
    size and time), so that later processes import it directly."""
    signature = _signature(_library(name, directory))
    if signature is None:
        return
    path = os.path.join(directory, 'loaded')
    try:
        with open(path + '.new', 'w') as f:
            f.write(signature)
        os.replace(path + '.new', path)
    except OSError:
        pass


def _built_already(name, directory):
    """The module, imported from the library a finished build left in
    ``directory`` (no build runs there: a build holds its lock file from
    start to end; and the library is the one a process loaded before, as
    ``loaded`` notes: not one cut short by a build killed while linking,
    which would not import but crash), without ``cpp_extension``'s check
    of the build (ranks that start at once do not wait on each other, and
    a clone elsewhere, whose source path differs, does not build it
    again); None where there is none (then checked, or built, by
    ``cpp_extension``)."""
    library = _library(name, directory)
    if os.path.exists(os.path.join(directory, 'lock')):
        return None
    try:
        with open(os.path.join(directory, 'loaded')) as f:
            noted = f.read()
    except OSError:
        return None
    if noted != _signature(library):
        return None
    import importlib.util
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


@contextlib.contextmanager
def _turn(directory):
    """This process's turn at the build folder: an advisory lock on its
    ``turn`` file, held while it builds or loads and dropped by the system
    when the process ends, however it ends. Yields whether it is held (not
    where the platform or the file system has no such lock)."""
    try:
        import fcntl
    except ImportError:  # (Windows)
        yield False
        return
    with open(os.path.join(directory, 'turn'), 'a') as f:
        start = time.monotonic()
        said = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError:  # (a file system without the lock)
                yield False
                return
            if not said and \
                    time.monotonic() - start > _SAY_WAITING_SECONDS:
                sys.stderr.write(
                    'gradient_scaling: waiting for another process that '
                    'builds the native PyTorch callbacks in {}\n'.format(
                        directory))
                said = True
            time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _clear_left_lock(directory, alone):
    """Removes ``torch.utils.cpp_extension``'s lock file where no build
    can be holding it: ``alone`` (this process has the folder's turn, and
    every process that builds here takes it first), or, without a turn, a
    file older than any build. Such a file is what a process killed during
    its build leaves, and ``cpp_extension`` would wait on it forever."""
    path = os.path.join(directory, 'lock')
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return
    if not alone and age < _STALE_SECONDS:
        return
    try:
        os.remove(path)
    except OSError:
        return
    warnings.warn(
        'gradient_scaling: removed {}, left {:.0f} s ago by a build of the '
        'native PyTorch callbacks that did not end (a process killed '
        'during it); building or loading them now'.format(path, age),
        RuntimeWarning)


def _fall_back(text):
    _reason.append(text)
    warnings.warn(
        'gradient_scaling: the native PyTorch callbacks could not be '
        'built or loaded ({}); using the Python implementation (the '
        'same gradients, more time per step). It needs a C++ compiler '
        'and ninja (pip install ninja); GRADIENT_SCALING_NATIVE=0 '
        'silences this.'.format(text), RuntimeWarning)


# -- the Python implementation (the same behaviour) ----------------------


class PythonHooks(object):

    """A pass's callbacks on its nodes, taken off all at once."""

    def __init__(self):
        self._handles = []
        self._reads = []

    def add_pre(self, node, fn):
        self._handles.append(node.register_prehook(fn))

    def add_post(self, node, fn):
        self._handles.append(node.register_hook(fn))

    def add_scaling_pre(self, node, factor, indices):
        """The incoming gradients of ``node`` at ``indices`` times
        ``factor`` (always a multiplication; natively, no Python)."""
        self.add_pre(node, functools.partial(_times, factor, indices))

    def add_scaling_post(self, node, factor, indices):
        """The gradients ``node`` returns at ``indices`` times
        ``factor``."""
        self.add_post(node, lambda grad_inputs, grad_outputs:
                      _times(factor, indices, grad_inputs))

    def add_refresh_read(self, node, weight, n, coefficient, fmt_max,
                         limit, fallback):
        """The benchmark's control of a refresh's reads: ``fallback(g)``
        of the incoming gradient ``g`` (natively, the refresh's own reads
        where it makes them natively: a GEMM's of ``g`` and ``weight``,
        a cast's, ``weight`` None, of ``g``), its result kept (:meth:`take_
        reads`); ``g`` then times 1."""
        reads = self._reads

        def read(grads):
            if grads[0] is None:
                return None
            reads.append(float(fallback(grads[0])))
            return _times(1.0, (0,), grads)
        self.add_pre(node, read)

    def take_reads(self):
        """What the refresh-read hooks read so far, in order (then
        forgotten)."""
        taken, self._reads[:] = list(self._reads), []
        return taken

    def clear(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __len__(self):
        return len(self._handles)


def _times(factor, indices, grads):
    return tuple(g * factor if g is not None and i in indices else g
                 for i, g in enumerate(grads))


def hook_set_class():
    """The class of a pass's set of callbacks (made empty, ``add_pre(node,
    fn)``: ``node.register_prehook``, ``add_post(node, fn)``:
    ``node.register_hook``, ``clear()``; ``add_scaling_pre`` and
    ``add_scaling_post(node, factor, indices)``: those gradients
    multiplied, natively without Python, the benchmark's floor of a
    native pass; ``add_refresh_read`` and ``take_reads``: a refresh's
    reads so, the floor of a native refresh): native or Python. Asked
    once (a hook keeps it: a pass then calls no Python here)."""
    native = module()
    return PythonHooks if native is None else native.HookSet


def planned():
    """What a planned pass needs of the native module (the module), or None
    where it is not built (passes are then not planned): ``PlannedTable()``
    (a pass's factors: ``set(factors, checks)``, its cast sites' checks
    ``checked_by(bound, fmt_max)``, ``use_python(dispatch)``, ``mode``,
    ``deviated``), ``planned_events([(position, post, seq,
    [(index, slot), ...]), ...])`` (a layout's native hooks, made once) and
    ``HookSet.add_planned_events(order, table, events)`` (them on a
    graph's nodes, in one call), ``leaves_with_other_hooks(leaves)``
    (:func:`~gradient_scaling.torch._internals.leaves_with_other_hooks`,
    read from the tensors' fields) and ``leaf_devices(leaves)`` (how many
    devices they are on)."""
    return module()


def left_scaled_division():
    """``divide_left_scaled(pairs, flags)`` of the native module (the
    gradients left scaled in ``.grad`` divided in place as
    :meth:`~gradient_scaling.torch.hook.GradientScaling._unscale_pending`
    divides them, the float32 ones, checked into ``flags``, the pass's
    flag per device, made there where missing; the others handed back),
    or None where it is not built."""
    native = module()
    return None if native is None else native.divide_left_scaled


def finite_check():
    """``finite_into(tensors, losses, found, one)`` of the native module
    (the common case of the pass's final check,
    :func:`~gradient_scaling.torch.hook._all_finite`, in one call: None
    where it does not apply), or None where it is not built."""
    native = module()
    return None if native is None else native.finite_into


def flagless_finite_check():
    """``finite_all(tensors, losses)`` of the native module (the same
    where no division made a flag: one is made on their device), or None
    where it is not built."""
    native = module()
    return None if native is None else native.finite_all


def unchecked_reader():
    """``unchecked_grads(leaves, divided, done)`` of the native module
    (the gradients of ``leaves`` that no in-place division read: not a
    parameter of the lists of ``divided``, the native division's, nor of
    ``id`` in the set ``done``, the Python one's), or None where it is not
    built."""
    native = module()
    return None if native is None else native.unchecked_grads


def leaves_check():
    """``leaves_finite(leaves, divided, done, losses, found)`` of the
    native module (:func:`unchecked_reader`'s gradients and the losses
    checked as :func:`finite_check` checks them into the division's flag
    ``found``, or as :func:`flagless_finite_check` where it is None, in
    one call: None where it does not apply), or None where it is not
    built."""
    native = module()
    return None if native is None else native.leaves_finite


def saved_witnesses_reader():
    """``saved_finite_witnesses([(node, field), ...])`` of the native
    module (the finiteness witness of each tensor a GEMM's node saved as
    ``field``, as ``arrays.finite_witness(internals.saved(node, field))``
    gives it, None where that reads None; a list, in one call), or None
    where it is not built."""
    native = module()
    return None if native is None else native.saved_finite_witnesses


def half_gradients(build=True):
    """``half_gradients(param_groups)`` of the native module (whether a
    parameter of an optimizer's groups has a float16 gradient), or the
    same in Python where it is not built (or, ``build`` False, not built
    yet: not built for it alone)."""
    native = module() if build else built()
    return _half_gradients if native is None else native.half_gradients


def _half_gradients(groups):
    return any(p.grad is not None and p.grad.dtype == torch.float16
               for group in groups for p in group['params'])


def dtype_reader():
    """``input_dtype(node, slot)`` of the native module (:func:`~
    gradient_scaling.torch._internals.input_dtype`, without making every
    slot's metadata object), or None where it is not built."""
    native = module()
    return None if native is None else native.input_dtype


def Hooks():
    """An empty set of callbacks for one pass (:func:`hook_set_class`)."""
    return hook_set_class()()


class PythonLanding(object):

    """The state of a hook's landing hooks, as :class:`Landing` keeps it
    natively: whether a pass runs (:meth:`set_running`), which parameters'
    gradients reach them at scale 1 in it (:meth:`set_unit`); the hook
    for a parameter (:meth:`hook`)."""

    def __init__(self):
        self.running = False
        self.unit = None  # id of a parameter -> the scale it lands at
        self.record = None  # where (param, scale) is appended for them
        self.pending = None  # where (param, 1 / scale) is, for those left
        self.excluded = frozenset()  # ids of those never left scaled

    def set_running(self, running):
        self.running = running

    def set_unit(self, unit, record, pending=None, excluded=()):
        self.unit, self.record, self.pending = unit, record, pending
        self.excluded = frozenset(id(p) for p in excluded)

    @staticmethod
    def unit_set(params):
        return {id(p): 1.0 for p in params}

    @staticmethod
    def landing_set(pairs):
        for _, scale in pairs:
            _check_landing_scale(scale)
        return {id(p): scale for p, scale in pairs}

    @staticmethod
    def learn(unit, pairs):
        for param, scale in pairs:
            _check_landing_scale(scale)
            unit.setdefault(id(param), scale)

    def hook(self, param, fn):
        return functools.partial(_python_landing, self, id(param),
                                 (param, 1.0), fn)

    @staticmethod
    def adopt(param, hook):
        """(Natively, ``hook`` then lands without a Python call while it
        is ``param``'s only Python hook: here each landing is one.)"""
        return False

    @staticmethod
    def unadopt(param, hook):
        pass


def _check_landing_scale(scale):
    if not scale > 0 or math.frexp(scale)[0] != 0.5:
        raise ValueError('gradient_scaling: a landing scale that is no '
                         'power of two')


def _python_landing(state, key, record, fn, grad):
    if not state.running:
        return None
    unit = state.unit
    scale = None if unit is None else unit.get(key)
    if scale is None:
        return fn(grad)
    if scale == 1.0:
        state.record.append(record)
        return None
    from gradient_scaling.torch.hook import unscaled  # (imports this)
    param, inverse = record[0], 1.0 / scale
    state.record.append((param, scale))
    if state.pending is not None and key not in state.excluded and \
            grad.dtype in (torch.float32, torch.float64) and \
            not grad.is_sparse and 2.0 ** -126 <= inverse <= 2.0 ** 127 \
            and not torch.is_grad_enabled() and param.grad is None:
        state.pending.append((param, inverse))
        return None
    return unscaled(grad, scale)


def Landing():
    """The state of a hook's landing hooks: ``set_running(bool)``,
    ``unit_set(params)`` and ``landing_set([(param, scale), ...])`` (made
    once for a plan: parameters whose gradients reach them at scale 1, or
    at the scale given, a power of two), ``learn(unit, [(param, scale),
    ...])`` (each ``param``'s scale added to such a set, where it has
    none: a refresh pass learns them as it runs), ``set_unit(unit or None,
    record, pending=None, excluded=())`` (the parameters of ``unit`` have
    their gradients land at its scale in the running pass: each recorded
    as ``(param, scale)`` appended to the list ``record``, and divided by
    it as :func:`gradient_scaling.torch.hook.unscaled` divides, a new
    tensor; at scale 1, only recorded; with a list ``pending``, one that
    :meth:`~gradient_scaling.torch.hook.GradientScaling.land` would leave
    scaled in an empty ``.grad`` is left so, ``(param, 1 / scale)``
    appended there for the adapter to divide when the pass ends: a
    float32 or float64 dense gradient, a normal float32 inverse, grad
    mode off, ``.grad`` empty, the parameter not of ``excluded``), and
    ``hook(param, fn)``: the hook to register on ``param``, which returns
    None while no pass runs, lands a gradient of ``unit`` so, else returns
    ``fn(grad)``; ``adopt(param, hook)``, once it is registered: natively,
    it then lands without a Python call while it is the parameter's only
    Python tensor hook (PyTorch runs them from one dictionary, which
    another hook, registered before or after, joins: they then run as
    PyTorch runs them, in order), whether it does; ``unadopt(param,
    hook)`` before the hook goes (PyTorch's own way back)."""
    native = module()
    return PythonLanding() if native is None else native.Landing()


def is_landing_hook(fn):
    """Whether ``fn`` is a hook :func:`Landing` made."""
    if getattr(fn, 'func', None) is _python_landing:
        return True
    native = module()
    return native is not None and type(fn) is native.LandingHook


def structure_function():
    """The native :func:`gradient_scaling.torch.graph.python_structure`,
    or None where it is not built (asked once: a plan cache keeps it)."""
    native = module()
    return None if native is None else native.structure
