"""Layer-wise rules: steps shaped by a whole parameter (one layer's matrix or vector), not element by element.

`Muon` orthogonalises a matrix's momentum; `Lamb` and `Lars` scale the step by a trust ratio `‖x‖ / ‖u‖`. Each
runs per parameter like any rule (vmapped over a stack, so every stacked parameter gets its own norms; a tie
group is one parameter, with its summed gradient). Lamb and Lars follow optax's formulas and defaults.
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import hyper as _hyper
from .._base.export import register_for_export
from .fields import decay, flag, nonneg, static, unit
from .moments import bt_init, bt_next, debias, load, moments, mu_zeros, StateDtypes, store
from .adam import AdamState
from .schedules import Hyper
from .protocol import Rule, abs2, eps_of, zeros_real, as_compute

__all__ = ["Muon", "Lamb", "Lars"]


_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def _newton_schulz(g: jax.Array, steps: int, eps: jax.Array) -> jax.Array:
    """Approximately orthogonalise a matrix (the quintic Newton-Schulz iteration of Muon):
    `X = g / (‖g‖_F + ε)`, then `steps` times `A = X Xᴴ`, `X ← a X + (b A + c A²) X` with
    `(a, b, c) = (3.4445, -4.7750, 2.0315)`, on the wide orientation of `g`."""
    a, b, c = _NS_COEFFS
    x = g / (jnp.sqrt(jnp.sum(abs2(g))) + eps)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        m = x @ jnp.conj(x).T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


def _whole(a: jax.Array) -> tuple[jax.Array, Any]:
    """`a` replicated over its mesh when its sharding is part of its type and splits it (Explicit mesh axes:
    ZeRO-1's sharded momentum, an FSDP parameter), and that sharding, to put the result back; else `(a, None)`.
    Newton-Schulz's products `X Xᴴ` contract the axes such a sharding splits, which JAX refuses to type
    ("contracting dimensions are sharded"): the whole matrix is orthogonalised on every device instead (with
    Auto axes XLA chooses the same or its own partitioning)."""
    s = getattr(jax.typeof(a), "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding) or s.mesh.empty or all(d is None for d in s.spec):
        return a, None
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())), s


def _axes(v: Any) -> tuple[int, ...] | None:
    """An axis argument (an int, a sequence of ints, or None) as a tuple of ints, or None."""
    if v is None:
        return None
    return (operator.index(v),) if not isinstance(v, (tuple, list)) else tuple(operator.index(a) for a in v)


@register_for_export
class MuonState(NamedTuple):
    mu: Any              # the momentum
    count: Any           # the parameter's number of steps, int32
    _small = ("count",)  # small values, whatever the parameter's shape: packed (optim._engine.pack)


class Muon(StateDtypes, Rule):
    """Muon (Jordan et al. 2024): momentum orthogonalised by Newton-Schulz. With `t` the parameter's step:

    - `m ← β m + (1 - β) g`; the direction `u = β m / (1 - βᵗ⁺¹) + (1 - β) g / (1 - βᵗ)` (Nesterov), or
      `u = m / (1 - βᵗ)`;
    - `O = NS(u)`: `u` seen as a matrix (fan_in x fan_out: the reduction axes by the output axes, any other
      axis a batch of matrices), orthogonalised by `steps` quintic Newton-Schulz iterations (singular values
      pushed towards 1); with `adaptive`, `O ← ⟨u, O⟩ O`;
    - `step = η (s O + λ x)`, with the width scale `s = √max(1, fan_out / fan_in)`, or, with `consistent_rms`
      `r`, `s = r √max(fan_in, fan_out)` (an update RMS independent of the shape, like AdamW's at `r ≈ 0.2`).

    For a parameter `x @ W` with `W` of shape (in, out) the defaults are optax's: reduction axis 0, output axis
    1. A parameter with more than 2 axes is reshaped to `(shape[0], -1)` (output axes: every other one), or
    give `reduction_axis` / `output_axis` (a convolution kernel `(h, w, in, out)`: `reduction_axis=(0, 1, 2)`;
    axes in neither are a batch, each slice orthogonalised alone). Vectors and scalars are a `TypeError` at
    `setup`: give them another rule, e.g. `by_path({"*.kernel": Muon(0.02), "*": AdamW(3e-4)})` or
    `setup(lambda path, x: Muon(0.02) if x.ndim >= 2 else AdamW(3e-4), model)`.

    Args:
        lr: learning rate η, default 0.02, >= 0.
        rho: momentum β, default 0.95, in [0, 1) (optax's `beta`).
        eps: ε added to the Frobenius norm before the iteration, default 1e-8, >= 0.
        weight_decay: λ, decoupled, multiplied by η (optax's, PyTorch's convention), default 0.0, >= 0.
        consistent_rms: r, default None (the width scale); a number >= 0 selects the consistent-RMS scale.
            None or a number is structural (it changes the program); the number is adjustable.
        nesterov: the Nesterov direction (else the bias-corrected momentum), default True (structural).
        adaptive: scale `O` by `⟨u, O⟩` (Bernstein & Newhouse's dual norm), default False (structural).
        steps: number of Newton-Schulz iterations, default 5, an integer >= 1 (structural; 0 would skip the
            orthogonalisation that makes it Muon).
        reduction_axis, output_axis: the matrix's axes, default 0 and None (every axis but the reduction
            ones); ints or tuples of ints, negative counting from the end (structural).
        mu_dtype: storage dtype of `m`, default None (the parameter's dtype); structural.

    State: `MuonState(mu, count)`: the momentum `m` (starting at 0) and the parameter's number of steps (int32).
    Counts are per parameter: one with no step (a `None` gradient, frozen) keeps its `t`.

    Reference: K. Jordan, Y. Jin, V. Boza, J. You, F. Cesista, L. Newhouse, J. Bernstein, "Muon: An optimizer
    for hidden layers in neural networks", 2024, https://kellerjordan.github.io/posts/muon/; the consistent
    RMS: J. Liu et al., "Muon is Scalable for LLM Training", 2025, arXiv:2502.16982; adaptive: J. Bernstein,
    L. Newhouse, "Old Optimizer, New Norm: An Anthology", 2024, arXiv:2409.20325.

    optax: `Muon(η)` is `optax.contrib.muon(η)` on 2-D parameters (same defaults; its `beta` is `rho`,
    `muon_weight_dimension_numbers=MuonDimensionNumbers(r, o)` is `reduction_axis=r, output_axis=o`). optax
    sends every other parameter to AdamW; here that is the rule you pair Muon with. optax counts steps once for
    the whole tree, here per parameter (the same unless some parameter skips a step). Not here: optax's
    `ns_coeffs` presets and `preconditioning` other than Frobenius.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.zeros((2, 2))
    >>> state = optim.setup(optim.Muon(0.1), x)
    >>> state, x = optim.update(state, x, jnp.array([[3.0, 0.0], [0.0, 4.0]]))
    >>> # u ∝ g; its singular values, 0.6 and 0.8 once normalised, become 0.72 and
    >>> # 1.12
    >>> x.round(2)
    Array([[-0.07,  0.  ],
           [ 0.  , -0.11]], dtype=float32)
    """

    lr: Hyper = nonneg(0.02)
    rho: Hyper = unit(0.95)
    eps: Hyper = nonneg(1e-8)
    weight_decay: Hyper = nonneg(0.0)
    consistent_rms: Hyper | None = nonneg(None)
    nesterov: bool = flag(True)
    adaptive: bool = flag(False)
    steps: int = static(5)
    reduction_axis: Any = static(0)
    output_axis: Any = static(None)
    mu_dtype: Any = static(None)

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "steps", _hyper.whole("Muon", "steps", self.steps, 1,
                                                       "with no iteration the momentum is not orthogonalised"))
        for name in ("reduction_axis", "output_axis"):
            try:
                object.__setattr__(self, name, _axes(getattr(self, name)))
            except TypeError:
                raise TypeError(f"Muon: {name} must be an int or a tuple of ints, got {getattr(self, name)!r}") \
                    from None
        if self.reduction_axis is None:
            raise TypeError("Muon: reduction_axis must be an int or a tuple of ints, got None")

    @classmethod
    def _checked(cls, name: str, v: Any) -> Any:
        if name == "consistent_rms" and v is None:
            return None
        return super()._checked(name, v)

    def _matrix(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The (batch, reduction, output) axes of a parameter of `shape`, checked."""
        n = len(shape)
        if n < 2:
            raise TypeError(f"Muon needs a parameter with at least 2 axes (a matrix), got shape {tuple(shape)}; "
                            "give it another rule")
        for name, axes in (("reduction_axis", self.reduction_axis), ("output_axis", self.output_axis)):
            if axes is not None and any(not -n <= a < n for a in axes):
                raise TypeError(f"Muon: {name}={axes} is out of range for a parameter of shape {tuple(shape)}")
        red = tuple(a % n for a in self.reduction_axis)
        out = tuple(a % n for a in self.output_axis) if self.output_axis is not None else \
            tuple(a for a in range(n) if a not in red)
        if not red or not out or set(red) & set(out) or len(set(red)) < len(red) or len(set(out)) < len(out):
            raise TypeError(f"Muon: reduction axes {red} and output axes {out} must be non-empty, distinct and "
                            f"disjoint (parameter shape {tuple(shape)})")
        return tuple(a for a in range(n) if a not in red and a not in out), red, out

    def init(self, x):
        self._matrix(x.shape)
        return MuonState(mu_zeros(self, x), jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        c = lambda v: as_compute(v, x)   # noqa: E731
        beta = c(self.rho)
        count = state.count + 1
        (mu,) = load(x, state.mu)
        g = dx.astype(jnp.promote_types(dx.dtype, mu.dtype))
        mu = beta * mu + (1 - beta) * g
        t = count.astype(beta.dtype)
        if self.nesterov:
            u = beta * mu / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t)
        else:
            u = mu / (1 - beta ** t)
        batch, red, out = self._matrix(x.shape)
        size = lambda axes: math.prod(x.shape[a] for a in axes)   # noqa: E731
        order = batch + red + out
        u, split = _whole(u)
        o = u.transpose(order).reshape(size(batch), size(red), size(out))
        o = jax.vmap(lambda m: _newton_schulz(m, self.steps, c(self.eps)))(o)
        o = o.reshape(tuple(x.shape[a] for a in order)).transpose(np.argsort(order))
        if self.adaptive:
            o = jnp.sum(jnp.conj(u) * o) * o
        if split is not None:      # back to the momentum's sharding: a local slice, no communication
            o = jax.sharding.reshard(o, split)
        fan_in, fan_out = size(red), size(out)
        if self.consistent_rms is None:
            scale = max(1.0, fan_out / fan_in) ** 0.5
        else:
            scale = max(fan_in, fan_out) ** 0.5 * c(self.consistent_rms)
        step = c(self.lr) * (scale * o + c(self.weight_decay) * x)
        return MuonState(store((mu,), (state.mu,))[0], count), step


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
