"""Rules that scale by a running second moment, without a first: `RMSProp`, `AdaGrad`, `AdaDelta`.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from .._base.export import register_for_export
from .fields import decay, flag, nonneg, static
from .moments import load, mu_zeros, nu_zeros, StateDtypes, store
from .quantized import QuantizedArray
from .schedules import Hyper
from .protocol import Rule, abs2, compute_dtype, eps_of, real_dtype, zeros_real, as_compute

__all__ = ["RMSProp", "AdaGrad", "AdaDelta"]


# Named per-parameter states: `state["w"].state.mu` reads as the docstrings do, and `state_dict` keys by name.
# They flatten like the tuples they replaced (same leaves, same order), so stacking, vmap and old files agree.
@register_for_export
class RMSPropState(NamedTuple):
    quad: Any            # running mean of |g|²
    lin: Any             # running mean of g (centred), else None


@register_for_export
class AdaDeltaState(NamedTuple):
    acc_grad: Any        # running mean of |g|²
    acc_step: Any        # running mean of |step|²


class RMSProp(StateDtypes, Rule):
    """RMSProp: `q ← ρ q + (1 - ρ)|g|²`, `step = η g / (√q + ε)`; `centred=True` also tracks `l ← ρ l + (1 - ρ) g`
    and uses `√(q - |l|²)`. ε is outside the square root and ρ defaults to 0.9.

    Args:
        lr: learning rate η, default 0.001, >= 0.
        rho: decay ρ of the running averages, default 0.9, in [0, 1].
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).
        centred: subtract the squared running mean of `g` (Graves' centred form), default False (structural).
        mu_dtype: storage dtype of the centred `l`, a real floating dtype such as `jnp.bfloat16` or a `Quantized`
            format (`optim.q8`, `optim.q4`), default None (the parameter's dtype); structural; unused unless
            centred. See `optim.Quantized` for 8- and 4-bit formats.
        nu_dtype: storage dtype of `q`, default None (the parameter's real dtype); structural.

    State: `RMSPropState(quad, lin)`: `q`, the running mean of `|g|²` (`nu_dtype`, default the real dtype), and
    when centred `l`, the running mean of `g` (`mu_dtype`, default the parameter dtype; else `None`); both start
    at 0. The step is computed from the new averages before they are rounded to their storage. Centred, with
    either stored in fewer bits than it is computed with (bfloat16, `optim.q8`, `optim.q4`, or a bfloat16
    parameter's default), `quad` holds the variance `s = q - |l|²` instead, updated as
    `s ← ρ s + ρ (1 - ρ)|g - l|²` (the same numbers unrounded), so that rounding cannot make it negative.

    Reference: T. Tieleman, G. Hinton, "Lecture 6.5 — RMSProp: divide the gradient by a running average of its
    recent magnitude", COURSERA: Neural Networks for Machine Learning, 2012,
    https://www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf. Centred: A. Graves, "Generating
    Sequences With Recurrent Neural Networks", 2013, https://arxiv.org/abs/1308.0850

    optax: equals `optax.rmsprop(η, decay=ρ, eps=ε, eps_in_sqrt=False)` (centred: `centered=True`); optax's
    default puts ε inside the square root.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.RMSProp(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(4)     # the first step is η sign(g) / √(1 - ρ)
    Array([0.6838, 2.3162], dtype=float32)
    """

    _formula = "rmsprop"
    lr: Hyper = nonneg(0.001)
    rho: Hyper = decay(0.9)
    eps: Hyper = nonneg(1e-8)
    # the static fields last, new ones at the end: old files' treedefs still read
    centred: bool = flag(False)
    mu_dtype: Any = static(None)
    nu_dtype: Any = static(None)

    def init(self, x):
        return RMSPropState(nu_zeros(self, x), mu_zeros(self, x) if self.centred else None)

    def apply(self, state, x, dx, *dxs):
        q0, l0 = state
        (q,) = load(x, q0)
        rho = as_compute(self.rho, x)
        if not self.centred:
            q = rho * q + (1 - rho) * abs2(dx)
            step = dx * as_compute(self.lr, x) / (jnp.sqrt(q) + eps_of(self.eps, x))
            return RMSPropState(*store((q,), (q0,)), None), step
        (l,) = load(x, l0)
        if _rounded(q0, x) or _rounded(l0, x):
            # `q` holds the variance `s = q - |l|²`: rounded on their own, q and |l|² drift past each other and
            # their difference goes to 0 or below (a step of g / ε, or NaN); `s` is updated by what q and l's
            # updates make of it, `s ← ρ s + ρ (1 - ρ)|g - l|²`, which stays >= 0 whatever each is rounded to.
            q = rho * q + rho * (1 - rho) * abs2(dx - l)
            l = rho * l + (1 - rho) * dx
            var = q
        else:
            q = rho * q + (1 - rho) * abs2(dx)
            l = rho * l + (1 - rho) * dx
            var = q - abs2(l)
        step = dx * as_compute(self.lr, x) / (jnp.sqrt(var) + eps_of(self.eps, x))
        return RMSPropState(*store((q, l), (q0, l0))), step


def _rounded(stored: Any, x: Any) -> bool:
    """Whether a moment is stored with fewer bits than it is computed with (a `Quantized` format, bfloat16)."""
    if isinstance(stored, QuantizedArray):
        return True
    return jnp.finfo(stored.dtype).bits < jnp.finfo(compute_dtype(x)).bits


class AdaGrad(Rule):
    """AdaGrad: `acc ← acc + |g|²` (starting at ε), `step = η g / (√acc + ε)`.

    Args:
        lr: learning rate η, default 0.1, >= 0.
        eps: ε, the accumulator's start and the denominator's offset, default 1e-8, >= 0 (offset at least 1e-7
            for 16-bit parameters).

    State: `acc`, the sum of `|g|²` (real dtype), starting at ε.

    Reference: J. Duchi, E. Hazan, Y. Singer, "Adaptive Subgradient Methods for Online Learning and Stochastic
    Optimization", JMLR 12, 2011, https://jmlr.org/papers/v12/duchi11a.html

    optax: adds eps inside `rsqrt` and starts the accumulator at 0.1; the closest is
    `optax.adagrad(η, initial_accumulator_value=ε, eps=0)`, which differs by the factor √acc / (√acc + ε).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdaGrad(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.9, 2.1], dtype=float32)
    """

    lr: Hyper = nonneg(0.1)
    eps: Hyper = nonneg(1e-8)

    def init(self, x):
        return jnp.full(x.shape, self.eps, real_dtype(x))

    def apply(self, acc, x, dx, *dxs):
        acc = acc + abs2(dx)
        return acc, dx * as_compute(self.lr, x) / (jnp.sqrt(acc) + eps_of(self.eps, x))


class AdaDelta(Rule):
    """AdaDelta (no learning rate): `a ← ρ a + (1 - ρ)|g|²`, `step = g √(d + ε) / √(a + ε)`,
    then `d ← ρ d + (1 - ρ)|step|²`.

    Args:
        rho: decay ρ of the running averages, default 0.9, in [0, 1].
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters).

    State: `AdaDeltaState(acc_grad, acc_step)`: running means of `|g|²` and of `|step|²` (real dtype), both starting
    at 0.

    Reference: M. D. Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012,
    https://arxiv.org/abs/1212.5701

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.AdaDelta(), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(5)     # the first steps are small: √ε / √(1 - ρ)
    Array([0.99968, 2.00032], dtype=float32)
    """

    rho: Hyper = decay(0.9)
    eps: Hyper = nonneg(1e-8)

    def init(self, x):
        return AdaDeltaState(zeros_real(x), zeros_real(x))

    def apply(self, state, x, dx, *dxs):
        a, d = state
        rho, eps = as_compute(self.rho, x), eps_of(self.eps, x)
        a = rho * a + (1 - rho) * abs2(dx)
        step = dx * jnp.sqrt(d + eps) / jnp.sqrt(a + eps)
        return AdaDeltaState(a, rho * d + (1 - rho) * abs2(step)), step
