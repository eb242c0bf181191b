"""Layer-wise rules: steps scaled by a trust ratio `‖x‖ / ‖u‖` over a whole parameter (one layer's matrix or
vector), not element by element.

`Lamb` and `Lars` run per parameter like any rule (vmapped over a stack, so every stacked parameter gets its own
norms; a tie group is one parameter, with its summed gradient). They follow optax's formulas and defaults. The
matrix rules (`Muon`, `NorMuon`) are in `muon.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .fields import decay, flag, nonneg, unit
from .moments import bt_init, bt_next, debias, moments
from .adam import AdamState
from .schedules import Hyper
from .protocol import Rule, abs2, eps_of, zeros_real, as_compute

__all__ = ["Lamb", "Lars"]


# ----------------------------------------------------------------------------------------------- layer-wise
def _norm(a: jax.Array) -> jax.Array:
    """The 2-norm of all entries of `a` (Frobenius for a matrix), summed in at least float32."""
    a = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    return jnp.sqrt(jnp.sum(abs2(a)))


def _trust_ratio(x: jax.Array, u: jax.Array, coef: jax.Array, eps: jax.Array) -> jax.Array:
    """`coef ‖x‖ / (‖u‖ + ε)`, but 1 where `‖x‖ = 0` or `‖u‖ = 0` (optax's `scale_by_trust_ratio`: a zero
    parameter still moves, a zero update stays zero), one number per parameter."""
    pn, un = _norm(x), _norm(u)
    zero = (pn == 0) | (un == 0)
    return jnp.where(zero, 1, coef * pn / jnp.where(zero, 1, un + eps)).astype(coef.dtype)


class Lamb(Rule):
    """LAMB, Adam with a layer-wise trust ratio: `m`, `v` as in Adam,
    `u = m̂ / (√(v̂ + ε_root) + ε) + λ x`, then `step = η (‖x‖ / ‖u‖) u`, the norms over the whole parameter
    (the ratio is 1 where `‖x‖ = 0` or `‖u‖ = 0`, as optax: a zero-initialised parameter takes the plain
    step `η u`). A tie group is one parameter: its ratio uses the tie-summed gradient.

    Args:
        lr: learning rate η, default 0.001, >= 0 (optax has no default).
        beta: decay rates (β₁, β₂) of the moments, default (0.9, 0.999), each in [0, 1) (optax's `b1`, `b2`).
        eps: ε, added outside the square root, default 1e-6, >= 0 (at least 1e-7 for 16-bit parameters).
        weight_decay: λ, added to the Adam direction before the trust ratio, default 0.0, >= 0. Every
            parameter is decayed (optax's `mask`): choose per path with `optim.by_path`, e.g.
            `by_path({"*.bias": Lamb(1e-3), "*": Lamb(1e-3, weight_decay=0.01)})`.
        eps_root: ε_root, added inside the square root, default 0.0, >= 0.

    State: `AdamState(mu, nu, bt)`: first moment, second moment, products (β₁ᵗ, β₂ᵗ) (as `Adam`).

    Reference: Y. You, J. Li, S. Reddi, J. Hseu, S. Kumar, S. Bhojanapalli, X. Song, J. Demmel, K. Keutzer,
    C.-J. Hsieh, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", 2019,
    https://arxiv.org/abs/1904.00962

    optax: equals `optax.lamb(η, b1=β₁, b2=β₂, eps=ε, eps_root=ε_root, weight_decay=λ)` (the defaults are
    optax's; only the names differ: the pair `beta`, and `lr`).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Lamb(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(4)     # u ≈ sign(g), ratio ‖x‖ / ‖u‖ = √5 / √2
    Array([0.8419, 2.1581], dtype=float32)
    """

    lr: Hyper = nonneg(0.001)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    eps: Hyper = nonneg(1e-6)
    weight_decay: Hyper = nonneg(0.0)
    eps_root: Hyper = nonneg(0.0)

    def init(self, x):
        return AdamState(jnp.zeros_like(x), zeros_real(x), bt_init(self.beta, x))

    def apply(self, state, x, dx, *dxs):
        m, v, bt = state
        bt = bt_next(bt, self.beta, x)
        m, v = moments(self.beta, m, v, dx, x)
        c1, c2 = debias(bt)
        vhat = v * c2 + as_compute(self.eps_root, x)
        u = m * c1 / (jnp.sqrt(vhat) + eps_of(self.eps, x)) + as_compute(self.weight_decay, x) * x
        lr = as_compute(self.lr, x)
        step = (lr * _trust_ratio(x, u, jnp.ones((), lr.dtype), jnp.zeros((), lr.dtype))) * u
        return AdamState(m, v, bt), step


class Lars(Rule):
    """LARS, momentum SGD with a layer-wise trust ratio: `u = g + λ x`,
    `r = c ‖x‖ / (‖u‖ + ε)` (1 where `‖x‖ = 0` or `‖u‖ = 0`, as optax), `v ← ρ v + η r u`, `step = v`
    (`nesterov=True`: `η r u + ρ v` with the new `v`). The norms are over the whole parameter; a tie group is
    one parameter and its ratio uses the tie-summed gradient. Note that a zero parameter (a bias initialised
    at 0) gets `r = 1`, a step `1/c` times larger than the trust-scaled ones: give such parameters another
    rule with `optim.by_path` (optax's `trust_ratio_mask`).

    Args:
        lr: learning rate η, default 1.0, >= 0 (optax has no default; the trust coefficient makes the step
            about `η c ‖x‖` per parameter).
        rho: momentum ρ, default 0.9, in [0, 1] (optax's `momentum`).
        weight_decay: λ, default 0.0, >= 0.
        trust_coefficient: c, default 0.001, >= 0.
        eps: ε added to `‖u‖`, default 0.0, >= 0.
        nesterov: Nesterov momentum, default False (structural).

    Every parameter gets the weight decay and the trust ratio (optax's `weight_decay_mask` and
    `trust_ratio_mask` are per-leaf booleans): choose per path with `optim.by_path`, e.g.
    `by_path({"*.bias": Momentum(0.1, 0.9), "*": Lars(1.0, weight_decay=1e-4)})`.

    State: `v`, the velocity (parameter dtype), starting at 0. It accumulates `η r u`, so a changed η (adjust,
    schedule) affects new gradients only, as in optax (which scales by η before its trace).

    Reference: Y. You, I. Gitman, B. Ginsburg, "Large Batch Training of Convolutional Networks", 2017,
    https://arxiv.org/abs/1708.03888

    optax: equals `optax.lars(η, weight_decay=λ, trust_coefficient=c, eps=ε, momentum=ρ, nesterov=...)`
    (the defaults are optax's).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.Lars(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x.round(5)     # r = 0.001 · √5 / √1.25 = 0.002
    Array([0.9999, 2.0002], dtype=float32)
    """

    lr: Hyper = nonneg(1.0)
    rho: Hyper = decay(0.9)
    weight_decay: Hyper = nonneg(0.0)
    trust_coefficient: Hyper = nonneg(0.001)
    eps: Hyper = nonneg(0.0)
    nesterov: bool = flag(False)

    def init(self, x):
        return jnp.zeros_like(x)

    def apply(self, v, x, dx, *dxs):
        rho, lr = as_compute(self.rho, x), as_compute(self.lr, x)
        u = dx + as_compute(self.weight_decay, x) * x
        s = (lr * _trust_ratio(x, u, as_compute(self.trust_coefficient, x), as_compute(self.eps, x))) * u
        v = rho * v + s
        return v, (s + rho * v if self.nesterov else v)
