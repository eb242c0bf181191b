"""ADOPT: Adam with the gradient normalised by the *previous* second moment, before the momentum.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from .._base.export import register_for_export
from .fields import Small, flag, nonneg, static, unit
from .moments import load, mu_zeros, nu_zeros, StateDtypes, store
from .protocol import Rule, abs2, as_compute, eps_of, pair_of, where
from .quantized import QuantizedArray
from .schedules import Hyper

__all__ = ["ADOPT"]


@register_for_export
class ADOPTState(NamedTuple):
    """The state of ADOPT."""
    mu: Any              # first moment of the normalised gradients
    nu: Any              # second moment of the gradients
    t: Small             # the number of steps taken, int32 (0: the next one only sets nu)


def clip_bound(t, dtype):
    """ADOPT's clip of the normalised gradient at step `t` (from 0): `t^(1/4)`, in `dtype`. Also what the fused CPU
    kernel is given per parameter (`optim._engine.fused_kinds`)."""
    return t.astype(dtype) ** 0.25


class ADOPT(StateDtypes, Rule):
    """ADOPT: the first step only sets `v ← |g|²` (no step); every later step `t = 1, 2, ...` normalises the
    gradient by the previous second moment, `u = clip(g / max(√v, ε), -t^¼, t^¼)`, then `m ← β₁ m + (1 - β₁) u`,
    `v ← β₂ v + (1 - β₂)|g|²` and `step = η m` (with Nesterov, `step = η (β₁ m + (1 - β₁) u)` with the new `m`).
    Without clipping `u = g / max(√v, ε)`. No bias correction. Real parameters only (a complex one is a
    `TypeError` at `setup`).

    Args:
        lr: learning rate η, default 1e-3, >= 0.
        beta: decay rates (β₁, β₂) of the moments, default (0.9, 0.9999), each in [0, 1).
        eps: ε, default 1e-6, >= 0 (at least 1e-7 for 16-bit parameters): the least `√v` divides by.
        nesterov: the Nesterov step, default False; structural.
        use_clipping: clip `u` to `[-t^¼, t^¼]`, default True (the paper's stabilisation); structural.
        mu_dtype: storage dtype of `m`, a real floating dtype such as `jnp.bfloat16` or a `Quantized` format
            (`optim.q8`, `optim.q4`), default None (the parameter's dtype); structural. See `optim.Quantized`.
        nu_dtype: storage dtype of `v`, default None (the parameter's real dtype); structural.

    State: `ADOPTState(mu, nu, t)`: first moment (`mu_dtype`, default the parameter dtype), second moment
    (`nu_dtype`, default the real dtype), both starting at 0, and the number `t` of steps taken (int32, starting
    at 0). The step is computed from the new `m` before it is rounded to its storage.

    Reference: S. Taniguchi, K. Harada, G. Minegishi, Y. Oshima, S. C. Jeong, G. Nagahara, T. Iiyama,
    M. Suzuki, Y. Iwasawa, Y. Matsuo, "ADOPT: Modified Adam Can Converge with Any β₂ with the Optimal Rate",
    NeurIPS 2024, https://arxiv.org/abs/2411.02853

    optax: equals `optax.contrib.adopt(η, b1, b2, eps, nesterov=..., use_clipping=...)` with its default
    `clip_value_fn` (`t ** 0.25`); optax's count is one for all parameters, here `t` is per parameter (a
    parameter without a gradient does not advance).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.ADOPT(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x              # the first step only sets v = g²
    Array([1., 2.], dtype=float32)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x              # then u = g / |g| = sign(g) (clipped to 1), m = 0.1 u
    Array([0.99, 2.01], dtype=float32)
    """

    _formula = "adopt"
    lr: Hyper = nonneg(1e-3)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.9999))
    eps: Hyper = nonneg(1e-6)
    # the static fields last, new ones at the end: old files still read
    nesterov: bool = flag(False)
    use_clipping: bool = flag(True)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        if jnp.iscomplexobj(x):
            raise TypeError("ADOPT needs real parameters (it clips the normalised gradient)")
        return ADOPTState(mu_zeros(self, x), nu_zeros(self, x), jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        m, v = load(x, *state[:2])
        t = state[2]
        b1, b2 = pair_of(self.beta, x)
        # √v of the stored v in its own dtype, as before storage options: XLA rounds a float16 v's root to float16
        # (the root of the float32 `load` changed float16 parameters' steps in the last bits); a quantised v's
        # root is of its float32 values
        root = jnp.sqrt(v if isinstance(state[1], QuantizedArray) else state[1])
        u = dx / jnp.maximum(root, eps_of(self.eps, x))
        if self.use_clipping:
            c = clip_bound(t, b1.dtype)
            u = jnp.clip(u, -c, c)
        new_m = b1 * m + (1 - b1) * u
        ahead = b1 * new_m + (1 - b1) * u if self.nesterov else new_m
        # `where`: the state may be split where the gradient is not (ZeRO-1 on Explicit mesh axes)
        first = t == 0
        new_v = where(first, abs2(dx), b2 * v + (1 - b2) * abs2(dx))
        new_m = where(first, m, new_m)
        step = where(first, m, ahead) * as_compute(self.lr, x)
        return ADOPTState(*store((new_m, new_v), state[:2]), t + 1), step
