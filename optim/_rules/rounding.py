"""StochasticRounding: a wrapper that writes a rule's float32 result back to bfloat16 / float16 parameters with
stochastic rounding, unbiased, without a master copy.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._base.export import register_for_export
from .fields import static
from .protocol import Replace, Rule, apply_all, apply_one, apply_step, average_of, is_rule
from .wrappers import MixedPrecision

__all__ = ["StochasticRounding", "StochasticRoundingState", "stochastic_round", "random_bits", "salt_of"]

# The formats rounded stochastically; wider floats (and complex) pass through to the rule.
_ROUNDED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9       # 2^32 / φ, odd: multiplying by it permutes the uint32 values
_TWEAK = 0x5A17C0DE        # mixed into the seed word (any constant; fixed, so runs stay reproducible)


@register_for_export
class StochasticRoundingState(NamedTuple):
    inner: Any           # the wrapped rule's state (made for the parameter's float32 view)
    salt: Any            # uint32, this parameter's salt (see `StochasticRounding`)
    count: Any           # int32, the number of steps taken: which random bits the next step uses


def rounds(dtype: Any) -> bool:
    """Whether parameters of `dtype` are rounded stochastically (bfloat16, float16)."""
    return jnp.dtype(dtype) in _ROUNDED


# ----------------------------------------------------------------------------------------------- bits
def _mix_py(h: int) -> int:
    """`_mix` on a Python int (for the words made from the seed and the shape at trace time)."""
    h &= _M32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _M32
    h ^= h >> 16
    return h


def _mix(h: jax.Array) -> jax.Array:
    """A bijective 32-bit integer hash (C. Wellons' "lowbias32", a MurmurHash3-style finaliser): each output bit
    depends on every input bit. uint32 arithmetic wraps."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _seed_word(seed: int) -> int:
    """The seed's 64 bits folded into one well-mixed 32-bit word."""
    return _mix_py(_mix_py((seed & _M32) ^ _TWEAK) ^ _mix_py((seed >> 32) & _M32))


def _shape_word(shape: tuple) -> int:
    h = _mix_py(len(shape) ^ _GOLDEN)
    for n in shape:
        h = _mix_py(h ^ (n & _M32))
    return h


def _index(shape: tuple) -> jax.Array:
    """Each element's flat (row-major) index as uint32, shaped like the parameter."""
    n = int(np.prod(shape, dtype=np.int64))
    return jax.lax.iota(jnp.uint32, n).reshape(shape)


def _param_bits(x: jax.Array) -> jax.Array:
    """The 16 bits of each element of a bfloat16 / float16 `x`, as uint32."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)


def salt_of(x: jax.Array) -> jax.Array:
    """A parameter's salt: a hash of its shape and of every element's bits and position (a wrapping sum, so
    it does not depend on the order of the reduction: the same on any device or sharding). 0 for a parameter
    that is not rounded."""
    if not rounds(x.dtype):
        return jnp.zeros((), jnp.uint32)
    shape = tuple(x.shape)
    pos = _mix(_index(shape) * jnp.uint32(_GOLDEN) + jnp.uint32(1))
    h = jnp.sum(_mix(_param_bits(x) ^ pos), dtype=jnp.uint32)
    return _mix(h ^ jnp.uint32(_shape_word(shape)))


def random_bits(seed: int, salt: jax.Array, count: jax.Array, x: jax.Array, g: jax.Array) -> jax.Array:
    """32 random bits per element of the bfloat16 / float16 parameter `x` for the step numbered `count`, with
    its gradient `g`: `h(h(i·φ ⊕ k) ⊕ w)` with `k = h(h(seed ⊕ salt) ⊕ count)`, `i` the element's flat index, `w`
    the element's 16 bits of `x` and 16 bits of `g` (in `x`'s format) side by side, `h` the `_mix` hash. `salt`
    and `count` may have leading axes (a stack's rows) that `x` and `g` have too."""
    lead = jnp.ndim(salt)
    shape = tuple(x.shape[lead:])
    k = _mix(_mix(jnp.uint32(_seed_word(seed)) ^ salt.astype(jnp.uint32)) ^ count.astype(jnp.uint32))
    k = k.reshape(k.shape + (1,) * len(shape))
    h = _mix((_index(shape) * jnp.uint32(_GOLDEN)) ^ k)
    return _mix(h ^ _param_bits(x) ^ (_param_bits(g.astype(x.dtype)) << 16))


# ----------------------------------------------------------------------------------------------- rounding
def stochastic_round(y: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
    """`y` (float32) rounded to `dtype` (bfloat16 or float16) stochastically with the uint32 random `bits` (one
    per element): to the neighbour away from zero with probability `p = (|y| - |lo|) / (|hi| - |lo|)`, else to
    the one toward zero, so that the expectation is `y`. The neighbours come from the nearest value (`astype`)
    and its bit pattern (the magnitude's bits count the representable values in order). `p` is exact in
    float32 and compared with a uniform number of 24 bits (the top 24 of `bits`): exactly unbiased wherever `p`
    has at most 24 fraction bits, which is everywhere but float16's subnormal range (there the bias is under
    2^-24 of a place).

    Beyond the largest finite value the next one up is the infinity (at one place's distance): `y` above it
    rounds to it with that probability, as to-nearest does past half a place; infinities and NaN stay as they
    are, and so do values of `dtype` (`p = 0`).

    >>> import jax.numpy as jnp
    >>> from optim._rules.rounding import stochastic_round
    >>> # a quarter of bfloat16's place above 1
    >>> y = jnp.full(4, 1 + 2.0 ** -9, jnp.float32)
    >>> # u: 0, 0.25 - 2^-24, 0.25, ~1
    >>> bits = jnp.array([0, 2 ** 30 - 256, 2 ** 30, 2 ** 32 - 1], jnp.uint32)
    >>> # up with probability 0.25: where u < 0.25
    >>> stochastic_round(y, jnp.bfloat16, bits)
    Array([1.00781, 1.00781, 1, 1], dtype=bfloat16)
    """
    dtype = jnp.dtype(dtype)
    info = jnp.finfo(dtype)
    y = y.astype(jnp.float32)
    near = y.astype(dtype)
    word = jax.lax.bitcast_convert_type(near, jnp.uint16)
    sign, mag = word & jnp.uint16(0x8000), word & jnp.uint16(0x7FFF)
    ay = jnp.abs(y)
    away = jnp.abs(near.astype(jnp.float32)) > ay              # the nearest is the neighbour away from zero
    lo_mag = jnp.where(away, mag - jnp.uint16(1), mag)
    lo = jax.lax.bitcast_convert_type(sign | lo_mag, dtype)
    hi = jax.lax.bitcast_convert_type(sign | (lo_mag + jnp.uint16(1)), dtype)
    alo = jnp.abs(lo.astype(jnp.float32))
    top = int(np.asarray(info.max, dtype).view(np.uint16))      # the largest finite value's bits
    place_at_top = float(2.0 ** (int(info.maxexp) - 1 - int(info.nmant)))
    place = jnp.where(lo_mag == jnp.uint16(top), jnp.float32(place_at_top), jnp.abs(hi.astype(jnp.float32)) - alo)
    p = (ay - alo) / place                  # exact: |y| - |lo| is (Sterbenz), the place is a power of two
    u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)       # uniform in [0, 1), 24 bits
    out = jnp.where(u < p, hi, lo)
    return jnp.where(jnp.isfinite(y), out, near)


# ----------------------------------------------------------------------------------------------- the wrapper
class StochasticRounding(Rule):
    """Run `rule` on a float32 view of each bfloat16 / float16 parameter and write the new value back rounded
    *stochastically*, a `Replace` step: with `y = float32(x) - step` between the neighbours `lo` and `hi` of
    the parameter's format, the new parameter is `hi` with probability `(y - lo) / (hi - lo)`, else `lo`, so
    `E[x'] = y`. A step smaller than half a place, which rounding to nearest loses every time, moves the
    parameter on average by its full size: bfloat16 training follows float32's without a master copy (the
    state is the rule's plus two numbers per parameter). Gradients are cast to float32 before `rule` sees them.
    Parameters of float32 or wider take `rule`'s step unchanged. It must wrap the whole rule, like
    `MixedPrecision`, which keeps a master copy instead (the two do not combine).

    Randomness: deterministic given `seed` and the step, eager or under `jit`, on any device (a counter-based
    hash, no PRNG state). The bits for element `i` of a parameter at step `t` are a hash of `(seed, salt, t, i,
    the element's current bits, its gradient's bits)`. The salt is made at `setup` from the parameter's shape and
    initial values (a hash of every element's bits and position): parameters are decorrelated without being
    numbered, and the model's inputs alone decide the bits (not float32 arithmetic that a compiler may
    reorder). Parameters made equal (a norm's scales, all ones) share a salt; the gradient's and the
    parameter's bits, mixed in at every step, then decorrelate them. Two parameters equal in value and gradient
    are rounded alike, and stay equal, as they would in exact arithmetic. A tie is one parameter, stepped once.

    Args:
        rule: the rule to run on the float32 view (required).
        seed: an integer in [0, 2^64), default 0 (structural).

    State: `StochasticRoundingState(inner, salt, count)`: `rule`'s state (made for a float32 parameter, so
    Adam's moments are float32 unless `mu_dtype` / `nu_dtype` say otherwise), the parameter's salt (uint32) and
    the number of steps taken (int32).

    Reference: S. Gupta, A. Agrawal, K. Gopalakrishnan, P. Narayanan, "Deep Learning with Limited Numerical
    Precision", 2015, https://arxiv.org/abs/1502.02551; P. Zamirai, J. Zhang, C. R. Aberger, C. De Sa,
    "Revisiting BFloat16 Training", 2020, https://arxiv.org/abs/2010.06192

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.ones(1000, jnp.bfloat16)
    >>> state = optim.setup(optim.StochasticRounding(optim.Descent(1e-3)), x)
    >>> for _ in range(10):
    ...     state, x = optim.update(state, x, jnp.ones(1000, jnp.bfloat16))
    >>> # 1 - 10 * 0.001 on average
    >>> round(float(x.astype(jnp.float32).mean()), 3)
    0.99
    >>> # each element a bfloat16 value near 0.99; rounded to nearest, every step is
    >>> # lost (x stays 1)
    >>> x[:4]
    Array([0.988281, 0.988281, 0.988281, 0.980469], dtype=bfloat16)
    """

    rule: Any = None
    seed: int = static(0)
    _across = False     # per parameter; its inner rule may look across
    _rounds_stochastically = True   # MixedPrecision refuses it inside (optim._rules.wrappers)

    def __init__(self, rule: Any = None, seed: int = 0):
        if rule is None:
            raise TypeError("StochasticRounding(rule, seed=0) needs a rule: StochasticRounding(AdamW(1e-3))")
        if not is_rule(rule):
            raise TypeError(f"StochasticRounding: rule must be a rule (it needs init and apply), got {rule!r}; "
                            "write StochasticRounding(AdamW(1e-3), seed=0)")
        if isinstance(rule, (MixedPrecision, StochasticRounding)):
            raise TypeError(f"StochasticRounding: {type(rule).__name__} cannot be the rule inside it "
                            "(MixedPrecision keeps a float32 master copy, StochasticRounding rounds without one): "
                            "use one of them, once")
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"StochasticRounding: seed must be an integer, got {type(seed).__name__} {seed!r}")
        if not 0 <= int(seed) < 2 ** 64:
            raise ValueError(f"StochasticRounding: seed must be an integer in [0, 2^64), got {int(seed)}")
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "seed", int(seed))

    def init(self, x):
        dtype = jnp.dtype(x.dtype)
        if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32 and not rounds(dtype):
            raise TypeError(f"StochasticRounding: parameters of dtype {dtype.name} are not supported (bfloat16 "
                            "and float16 are rounded stochastically, wider ones pass through)")
        view = x.astype(jnp.float32) if rounds(dtype) else x
        return StochasticRoundingState(self.rule.init(view), salt_of(x), jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        views = [x.astype(jnp.float32) if rounds(x.dtype) else x for x in xs]
        grads = [tuple(d.astype(jnp.float32) for d in ds) if rounds(x.dtype) else tuple(ds)
                 for x, ds in zip(xs, dxs)]
        inner, steps = apply_all(self.rule, [s[0] for s in states], views, grads)
        new_states, out = [], []
        for s, x, dx, v, st, step in zip(states, xs, dxs, views, inner, steps):
            count = s[2] + jnp.ones((), s[2].dtype)
            new_states.append(StochasticRoundingState(st, s[1], count))
            if not rounds(x.dtype) or step is None:
                out.append(step)
                continue
            y = apply_step(v, step)           # float32: x - step (a Gated step where open, a Replace's value)
            bits = random_bits(self.seed, s[1], count, x, dx[0])
            out.append(Replace(stochastic_round(y, x.dtype, bits)))
        return new_states, out

    def average(self, state, x):
        if not rounds(x.dtype):
            return average_of(self.rule, state[0], x)
        avg = average_of(self.rule, state[0], x.astype(jnp.float32))     # the inner rule saw the float32 view
        return None if avg is None else avg.astype(x.dtype)
