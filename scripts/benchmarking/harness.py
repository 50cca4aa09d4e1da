"""The one timing loop, the peak-memory rounds and the hook's timer.

Framework-neutral: a *variant* is any object with a ``label`` and a
``step()`` (one training iteration, synchronised with its device), and
optionally ``prepare()`` (untimed, before each step: clearing gradients)
and ``skips`` (steps skipped so far). Chainer's variants are in
:mod:`benchmarking.chainer_variants`; another framework adds its own.

.. admonition:: Example

    >>> class Busy(object):
    ...     def __init__(self, label):
    ...         self.label = label
    ...     def step(self):
    ...         sum(range(1000))
    >>> samples = time_alternately([Busy("a"), Busy("b")], rounds=3)
    >>> [len(s) for s in samples.values()]
    [3, 3]
"""

import collections
import contextlib
import dataclasses
import importlib.util
import os
import statistics
import sys
import time
import tracemalloc

__all__ = ['Sample', 'time_alternately', 'steady_steps', 'peak_memory',
           'HostPeak', 'TorchCpuPeak', 'TorchCudaPeak', 'CupyPeak',
           'SectionTimes', 'TimedCalls',
           'ratios', 'amortised', 'quartiles', 'BlasThreads', 'MAX_ROUNDS']

#: Rounds a ``budget`` may add up to.
MAX_ROUNDS = 200


@dataclasses.dataclass(frozen=True)
class Sample(object):
    """One timed step: wall seconds and CPU seconds of this process."""

    wall: float
    cpu: float


def _prepare(variant):
    prepare = getattr(variant, 'prepare', None)
    if prepare is not None:
        prepare()


def balanced_orders(n):
    """Orders of ``range(n)``, one per round, in which every index comes
    right after every other equally often (a Williams design: n rows for
    an even n, 2n for an odd one). The first row is 0, 1, n-1, 2, n-2, ...;
    each next row adds 1 modulo n; an odd n also takes the rows reversed.
    """
    first, low, high = [0], 1, n - 1
    while low <= high:
        first.append(low)
        if low != high:
            first.append(high)
        low, high = low + 1, high - 1
    rows = [[(x + i) % n for x in first[:n]] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def time_alternately(variants, rounds, budget=0.0, warm_up=True, log=None,
                     block=1, cold=None):
    """Times ``block`` steps of every variant per round, alternated.

    Every variant runs once per round, the rounds' orders those of a
    Williams design (:func:`balanced_orders`), so that each sees the same
    machine load and each is run right after every other equally often:
    none gains or loses from following a particular other (a refreshing
    GS step leaves the caches colder than a plain one). Wall time
    (``time.perf_counter``) and this process's CPU time
    (``time.process_time``) are both taken; on a shared machine the CPU
    time is the steadier.

    With ``block`` > 1, each variant runs ``block`` steps back to back in
    its turn, as a training loop runs its step: the first of them follows
    another variant's steps, its caches cold (another model, other code),
    and goes to ``cold``; the others, steps in the steady state a training
    loop is in, are the samples. With ``block`` = 1 every sample is such
    a first step.

    Args:
        variants (list): Objects with ``label`` and ``step()``.
        rounds (int): Timed rounds, at least.
        budget (float): More rounds while they fit in this many seconds,
            estimated from the warm-up round (at most :data:`MAX_ROUNDS`).
        warm_up (bool): One untimed round first (allocations, caches, a
            hook's first refresh), of one step per variant.
        log (callable): Gets a progress line per round.
        block (int): Steps of a variant per turn.
        cold (dict): With ``block`` > 1, filled with label -> list of
            :class:`Sample` of the first step of each turn.

    Returns:
        dict: label -> list of :class:`Sample`, ``block - 1`` per round
        (one where ``block`` is 1), in the order they were taken.

    """
    if block < 1:
        raise ValueError('block must be >= 1, not {}'.format(block))
    samples = {v.label: [] for v in variants}
    firsts = {v.label: [] for v in variants}
    if warm_up:
        start = time.perf_counter()
        for v in variants:
            _prepare(v)
            v.step()
        seconds = (time.perf_counter() - start) * block
        if budget > 0 and seconds > 0:
            rounds = max(rounds, min(int(budget / seconds), MAX_ROUNDS))
    orders = balanced_orders(len(variants))
    for r in range(rounds):
        for v in [variants[i] for i in orders[r % len(orders)]]:
            for k in range(block):
                _prepare(v)
                wall, cpu = time.perf_counter(), time.process_time()
                v.step()
                sample = Sample(time.perf_counter() - wall,
                                time.process_time() - cpu)
                (firsts if k == 0 and block > 1 else samples)[
                    v.label].append(sample)
        if log is not None:
            log('    round {}/{}'.format(r + 1, rounds))
    if cold is not None and block > 1:
        cold.update(firsts)
    return samples


def steady_steps(entries, samples, block):
    """Of ``entries``, one per step of a variant in order (its ``phases``:
    the warm-up round's first), those of the steps :func:`time_alternately`
    with ``block`` kept as its ``samples`` (a count): the last rounds'
    steps, less the first of each turn where ``block`` > 1."""
    if block == 1:
        return entries[len(entries) - samples:]
    steps = samples // (block - 1) * block
    return [e for i, e in enumerate(entries[len(entries) - steps:])
            if i % block]


def peak_memory(variants, tracker, rounds):
    """Median over ``rounds`` of each variant's peak bytes during a step,
    less the bytes held before it (no timing is taken: tracing is slow).

    Returns:
        dict: label -> median peak bytes.

    """
    peaks = {v.label: [] for v in variants}
    with tracker:
        for v in variants:  # what was allocated before tracing is untracked
            v.step()
        for _ in range(rounds):
            for v in variants:
                _prepare(v)
                before = tracker.reset()
                v.step()
                peaks[v.label].append(tracker.peak() - before)
    return {label: statistics.median(p) for label, p in peaks.items()}


class HostPeak(object):

    """Peak traced bytes (Python objects and NumPy arrays) via tracemalloc."""

    def __enter__(self):
        tracemalloc.start()
        return self

    def __exit__(self, *args):
        tracemalloc.stop()

    def reset(self):
        tracemalloc.reset_peak()
        return tracemalloc.get_traced_memory()[0]

    def peak(self):
        return tracemalloc.get_traced_memory()[1]


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 on ``os.devnull``: Kineto writes a line there at
    every start and stop of ``torch.profiler``."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, 'w') as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class TorchCpuPeak(object):

    """Peak bytes PyTorch's CPU allocator handed out between :meth:`reset`
    and :meth:`peak` above those live at :meth:`reset` (the CPU's
    :class:`TorchCudaPeak`): the running sum, in time order, of the
    allocations (+) and frees (-) that ``torch.profiler`` records with
    ``profile_memory=True``, its ``[memory]`` events, read from the
    profiler's raw results (its parsed ``events()`` fold those inside an
    operator into the operator's totals).

    The profiler runs from ``__enter__`` to ``__exit__``, restarted at each
    :meth:`reset` and :meth:`peak`: the allocator learns a block's size at
    its allocation only while profiling, and a free of a block it did not
    learn goes unrecorded (what was allocated before ``__enter__``). The
    profiler records the thread that runs the step, where a CPU backward
    runs too."""

    # Where torch.profiler files CPU memory (as its own summaries do).
    DEVICES = ('CPU', 'MKLDNN', 'IDEEP')

    def __init__(self):
        import torch.autograd
        import torch.profiler
        self.profiler = torch.profiler
        self.devices = {getattr(torch.autograd.DeviceType, d)
                        for d in self.DEVICES}
        self.session = None

    def _restart(self, start=True):
        """Stops the running session, starts another (``start``); returns
        the stopped one's CPU memory events, ``(time, bytes)`` in time
        order."""
        events = []
        with _stderr_silenced():
            if self.session is not None:
                self.session.stop()
                events = sorted(  # stable: ties stay in record order
                    ((e.start_ns(), e.nbytes()) for e in
                     self.session.profiler.kineto_results.events()
                     if e.name() == '[memory]'
                     and e.device_type() in self.devices),
                    key=lambda event: event[0])
                self.session = None
            if start:
                self.session = self.profiler.profile(
                    activities=[self.profiler.ProfilerActivity.CPU],
                    profile_memory=True)
                self.session.start()
        return events

    def __enter__(self):
        self._restart()
        return self

    def __exit__(self, *args):
        self._restart(start=False)

    def reset(self):
        self._restart()
        return 0

    def peak(self):
        live = high = 0
        for _, nbytes in self._restart():
            live += nbytes
            high = max(high, live)
        return high


class TorchCudaPeak(object):

    """Peak bytes PyTorch's CUDA allocator handed out between
    :meth:`reset` and :meth:`peak`."""

    def __init__(self, device):
        import torch
        self.torch, self.device = torch, device

    def __enter__(self):
        return self

    def __exit__(self, *args):
        pass

    def reset(self):
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)
        return self.torch.cuda.memory_allocated(self.device)

    def peak(self):
        self.torch.cuda.synchronize(self.device)
        return self.torch.cuda.max_memory_allocated(self.device)


class CupyPeak(object):

    """Peak bytes held from CuPy's memory pool (its allocations, not the
    pool's cached blocks) between :meth:`reset` and :meth:`peak`."""

    def __init__(self):
        import cupy

        class Hook(cupy.cuda.MemoryHook):
            name = 'BenchmarkPeak'

            def __init__(self):
                self.current = self.high = 0

            # CuPy passes keyword arguments; mem_size is the pool block.
            def malloc_postprocess(self, **kwargs):
                self.current += kwargs['mem_size']
                self.high = max(self.high, self.current)

            def free_postprocess(self, **kwargs):
                self.current -= kwargs['mem_size']

        self.hook = Hook()

    def __enter__(self):
        self.hook.__enter__()
        return self

    def __exit__(self, *args):
        self.hook.__exit__(*args)

    def reset(self):
        self.hook.high = self.hook.current
        return self.hook.current

    def peak(self):
        return self.hook.high


class SectionTimes(object):

    """Seconds and calls per section: the timer a hook's timed calls fill
    (:class:`TimedCalls`; any object with ``add`` will do).

    Args:
        clock (callable): What the hook reads the time with.

    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds = collections.Counter()
        self.calls = collections.Counter()

    def add(self, section, seconds):
        self.seconds[section] += seconds
        self.calls[section] += 1


class TimedCalls(object):

    """Wraps callables so that each call adds its *own* seconds (less
    those of the timed calls inside it) to a timer's section.

    Args:
        timer: An object with ``add(section, seconds)`` and optionally a
            ``clock`` (else ``time.perf_counter``), e.g. a
            :class:`SectionTimes`.

    """

    def __init__(self, timer):
        self.add = timer.add
        self.clock = getattr(timer, 'clock', time.perf_counter)
        self.inner = [0.0]  # per open timed call: its timed calls' seconds

    def wrap(self, section, fn):
        """``fn`` timed (``section`` None: its time is only subtracted from
        the timed call around it)."""
        add, clock, inner = self.add, self.clock, self.inner

        def timed(*args, **kwargs):
            inner.append(0.0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = clock() - start
                own = seconds - inner.pop()
                inner[-1] += seconds
                if section is not None:
                    add(section, own)
        return timed


def ratios(series, baseline, clock='cpu'):
    """Per-round ratios of two lists of :class:`Sample` taken in the same
    rounds (load that drifts between rounds cancels)."""
    return [getattr(a, clock) / getattr(b, clock)
            for a, b in zip(series, baseline)]


def amortised(refresh, cached, k):
    """Per round, a refresh every ``k`` steps: ``(t_refresh + (k - 1)
    t_cached) / k`` from the timed refresh and cached passes."""
    return [Sample((r.wall + (k - 1) * c.wall) / k,
                   (r.cpu + (k - 1) * c.cpu) / k)
            for r, c in zip(refresh, cached)]


def quartiles(values):
    """(first, third) quartile: the spread of a ratio over the rounds."""
    values = list(values)
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method='inclusive')
    return q[0], q[2]


class BlasThreads(object):

    """Limits BLAS to ``n`` threads (threadpoolctl) inside a ``with``, and
    PyTorch's own thread pool (``torch.set_num_threads``) where PyTorch is
    installed; ``n`` 0 leaves the library default. :attr:`description`
    says which.

    Restored on exit: a caller that goes on in the same process (a test)
    must get its thread count back, since it changes float results.
    """

    def __init__(self, n):
        self.n = n
        self.limiter = None
        self.torch_threads = None
        self.description = 'library default'

    def __enter__(self):
        if self.n and importlib.util.find_spec('torch') is not None:
            import torch
            self.torch_threads = torch.get_num_threads()
            torch.set_num_threads(self.n)
        if self.n:
            try:
                import threadpoolctl
            except ImportError:
                self.description = ('library default (threadpoolctl is not '
                                    'installed)')
                return self
            self.limiter = threadpoolctl.threadpool_limits(
                limits=self.n, user_api='blas')
            self.description = '{} (threadpoolctl{})'.format(
                self.n, '; PyTorch\'s too' if self.torch_threads else '')
        return self

    def __exit__(self, *args):
        # In the reverse order of __enter__: threadpoolctl's originals were
        # read after PyTorch's pool was limited, and PyTorch's BLAS may be
        # one of the libraries it restores.
        if self.limiter is not None:
            self.limiter.restore_original_limits()
            self.limiter = None
        if self.torch_threads is not None:
            import torch
            torch.set_num_threads(self.torch_threads)
            self.torch_threads = None
