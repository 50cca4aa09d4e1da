"""Block-scaled training simulated on an FP32 PyTorch model: MXFP8, FP8
tiles, NVFP4.

The twin of the Chainer adapter's :class:`~gradient_scaling.chainer.
block_simulation.BlockScaledSimulation`, with its semantics: inside ``with
sim:``, each GEMM (``F.linear``, ``conv1d/2d/3d``,
``conv_transpose1d/2d/3d``) reads its operands as a :class:`~gradient_
scaling.core.block_formats_recipes.BlockScalingRecipe` stores them, each
along the axis that GEMM sums over, from the FP32 values: the forward
``y = x W`` reads x and W blocked along the input channels (and the
kernel), the data gradient ``gx = gy W`` reads gy and W along the output
channels (and the kernel), the weight gradient ``gW = gy x`` reads gy and
x along the batch and the pixels.

The GEMM outputs (y, gx, gW) and the bias and its gradient stay FP32, and
every scaling method meets the same forward storage. The storing is the
core's (:meth:`BlockScalingRecipe.store <gradient_scaling.core.
block_formats_recipes.BlockScalingRecipe.store>`, the function the Chainer
adapter calls), on NumPy views of the tensors: a CUDA tensor is copied to
the host and back, so a block simulation on a GPU is correct but slow (the
core computes on NumPy or CuPy, not on torch tensors). A linear layer's
input of more than two dimensions is stored as the matrix ``(-1,
in_features)``, the one Chainer's ``F.linear`` reads.

The GEMMs are intercepted as :mod:`gradient_scaling.torch.simulation`'s
are (:class:`~gradient_scaling.torch.simulation.GemmSimulation`), and the
backward node is a GEMM site of the gradient-scaling hook that scales its
own paths (:class:`~gradient_scaling.torch.simulation.SimulatedGemmSite`):
the hook hands it the data path's scale ``beta`` and the weight path's
``gamma`` (``node.gradient_scales``), the data GEMM reads gy scaled by
``beta``, the weight GEMM gy scaled by ``gamma``, each stored after its
scale is applied, data first, as the Chainer simulation under GS stores
them. (In an FP32 model the hook's scales are exact powers of two.) NVFP4's
per-tensor scale of a gradient is the recipe's own (``2688 / amax``)
unless ``gradient_tensor_scale`` says a scaler chose it (GS:
:attr:`~gradient_scaling.core.block_formats_recipes.BlockScalingRecipe.
gradient_tensor_scale`). Stochastic rounding of gradients (NVFP4) draws
from one NumPy generator (:class:`RoundingGenerator`), seeded as the
Chainer simulation's on NumPy, so both draw the same numbers; its state is
:meth:`BlockScaledSimulation.state_dict`.

.. admonition:: Example

    >>> import torch
    >>> from gradient_scaling.torch.block_simulation import \\
    ...     BlockScaledSimulation
    >>> lin = torch.nn.Linear(64, 2)
    >>> with BlockScaledSimulation('mxfp8-e4m3', seed=0):
    ...     lin(torch.ones(4, 64)).sum().backward()

"""

import numpy
import torch

from gradient_scaling.core import block_formats_recipes
from gradient_scaling.torch.simulation import backward_inputs
from gradient_scaling.torch.simulation import GemmSimulation
from gradient_scaling.torch.simulation import gemm_gradients
from gradient_scaling.torch.simulation import keep_for_backward

__all__ = ['BlockScaledSimulation', 'RoundingGenerator']

# The simulation's GEMM kinds -> the core's.
_KINDS = {'linear': 'convolution', 'conv': 'convolution',
          'deconv': 'deconvolution'}
# The operand name a stored gradient is counted under, per GEMM.
_COUNTED = {'dgrad': 'gy', 'wgrad': 'gy_wgrad'}


class BlockScaledSimulation(GemmSimulation):

    """Simulates a block-scaling recipe on an FP32 model (module docstring).

    Args:
        recipe: A :class:`~gradient_scaling.core.block_formats_recipes.
            BlockScalingRecipe` or its name.
        gradient_tensor_scale (float): NVFP4's per-tensor encode scale of
            the gradients, when a scaler has scaled them; None: the
            recipe's own (from each gradient's amax).
        seed (int): Of :class:`RoundingGenerator`.
        measure_underflow (bool): Count per GEMM what the stored gradients
            lost, as the Chainer simulation counts it: under ``'gy'``
            (read by dgrad) and ``'gy_wgrad'`` (wgrad's copy) the values
            that became zeros and those flushed beside a larger value of
            their block; and the scale bits of every stored operand.
        model (torch.nn.Module): Names the GEMMs by their weight.

    """

    def __init__(self, recipe, gradient_tensor_scale=None, seed=None,
                 measure_underflow=False, model=None):
        super().__init__(measure_underflow, model)
        self.recipe = block_formats_recipes.get(recipe)
        self.gradient_tensor_scale = gradient_tensor_scale
        self.generator = RoundingGenerator(
            seed, draw=self.recipe.gradient_rounding == 'stochastic')

    def gemm(self, config, x, weight, bias):
        return BlockScaledGemm.apply(config, x, weight, bias)

    def store(self, tensor, config, gemm, operand, counted=False):
        """``operand`` of the ``gemm`` GEMM of ``config`` as the recipe
        stores it (a new tensor, ``tensor``'s shape, dtype and device);
        ``counted``: a gradient whose lost values are counted."""
        gradient = operand == 'gy'
        array = _host_array(tensor, config.kind)
        stochastic = gradient and self.recipe.gradient_rounding == \
            'stochastic'
        count = counted and self.measure_underflow
        stored = self.recipe.store(
            array, _KINDS[config.kind], gemm, operand,
            rng=self.generator.numpy if stochastic else None,
            tensor_scale=self.gradient_tensor_scale if gradient else None,
            count=count)
        if self.measure_underflow:
            self.counts.stored(array.size, stored.scale_bits)
        if count:
            lost = stored.lost
            self.counts.add(self.site_name(config.weight), _COUNTED[gemm],
                            lost.nonzero, lost.lost, lost.flushed_in_blocks)
        return torch.from_numpy(numpy.ascontiguousarray(
            stored.values)).reshape(tensor.shape).to(tensor.device)

    def state_dict(self):
        """The stochastic rounding's state (plain Python values)."""
        return self.generator.state_dict()

    def load_state_dict(self, state):
        self.generator.load_state_dict(state)


def _host_array(tensor, kind):
    """A NumPy view (a copy for a CUDA tensor) of an operand, a linear
    layer's as a matrix."""
    array = tensor.detach().cpu().numpy()
    return array.reshape(-1, array.shape[-1]) if kind == 'linear' \
        else array


class BlockScaledGemm(torch.autograd.Function):

    """A GEMM and its two backward GEMMs, each in FP32 on the operands the
    recipe stores for it (see the module)."""

    @staticmethod
    def forward(ctx, config, x, weight, bias):
        sim = config.sim
        keep_for_backward(ctx, config, bias, x, weight)  # FP32 x and W
        return config.func(sim.store(x, config, 'forward', 'x'),
                           sim.store(weight, config, 'forward', 'W'), bias,
                           **config.options)

    @staticmethod
    def backward(ctx, g):
        # Each backward GEMM stores its own copies of the FP32 operands.
        config, sim, (x, w), scales = backward_inputs(ctx)
        grads = [None, None, None]
        if 0 in scales:
            wd = sim.store(w, config, 'dgrad', 'W')
            gy = sim.store(_scaled(g, scales[0]), config, 'dgrad', 'gy', True)
            grads[0], = gemm_gradients(config, x, wd, gy, [0])
        if 1 in scales:
            xw = sim.store(x, config, 'wgrad', 'x')
            gy = sim.store(_scaled(g, scales[1]), config, 'wgrad', 'gy', True)
            grads[1], = gemm_gradients(config, xw, w, gy, [1])
        if 2 in scales:  # the bias gradient: FP32, from the FP32 gy
            grads[2], = gemm_gradients(config, x, w, _scaled(g, scales[2]),
                                       [2])
        return (None,) + tuple(grads)


def _scaled(g, scale):
    return g if scale == 1.0 else g * scale


class RoundingGenerator(object):

    """The NumPy generator of a simulation's stochastic rounding, saved in
    snapshots: ``numpy.random.default_rng(seed)``, the generator the Chainer
    simulation's :class:`~gradient_scaling.chainer.simulation.
    RoundingGenerators` makes for NumPy arrays, so both draw alike.

    Args:
        seed (int): None with ``draw``: one drawn from NumPy's global
            generator (the Chainer simulation's rule); without ``draw``
            (nothing will be rounded stochastically) it stays None.
        draw (bool): See ``seed``.

    """

    def __init__(self, seed=None, draw=True):
        self.seed = int(numpy.random.randint(2 ** 31)) \
            if seed is None and draw else seed
        self.numpy = numpy.random.default_rng(self.seed)

    def state_dict(self):
        """``{'seed', 'bit_generator'}``: Python ints, strings and dicts,
        which ``torch.load(weights_only=True)`` reads back."""
        return {'seed': self.seed,
                'bit_generator': self.numpy.bit_generator.state}

    def load_state_dict(self, state):
        """Continues where ``state``'s generator stopped."""
        self.seed = state['seed']
        self.numpy = numpy.random.default_rng(self.seed)
        self.numpy.bit_generator.state = state['bit_generator']
