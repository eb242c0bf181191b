"""Quantized moments: a rule's running averages stored in 8 or 4 bits a number, blockwise.

`Quantized(bits, block)` is a storage format, given where a rule takes a storage dtype (`mu_dtype`, `nu_dtype`;
see `optim._rules.moments`). A moment stored so is a `QuantizedArray`: the parameter flattened, cut into blocks
of `block` numbers (the last one padded), each block stored as one float32 scale, its largest magnitude, and one
code of `bits` bits per number for the number divided by the scale. A step reads the codes back to float32
(`dequantize`), updates the moment in float32 and stores the new one as codes again (`quantize`), inside the one
compiled step; nothing float32 of the parameter's size is kept between steps.

The code maps are log-linear ("dynamic exponent", as in Dettmers et al. 2021 and Li et al. 2023): a code is an
exponent and `M` mantissa bits, so its numbers are spaced by a constant ratio across binades, linearly within
one, and the largest is 1 (the block's maximum is stored exactly). A float32's bit pattern is such a code with
`M = 23`, so encoding is the bit pattern rounded to `M` bits (round to nearest within a binade) and decoding
shifts it back: no table, no search, a few integer operations a number.

- First moments (signed: `mu`): a sign bit, then `bits - 1` magnitude bits whose code 0 is exactly 0 (a moment
  that changes sign passes through it) and codes 1 ... `2^(bits-1) - 1` the log-linear numbers up to 1.
- Second moments (unsigned, `nu`: averages of `|g|²`): `bits` magnitude bits, all log-linear, and no code for 0:
  a number below the smallest code is stored as the smallest code. The step divides by `√v`, so a `v` rounded to
  0 would make a step of `m / ε`; rounded up, it makes a smaller step (Li et al. 2023's "zero-point problem").
- `M` per format (`MANTISSA`), chosen with `bench/lowmem.py`: 8 bits, 3 mantissa bits, both moments (the
  smallest code, relative to the block's largest number: signed 1.25·2⁻¹⁶ ≈ 1.9e-5, unsigned 1.125·2⁻³²
  ≈ 2.6e-10; a number in range is stored within 6.25% of its value); 4 bits, 1 mantissa bit (signed 1/8,
  unsigned 1.5·2⁻⁸ ≈ 1/171).

A block shares its scale, so a non-finite number reaches its neighbours. A finite gradient of 1e30 overflows
`|g|²` to inf: in float32 that element's `v` stays inf and the element stops for good; stored in blocks, the
scale is inf and the block's 255 (q8) or 127 (q4) other numbers of `v` read back as inf too, so they stop
with it. This is kept (decided, not an oversight): storing inf as the block's largest finite number instead
would let the element itself take steps of `m / √v` with `m` ~ 1e29, and a scale of the largest float32 stops
the neighbours as surely (their `v` is stored as at least its smallest code times that scale). An element
clip before the rule (`chain(ClipGrad(δ), AdamW(..., nu_dtype=q8))`) keeps `|g|²` finite and nothing stops;
`SkipNonFinite` does not see a finite gradient whose square overflows.

Parameters with fewer than `Quantized.min_size` (4096) numbers keep their moments unquantised, in the dtype the
rule's default gives them (biases, norms' gains: a few per cent of a model's numbers, where a block's scale
would cost as much as the codes save). A complex parameter of that size cannot be stored so: `setup` raises a
`ValueError` naming it.

References: T. Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2021,
https://arxiv.org/abs/2110.02861; B. Li et al., "Memory Efficient Optimizers with 4-bit States", 2023,
https://arxiv.org/abs/2309.01507
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._base.export import register_for_export

__all__ = ["Quantized", "QuantizedArray", "q8", "q4", "quantize", "MANTISSA"]

# Mantissa bits of the code maps, per (bits, signed).
MANTISSA = {(8, True): 3, (8, False): 3, (4, True): 1, (4, False): 1}
_ONE = 0x3F800000       # float32 1.0's bit pattern


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A moment's storage format: blockwise `bits`-bit codes with one float32 scale per `block` numbers.

    `bits` is 4 or 8; `block` a positive multiple of 32. State bytes per parameter, per moment: `bits / 8 +
    4 / block` (`q8`: 1.016, `q4`: 0.531; float32: 4). Give it as a rule's `mu_dtype` / `nu_dtype`:

    >>> import jax.numpy as jnp, optim
    >>> rule = optim.AdamW(1e-3, mu_dtype=optim.q8, nu_dtype=optim.q4)
    >>> state = optim.setup(rule, {"w": jnp.ones((256, 256)), "b": jnp.ones(256)})
    >>> # "b" (256 numbers) keeps float32 moments
    >>> optim.state_bytes(state) < 256 * 256 * 1.6
    True
    """

    bits: int = 8
    block: int = 256
    min_size: ClassVar[int] = 4096      # parameters with fewer numbers keep unquantised moments

    def __post_init__(self):
        for name, ok, want in (("bits", lambda b: b in (4, 8), "4 or 8"),
                               ("block", lambda b: b > 0 and b % 32 == 0, "a positive multiple of 32")):
            v = getattr(self, name)
            try:
                i = operator.index(v)
            except TypeError:
                i = None
            if i is None or isinstance(v, bool) or not ok(i):
                raise ValueError(f"Quantized: {name} must be {want}, got {v!r}")
            object.__setattr__(self, name, int(i))

    def __repr__(self) -> str:
        return f"Quantized(bits={self.bits}, block={self.block})"


q8 = Quantized(8, 256)
q4 = Quantized(4, 128)


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A moment stored as `Quantized` codes: `codes` (uint8, `(..., blocks, block * bits / 8)`, two 4-bit codes
    a byte) and `scale` (float32, `(..., blocks)`) are its leaves; the format, the map (`signed`) and the
    parameter's shape are static. Leading axes (a stack of parameters) are kept. `dequantize()` gives the
    float32 numbers in the parameter's shape."""

    codes: jax.Array
    scale: jax.Array
    fmt: Quantized
    signed: bool
    param_shape: tuple

    def dequantize(self) -> jax.Array:
        """The stored numbers, float32, shaped `(..., *param_shape)`."""
        lead = jnp.shape(self.scale)[:-1]
        c = jnp.asarray(self.codes).astype(jnp.int32)
        if self.fmt.bits == 4:
            c = jnp.stack([c & 15, c >> 4], axis=-1).reshape(*c.shape[:-1], -1)
        y = _decode(c, self.fmt.bits, self.signed) * jnp.asarray(self.scale)[..., None]
        n = math.prod(self.param_shape)
        return y.reshape(*lead, -1)[..., :n].reshape(*lead, *self.param_shape)


jax.tree_util.register_dataclass(QuantizedArray, data_fields=["codes", "scale"],
                                 meta_fields=["fmt", "signed", "param_shape"])
register_for_export(QuantizedArray)


def quantize(v: jax.Array, fmt: Quantized, signed: bool) -> QuantizedArray:
    """`v` (real, shaped like the parameter) stored in `fmt`, with the signed or the unsigned map."""
    v = jnp.asarray(v, jnp.float32)
    n, nb = v.size, -(-v.size // fmt.block)
    blocks = jnp.pad(v.reshape(-1), (0, nb * fmt.block - n)).reshape(nb, fmt.block)
    scale = jnp.max(jnp.abs(blocks), axis=-1)
    # A multiplication by the reciprocal, not a division per number (a few times slower on a CPU): the block's
    # largest number then comes within an ulp of 1 and still takes the top code, 1. A block of zeros stores
    # zeros (scale 0).
    y = blocks * jnp.where(scale > 0, 1 / jnp.where(scale > 0, scale, 1), 0)[:, None]
    c = _encode(y, fmt.bits, signed)
    if fmt.bits == 4:
        c = c.reshape(nb, fmt.block // 2, 2)
        c = c[..., 0] | (c[..., 1] << 4)
    return QuantizedArray(c.astype(jnp.uint8), scale, fmt, bool(signed), tuple(v.shape))


def _map(bits: int, signed: bool) -> tuple[int, int, int]:
    """(shift, top magnitude code, bit pattern of magnitude code 0's place): magnitude code `c` is the float32
    with bit pattern `base + (c << shift)`, so the top code is 1.0."""
    shift = 23 - MANTISSA[bits, signed]
    top = (1 << (bits - signed)) - 1
    return shift, top, _ONE - (top << shift)


def _encode(y: jax.Array, bits: int, signed: bool) -> jax.Array:
    # Every integer is int32, constants included: with jax_enable_x64 a Python int is int64, and XLA:CPU's
    # compile of an int32 | int64 crashed the process.
    shift, top, base = _map(bits, signed)
    i32 = lambda v: jnp.asarray(v, jnp.int32)   # noqa: E731
    a = jnp.abs(y) if signed else y
    b = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
    c = (b - i32(base) + i32(1 << (shift - 1))) >> i32(shift)     # the bit pattern rounded to the code's bits
    if not signed:
        return jnp.clip(c, i32(0), i32(top))
    smallest = float(np.array(base + (1 << shift), np.int32).view(np.float32))
    mag = jnp.where(a < smallest / 2, i32(0), jnp.clip(c, i32(1), i32(top)))
    return mag | jnp.where(y < 0, i32(1 << (bits - 1)), i32(0))


def _decode(c: jax.Array, bits: int, signed: bool) -> jax.Array:
    shift, top, base = _map(bits, signed)
    i32 = lambda v: jnp.asarray(v, jnp.int32)   # noqa: E731
    mag = c & i32(top)
    y = jax.lax.bitcast_convert_type(i32(base) + (mag << i32(shift)), jnp.float32)
    if not signed:
        return y
    y = jnp.where(mag == 0, jnp.float32(0), y)
    return jnp.where(c > i32(top), -y, y)
