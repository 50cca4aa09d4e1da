"""GPU checks of the PyTorch adapter: the device, GS against GradScaler, the
statistics on the device.

Run by scripts/gpu_check.sh, one command per step:

* ``info``: versions and the device; exits 77 (the script's "skipped")
  when this PyTorch has no CUDA;
* ``statistics``: :class:`~gradient_scaling.torch.arrays.TorchOps` on a CUDA
  tensor (spread, maximum, the log-moments of Theorem 2, the underflow
  rate, float32 subnormals included), computed where the tensor lives,
  against the NumPy statistics of the same values;
* ``compare``: a CIFAR ResNet-20 trained under CUDA autocast float16 with
  :class:`~gradient_scaling.torch.GradientScaler` (GS) and with
  ``torch.amp.GradScaler`` from the same weights and batches: both finite,
  their losses close, and the per-site scales powers of two; ms/iteration
  of each;
* ``compiled``: the same ResNet-20 under ``torch.compile`` with GS's
  backend (:func:`~gradient_scaling.torch.compile_backend`, Inductor) and
  in eager GS, from the same weights and batches: every site the eager
  hook scales is scaled inside the compiled graph, the first refresh's
  scales within one power of two of eager GS's (Inductor's kernels round
  differently from eager ones), the losses close; ms/iteration of
  compiled GS against compiled ``torch.amp.GradScaler``.

Prints what it measured; exits non-zero on any failure.
"""

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from gradient_scaling.core import arrays
from gradient_scaling.core import statistics
from gradient_scaling.torch import GradientScaler
from gradient_scaling.torch import compile_backend
from gradient_scaling.torch import arrays as torch_arrays  # NOQA: registers

import torch_models

#: gpu_check.sh's code for a step that cannot run here (not a failure of
#: the code checked).
SKIPPED = 77


def _synchronize(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def _allocated(device):
    return torch.cuda.memory_allocated(device) if device.type == 'cuda' \
        else 0


def info(device):
    print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python',
          sys.version.split()[0])
    if not torch.cuda.is_available():
        print('skipped: this PyTorch has no CUDA (torch.cuda.is_available() '
              'is False)')
        return SKIPPED
    props = torch.cuda.get_device_properties(device)
    print('device {}: {}, {} multiprocessors, {:.0f} GiB'.format(
        device, props.name, props.multi_processor_count,
        props.total_memory / 2 ** 30))
    from gradient_scaling.torch import native
    start = time.perf_counter()
    built = native.module()
    print('native callbacks: {} ({:.0f} s)'.format(
        'loaded' if built is not None else
        'the Python ones: ' + native.reason(), time.perf_counter() - start))
    return 0


def gradient_like(device, n=2 ** 22):
    """Softmax-like float32 gradient values, some of them subnormal."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.exp(torch.randn(n, device=device, generator=g) * 6 - 20)
    x[::1024] *= 2.0 ** -110  # below float32's normal range (CuPy's FTZ)
    return x * torch.sign(torch.randn(n, device=device, generator=g))


def statistics_check(device):
    x = gradient_like(device)
    reference = x.cpu().numpy()
    ops = arrays.ops_for(x)
    assert ops.name == 'torch', ops.name
    before = _allocated(device)
    _synchronize(device)
    start = time.perf_counter()
    std, largest = ops.spread_and_max(x, sample=False)
    logs = ops.log_statistics(x)
    rate = ops.underflow_rate(x, 'float16')
    _synchronize(device)
    seconds = time.perf_counter() - start
    expected = statistics.tensor_statistics(reference, log=True)
    checks = {
        'std': (std, expected.std), 'max': (largest, expected.max_abs),
        'log_mean': (logs.log_mean, expected.log_mean),
        'log_std': (logs.log_std, expected.log_std),
        'underflow_rate': (rate, arrays.measured_underflow_rate(reference,
                                                                'float16'))}
    for name, (ours, theirs) in checks.items():
        print('{}: device {:.9g}, NumPy {:.9g}'.format(name, ours, theirs))
        assert math.isclose(ours, theirs, rel_tol=1e-5), name
    subnormal = int(((reference != 0) & (np.abs(reference) <
                                         np.finfo(np.float32).tiny)).sum())
    print('statistics on the device: {} values ({} subnormal float32) in '
          '{:.2f} ms; {} bytes left allocated'.format(
              x.numel(), subnormal, 1e3 * seconds,
              _allocated(device) - before))
    assert subnormal > 0
    return 0


def train(device, scaler_of, steps, batches, dtype, compiled=None):
    """``steps`` steps of ResNet-20; ``compiled``: ``torch.compile`` the
    model with ``compiled(scaler)`` as its backend."""
    torch.manual_seed(0)
    model = torch_models.resnet20(10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = scaler_of(model)
    if compiled is not None:
        model = torch.compile(model, backend=compiled(scaler))
    first_sites = None
    losses = []
    for step in range(steps):
        if step == 5:  # after the first refreshes and kernel choices
            _synchronize(device)
            start = time.perf_counter()
        x, t = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(model(x).float(), t)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss.detach()))
        if first_sites is None and hasattr(scaler, 'site_scales'):
            first_sites = scaler.site_scales()
    _synchronize(device)
    ms = 1e3 * (time.perf_counter() - start) / (steps - 5)
    scaler.first_sites = first_sites
    return losses, ms, scaler


def compare(device, steps=60, batch=64, dtype=torch.float16):
    g = torch.Generator(device=device).manual_seed(1)
    batches = [(torch.randn(batch, 3, 32, 32, device=device, generator=g),
                torch.randint(0, 10, (batch,), device=device, generator=g))
               for _ in range(4)]
    results = {}
    for name, scaler_of in (
            ('gs', lambda m: GradientScaler(m, 'gs', update_interval=10)),
            ('torch.amp.GradScaler', lambda m: torch.amp.GradScaler(
                device.type))):
        losses, ms, scaler = train(device, scaler_of, steps, batches, dtype)
        results[name] = losses
        print('{}: loss {:.4f} -> {:.4f}, {:.2f} ms/iter, scale(s) {}'.format(
            name, losses[0], losses[-1], ms, _scale_text(scaler)))
        assert all(math.isfinite(v) for v in losses[1:]), name
        if name == 'gs':
            sites = scaler.site_scales()
            assert sites and all(math.frexp(s)[0] == 0.5
                                 for s in sites.values()), sites
    gs, reference = results['gs'], results['torch.amp.GradScaler']
    # Four batches seen again and again: both fit them; the losses of the
    # last pass within a tenth of the first loss of each other.
    final = np.mean(gs[-4:]), np.mean(reference[-4:])
    print('final losses: gs {:.4f}, GradScaler {:.4f} (gap {:.4f})'.format(
        final[0], final[1], abs(final[0] - final[1])))
    assert final[0] < 0.5 * gs[0] and abs(final[0] - final[1]) < 0.1 * gs[0]
    return 0


def compiled_check(device, steps=30, batch=64, dtype=torch.float16,
                   inner='inductor'):
    g = torch.Generator(device=device).manual_seed(1)
    batches = [(torch.randn(batch, 3, 32, 32, device=device, generator=g),
                torch.randint(0, 10, (batch,), device=device, generator=g))
               for _ in range(4)]

    def gs(model):
        return GradientScaler(model, 'gs', update_interval=10)

    def gradscaler(model):
        return torch.amp.GradScaler(device.type)

    def with_gs_backend(scaler):
        return compile_backend(scaler, inner=inner)
    runs = {}
    for name, scaler_of, compiled in (
            ('eager gs', gs, None),
            ('compiled gs', gs, with_gs_backend),
            ('compiled GradScaler', gradscaler, lambda scaler: inner)):
        start = time.perf_counter()
        losses, ms, scaler = train(device, scaler_of, steps, batches, dtype,
                                   compiled)
        runs[name] = losses, ms, scaler
        print('{}: loss {:.4f} -> {:.4f}, {:.2f} ms/iter ({:.0f} s with '
              'compilation), scale(s) {}'.format(
                  name, losses[0], losses[-1], ms,
                  time.perf_counter() - start, _scale_text(scaler)))
        assert all(math.isfinite(v) for v in losses[1:]), name
    eager = runs['eager gs'][2].first_sites
    compiled = runs['compiled gs'][2].first_sites
    assert set(compiled) == set(eager), sorted(
        set(compiled) ^ set(eager))
    apart = {k: abs(math.log2(compiled[k]) - math.log2(eager[k]))
             for k in eager}
    print('first refresh: {} sites, {} with the eager scale, at most {:g} '
          'power(s) of two apart'.format(
              len(apart), sum(1 for v in apart.values() if v == 0),
              max(apart.values())))
    assert max(apart.values()) <= 1, apart
    final = [np.mean(runs[name][0][-4:]) for name in ('eager gs',
                                                        'compiled gs')]
    assert abs(final[0] - final[1]) < 0.1 * runs['eager gs'][0][0], final
    ratio = runs['compiled gs'][1] / runs['compiled GradScaler'][1]
    print('compiled gs / compiled GradScaler: {:.3f} (ms/iter, after the '
          'first 5 steps; refresh every 10)'.format(ratio))
    return 0


def _scale_text(scaler):
    sites = getattr(scaler, 'site_scales', None)  # GradScaler has none
    scale = (sites() if sites else None) or scaler.get_scale()
    if isinstance(scale, dict):
        logs = sorted(math.log2(s) for s in scale.values())
        return '{} sites, log2 {:g} .. {:g}'.format(len(logs), logs[0],
                                                   logs[-1])
    return '{:g}'.format(scale)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('command', choices=('info', 'statistics', 'compare',
                                            'compiled'))
    parser.add_argument('--gpu', type=int, default=0)
    parser.add_argument('--cpu', action='store_true',
                        help='run on the CPU (the tests: the same checks, '
                        'slower, smaller)')
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--batch', type=int, default=64)
    parser.add_argument('--dtype', choices=('float16', 'bfloat16'),
                        default='float16', help="compare: autocast's")
    parser.add_argument('--inner', choices=('inductor', 'aot_eager'),
                        default='inductor', help='compiled: what compiles '
                        'the rewritten graphs')
    args = parser.parse_args(argv)
    if args.cpu:
        device = torch.device('cpu')
    elif not torch.cuda.is_available():
        return info(None) if args.command == 'info' else (
            print('skipped: this PyTorch has no CUDA') or SKIPPED)
    else:
        device = torch.device('cuda', args.gpu)
    if args.command == 'compare':
        return compare(device, args.steps, args.batch,
                       getattr(torch, args.dtype))
    if args.command == 'compiled':
        return compiled_check(device, args.steps, args.batch,
                              getattr(torch, args.dtype), args.inner)
    return {'info': info, 'statistics': statistics_check}[args.command](
        device)


if __name__ == '__main__':
    sys.exit(main())
