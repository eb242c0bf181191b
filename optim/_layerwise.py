"""Layer-wise rules: steps shaped by a whole parameter (one layer's matrix or vector), not element by element.

`Muon` orthogonalises a matrix's momentum; `Lamb` and `Lars` scale the step by a trust ratio `‖x‖ / ‖u‖`. Each
runs per parameter like any rule (vmapped over a stack, so every stacked parameter gets its own norms; a tie
group is one parameter, with its summed gradient). Lamb and Lars follow optax's formulas and defaults.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._rules import _bt_init, _bt_next, _moments
from ._schedules import Hyper
from ._step import Rule, _abs2, _eps, _zeros_real, as_compute

__all__ = ["Muon", "Lamb", "Lars"]


def _newton_schulz(g: jax.Array, steps: int, eps: jax.Array) -> jax.Array:
    """Approximately orthogonalise a matrix (the quintic Newton-Schulz iteration of Muon):
    `X = g / (‖g‖_F + ε)`, then `steps` times `A = X Xᴴ`, `X ← a X + (b A + c A²) X` with
    `(a, b, c) = (3.4445, -4.7750, 2.0315)`, on the wide orientation of `g`."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (jnp.sqrt(jnp.sum(_abs2(g))) + eps)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        m = x @ jnp.conj(x).T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


class Muon(Rule):
    """Muon (Jordan et al. 2024) for matrices: momentum `m ← ρ m + g`, the Nesterov direction `u = g + ρ m`
    (or `m`), then `step = η · max(1, rows/cols)^½ · NS(u)` where NS orthogonalises `u` by `steps` quintic
    Newton-Schulz iterations (singular values pushed towards 1). 2-D parameters only (another shape is a
    `TypeError` at `setup`): pair it with AdamW for the rest, e.g.
    `optim.setup(lambda path, x: optim.Muon(0.02) if x.ndim == 2 else optim.AdamW(3e-4), model)`.

    Args:
        lr: learning rate η, default 0.02, >= 0.
        rho: momentum ρ, default 0.95, in [0, 1].
        eps: ε added to the Frobenius norm before the iteration, default 1e-7, >= 0.
        nesterov: use the Nesterov direction `g + ρ m` (else `m`), default True (structural).
        steps: number of Newton-Schulz iterations, default 5 (structural).

    State: `m`, the momentum (parameter dtype), starting at 0.

    Reference: K. Jordan, Y. Jin, V. Boza, J. You, F. Cesista, L. Newhouse, J. Bernstein, "Muon: An optimizer
    for hidden layers in neural networks", 2024, https://kellerjordan.github.io/posts/muon/

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.zeros((2, 2))
    >>> state = optim.setup(optim.Muon(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([[3.0, 0.0], [0.0, 4.0]]))
    >>> x.round(2)     # u's singular values, 0.6 and 0.8 once normalised, become 0.72 and 1.12
    Array([[-0.07,  0.  ],
           [ 0.  , -0.11]], dtype=float32)
    """

    lr: Hyper = 0.02
    rho: Hyper = 0.95
    eps: Hyper = 1e-7
    nesterov: bool = True
    steps: int = 5
    _static = ("nesterov", "steps")
    _nonneg = ("lr", "eps")
    _decay = ("rho",)

    def init(self, x):
        if x.ndim != 2:
            raise TypeError(f"Muon needs a 2-D parameter, got shape {tuple(x.shape)}; give it another rule")
        return jnp.zeros_like(x)

    def apply(self, m, x, dx, *dxs):
        rho = as_compute(self.rho, x)
        m = rho * m + dx
        u = dx + rho * m if self.nesterov else m
        scale = max(1.0, x.shape[0] / x.shape[1]) ** 0.5
        return m, as_compute(self.lr, x) * scale * _newton_schulz(u, self.steps, as_compute(self.eps, x))


# ----------------------------------------------------------------------------------------------- layer-wise
def _norm(a: jax.Array) -> jax.Array:
    """The 2-norm of all entries of `a` (Frobenius for a matrix), summed in at least float32."""
    a = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    return jnp.sqrt(jnp.sum(_abs2(a)))


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

    State: `(m, v, bt)`: first moment, second moment, running powers (β₁ᵗ, β₂ᵗ) (as `Adam`).

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

    lr: Hyper = 0.001
    beta: tuple[Hyper, Hyper] = (0.9, 0.999)
    eps: Hyper = 1e-6
    weight_decay: Hyper = 0.0
    eps_root: Hyper = 0.0
    _nonneg = ("lr", "eps", "weight_decay", "eps_root")
    _unit = ("beta",)

    def init(self, x):
        return jnp.zeros_like(x), _zeros_real(x), _bt_init(self.beta, x)

    def apply(self, state, x, dx, *dxs):
        m, v, bt = state
        m, v = _moments(self.beta, m, v, dx, x)
        vhat = v / (1 - bt[1]) + as_compute(self.eps_root, x)
        u = m / (1 - bt[0]) / (jnp.sqrt(vhat) + _eps(self.eps, x)) + as_compute(self.weight_decay, x) * x
        lr = as_compute(self.lr, x)
        step = (lr * _trust_ratio(x, u, jnp.ones((), lr.dtype), jnp.zeros((), lr.dtype))) * u
        return (m, v, _bt_next(bt, self.beta, x)), step


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

    lr: Hyper = 1.0
    rho: Hyper = 0.9
    weight_decay: Hyper = 0.0
    trust_coefficient: Hyper = 0.001
    eps: Hyper = 0.0
    nesterov: bool = False
    _static = ("nesterov",)
    _nonneg = ("lr", "weight_decay", "trust_coefficient", "eps")
    _decay = ("rho",)

    def init(self, x):
        return jnp.zeros_like(x)

    def apply(self, v, x, dx, *dxs):
        rho, lr = as_compute(self.rho, x), as_compute(self.lr, x)
        u = dx + as_compute(self.weight_decay, x) * x
        s = (lr * _trust_ratio(x, u, as_compute(self.trust_coefficient, x), as_compute(self.eps, x))) * u
        v = rho * v + s
        return v, (s + rho * v if self.nesterov else v)
