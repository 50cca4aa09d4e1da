"""How a block format's scales follow from its blocks' maxima.

:func:`block_scales` gives, per block, the encode scale (elements are ``x *
encode`` rounded to the element format) and the decode scale (values are
``element * decode``), NaN for a scale that overflows. The rules, per scale
format (``amax`` a block's largest finite magnitude; ``fl32`` one float32
rounding, as the kernels compute):

* ``'float8_e8m0'`` (MX; spec v1.0 section 6.3, microsoft/microxcaling
  ``mx_ops._quantize_mx``): the decode scale is ``2**E``. ``'floor'``:
  ``E = floor(log2(amax)) - emax_elem`` (emax_elem = 8 for E4M3, 15 for
  E5M2), raised to -127 when below; an all-zero block gets ``E = -127``
  (E8M0 code 0, as microxcaling's ``log2(FP32_MIN_NORMAL)`` and
  Transformer Engine's ``float_to_e8m0(0)`` give); ``E > 127`` (only
  float64 inputs) is the NaN scale. ``'ceil'`` (Transformer Engine
  ``quantize_mxfp8.cuh``: ``ptx::float_to_e8m0(amax *
  Quantized_Limits<OType>::max_norm_rcp)``): ``t = fl32(fl32(amax) *
  fl32(1 / max_elem))``, ``E = ceil(log2(t))`` clamped to [-127, 127]
  (``cvt.rp.satfinite.ue8m0x2.f32``), ``t = 0`` giving -127. For normal
  ``t`` this is exactly ``ceil(log2(amax / max_elem))`` (checked over
  whole binades). Elements: ``saturating_cast(x * 2**-E)``.
* ``'float32'`` (Float8BlockScaling with ``power_2_scale=True`` and its
  default ``amax_epsilon=0.0``; ``recipe_common.cuh``
  ``compute_scale_from_amax``): encode scale ``s = fl32(448 /
  fl32(amax))``, FP32 max where that overflows, then its mantissa
  cleared (the largest power of two not above it, so ``amax * s <=
  448``); ``amax == 0`` gives ``s = 1``. Elements: E4M3
  ``saturating_cast(x * s)``; decode scale ``1 / s``.
* ``'float8_e4m3'`` (NVFP4; ``core_nvfp4.cuh``,
  ``quantize_transpose_nvfp4.cuh``, ``dequantize_nvfp4.cuh`` and the
  reference ``custom_recipes/reference_nvfp4.py``), every step one
  float32 operation, ``A`` the tensor's amax, ``a`` the block's::

      S_enc = fl32(2688 / A), FP32 max if it overflows, 1 if A == 0
              (or ``tensor_scale``, rounded to float32)
      S_dec = fl32(1 / S_enc)
      sb    = e4m3_satfinite(fl32(a * fl32(S_enc * fl32(1 / 6))))
      inv   = min(fl32(1 / fl32(sb * S_dec)), FP32 max)
      q     = e2m1_satfinite(fl32(x * inv))
      value = fl32(q * fl32(fl32(sb * A) * fl32(1 / 2688)))
              (with ``tensor_scale``: fl32(q * fl32(sb * S_dec)))

  The last line is TE's dequantize kernel (``final_scale = scale * amax *
  factor_inv``); with a caller's per-tensor scale there is no amax, and
  ``sb * S_dec`` is the decode scale its quantizer inverted.

Non-finite values: a block that holds a NaN or an infinity dequantizes
to NaN in every element (the NaN scale of E8M0 and E4M3), so an overflow
stays visible to the loss scaler; block and tensor maxima are taken over
the finite values. That is the MX rule (microxcaling: NaN or Inf amax ->
NaN scale); Transformer Engine's kernels instead skip NaN in ``fmaxf``
and saturate infinities. float64 inputs are rounded exactly (one
rounding of the float64 value per element), except that TE-defined
scales are computed from block maxima rounded to float32 (a block whose
maximum overflows float32 is NaN; with the spec's floor rule, one whose
scale would exceed 2**127) and NVFP4's ``x * inv`` and ``q * scale``
are float64 products.

"""

import numpy

from gradient_scaling.core import block_formats_casts as casts

__all__ = ['block_scales', 'SCALE_BITS', 'SCALE_ROUNDINGS',
           'TENSOR_SCALE_BITS']

#: Bits of one block scale: E8M0 (MX), FP32 (Float8BlockScaling keeps
#: float32 scale_inv), E4M3 (NVFP4).
SCALE_BITS = {'float8_e8m0': 8, 'float32': 32, 'float8_e4m3': 8}
#: NVFP4's per-tensor scale: one more FP32.
TENSOR_SCALE_BITS = 32
#: Scale format -> the roundings of its scale that are defined here.
SCALE_ROUNDINGS = {'float8_e8m0': ('floor', 'ceil'), 'float32': ('ceil',),
                   'float8_e4m3': ('nearest',)}


def block_scales(xp, fmt, amax, tensor_scale):
    """(encode, decode) of every block of ``fmt`` (a
    :class:`~gradient_scaling.core.block_formats.BlockFormat`), from the
    blocks' maxima ``amax`` (float64) and NVFP4's per-tensor encode scale
    (None: chosen from the tensor's amax)."""
    if fmt.scale == 'float8_e4m3':
        return _nvfp4_scales(xp, amax, tensor_scale)
    if fmt.scale == 'float32':
        exponent, valid = _pow2_exponent(xp, amax, fmt.element_format)
    elif fmt.scale_rounding == 'floor':
        exponent, valid = _mx_floor_exponent(xp, amax, fmt.element_format)
    else:
        exponent, valid = _mx_ceil_exponent(xp, amax, fmt.element_format)
    exponent = exponent.astype(numpy.int32)
    return (xp.where(valid, xp.ldexp(1.0, -exponent), numpy.nan),
            xp.where(valid, xp.ldexp(1.0, exponent), numpy.nan))


def _mx_floor_exponent(xp, amax, element_format):
    # amax = m * 2**e with 0.5 <= m < 1: floor(log2(amax)) = e - 1.
    _, e = xp.frexp(amax)
    exponent = xp.where(amax == 0, casts.E8M0_MIN_EXPONENT,
                        e - 1 - element_format.max_exponent)
    valid = exponent <= casts.E8M0_MAX_EXPONENT
    return xp.clip(exponent, casts.E8M0_MIN_EXPONENT,
                   casts.E8M0_MAX_EXPONENT), valid


def _mx_ceil_exponent(xp, amax, element_format):
    amax32 = casts.FLOAT32.quantize(amax)
    t = casts.FLOAT32.quantize(
        amax32 * casts.float32_reciprocal(element_format.max))
    m, e = xp.frexp(t)
    # ceil(log2(t)): e - 1 when t is a power of two (m == 0.5), else e.
    exponent = xp.where(t == 0, casts.E8M0_MIN_EXPONENT, e - (m == 0.5))
    return (xp.clip(exponent, casts.E8M0_MIN_EXPONENT,
                    casts.E8M0_MAX_EXPONENT),
            amax32 <= casts.FLOAT32_MAX)


def _pow2_exponent(xp, amax, element_format):
    """Exponent of the decode scale ``1 / s`` of compute_scale_from_amax."""
    amax32 = casts.FLOAT32.quantize(amax)
    s = casts.FLOAT32.quantize(element_format.max / amax32)
    s = xp.where(s > casts.FLOAT32_MAX, casts.FLOAT32_MAX, s)
    # Clearing the mantissa of s (a normal float32: s >= 448 / FP32 max)
    # leaves 2**(e - 1).
    _, e = xp.frexp(s)
    return xp.where(amax32 == 0, 0, 1 - e), amax32 <= casts.FLOAT32_MAX


def _nvfp4_scales(xp, amax, tensor_scale):
    """(inv, final) of the NVFP4 kernels, as in the module docstring."""
    f32 = casts.FLOAT32.quantize
    amax32 = f32(amax)
    # Blocks beyond float32's range (float64 inputs) are NaN and left out.
    valid = amax32 <= casts.FLOAT32_MAX
    tensor_amax = xp.max(xp.where(valid, amax32, 0.0))
    if tensor_scale is None:
        s_enc = xp.minimum(f32(2688.0 / tensor_amax), casts.FLOAT32_MAX)
        s_enc = xp.where(tensor_amax == 0, 1.0, s_enc)
    else:
        s_enc = xp.asarray(tensor_scale)
    s_dec = f32(1.0 / s_enc)
    multiplier = f32(s_enc * casts.float32_reciprocal(6.0))
    block = xp.minimum(f32(amax32 * multiplier), casts.FLOAT32_MAX)
    block = casts.saturate(casts.ELEMENTS['float8_e4m3'], block)
    inv = xp.minimum(f32(1.0 / f32(block * s_dec)), casts.FLOAT32_MAX)
    if tensor_scale is None:
        final = f32(f32(block * tensor_amax)
                    * casts.float32_reciprocal(2688.0))
    else:
        final = f32(block * s_dec)
    return inv, xp.where(valid, final, numpy.nan)
