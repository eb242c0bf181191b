"""Shampoo: blocked Kronecker-factored preconditioning with a grafted step size (distributed Shampoo).

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
Like SOAP (`soap.py`), Shampoo is defined over a stack of same-shaped parameters (`apply_tree`): the statistics,
inverse roots and matrix products of a stack's blocks are one batched operation each, the stacks' eigh run one
after another (`soap._one_at_a_time`), and a refresh of the inverse roots that no member of the stack needs is
skipped (`jax.lax.cond` on the whole stack).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import hyper as _hyper
from . import split as _devices
from .._base.export import register_for_export
from .fields import Small, count, flag, nonneg, static, steps, unit
from .protocol import Rule, apply_one, as_compute, compute_dtype, pair_of, where_leading
from .schedules import Hyper
from .soap import _one_at_a_time, _replicated

__all__ = ["Shampoo"]

GRAFTS = ("adam", "rmsprop", "adagrad", "sgd")
_NORM_EPS = 1e-25      # the reference's `_EPSILON` in the graft ratio ‖graft‖ / (‖P‖ + ε)


@register_for_export
class ShampooState(NamedTuple):
    """The state of Shampoo."""
    momentum: Any        # momentum of the grafted Shampoo update (parameter's dtype)
    graft_momentum: Any  # momentum of the graft's own update, stepped before start_preconditioning_step
    nu: Any              # the graft's second moment (parameter's real dtype; unused, zeros, with graft="sgd")
    factors: Any         # tuple: per axis, the statistics of every block (blocks x l x l, compute dtype)
    roots: Any           # tuple: per axis, their inverse roots (blocks x l x l, compute dtype)
    count: Small         # the number of gradients seen, int32


# ----------------------------------------------------------------------------------------------- blocks
def block_layout(shape: tuple[int, ...], block_size: int) -> tuple[tuple[int, int], ...]:
    """Per axis of a parameter of `shape` with 2 or more axes, `(k, l)`: `k` blocks of length `l = min(d,
    block_size)` (the last one zero-padded to `l`); `()` for a vector or a scalar (not preconditioned)."""
    if len(shape) < 2:
        return ()
    return tuple((-(-d // min(d, block_size)), min(d, block_size)) for d in shape)


def _split(a: jax.Array, layout: tuple) -> jax.Array:
    """`a` (one parameter) as its blocks, `(K, l_1, ..., l_r)`, in the reference's order (row-major over the
    blocks' indices), the last block of an axis zero-padded."""
    r = len(layout)
    a = jnp.pad(a, [(0, k * l - d) for (k, l), d in zip(layout, a.shape)])
    a = a.reshape(tuple(n for kl in layout for n in kl))
    a = a.transpose(tuple(range(0, 2 * r, 2)) + tuple(range(1, 2 * r, 2)))
    return a.reshape((-1,) + tuple(l for _, l in layout))


def _merge(b: jax.Array, shape: tuple[int, ...], layout: tuple) -> jax.Array:
    """The inverse of `_split`: blocks back to one parameter of `shape` (the padding dropped)."""
    r = len(layout)
    b = b.reshape(tuple(k for k, _ in layout) + tuple(l for _, l in layout))
    b = b.transpose(tuple(i for j in range(r) for i in (j, r + j)))
    b = b.reshape(tuple(k * l for k, l in layout))
    return b[tuple(slice(0, d) for d in shape)]


def _gram(b: jax.Array, i: int) -> jax.Array:
    """Per block, `G_(i) G_(i)ᵀ`: the block contracted with itself over every axis but `i` (blocks lead)."""
    gm = jnp.moveaxis(b, i + 1, 1).reshape(b.shape[0], b.shape[i + 1], -1)
    return gm @ jnp.swapaxes(gm, 1, 2)


def _precondition(b: jax.Array, roots: tuple) -> jax.Array:
    """Every block contracted with its inverse root along each axis (`P_1 G P_2` for a matrix)."""
    for i, q in enumerate(roots):
        b = jnp.moveaxis(jnp.einsum("k...i,kij->k...j", jnp.moveaxis(b, i + 1, -1), q), -1, i + 1)
    return b


def inverse_root(f: jax.Array, p: int, matrix_eps: jax.Array) -> jax.Array:
    """`(F + ε λ_max I)^(-1/p)` of each symmetric `F` (leading axes batch), by `eigh`: `U max(e + r, r)^(-1/p)
    Uᵀ` with `r = ε max(λ_max, 10⁻⁶)` (the reference's `matrix_inverse_pth_root_eigh`); a result that is not
    finite is NaN throughout, for the caller to keep the old root."""
    e, u = jnp.linalg.eigh(f)
    ridge = matrix_eps * jnp.maximum(e[..., -1:], 1e-6)
    inv = jnp.maximum(e + ridge, ridge) ** (-1.0 / p)
    return jnp.einsum("...ij,...j,...kj->...ik", u, inv, u)


# ----------------------------------------------------------------------------------------------- the rule
class Shampoo(Rule):
    """Shampoo (Gupta et al. 2018; distributed Shampoo, Anil et al. 2020): a Kronecker-factored preconditioner
    per block of each matrix, with the step size of a simpler optimiser grafted on. With `t` the parameter's
    number of steps before this one (0 on the first), and a matrix `G` (m x n) cut into blocks `G_b` of at most
    `block_size` x `block_size`:

    - the statistics of each block `L_b ← β₂ L_b + (1 - β₂) G_b G_bᵀ`, `R_b ← β₂ R_b + (1 - β₂) G_bᵀ G_b` (both
      `ε I` before the first gradient), and when `t` is a multiple of `precondition_every` their inverse roots
      `L_b^(-1/4)`, `R_b^(-1/4)` (the regularised `(L + ε λ_max I)^(-1/4)` by `eigh`: `inverse_root`);
    - `P = [L_b^(-1/4) G_b R_b^(-1/4)]_b`, the blocks put back together; a parameter with `r` axes has a factor
      per axis and the roots `-1/(2r)` (the reference's exponent `2r`);
    - the graft `A`: "adam" `ν ← β₂ ν + (1 - β₂) G²`, `A = G / (√(ν / (1 - β₂ᵗ⁺¹)) + ε_d)`; "rmsprop" the same
      without the bias correction; "adagrad" `ν ← ν + G²`, `A = G / (√ν + ε_d)`; "sgd" `A = G`;
    - the grafted update `S = (‖A‖ / (‖P‖ + 10⁻²⁵)) P` (Shampoo's direction, the graft's norm over the whole
      parameter), and two heavy-ball momenta `m_S ← β₁ m_S + S`, `m_A ← β₁ m_A + A`;
    - with `(U, m) = (S, m_S)` from `t >= start_preconditioning_step` on and `(A, m_A)` before, the direction
      `N = U + β₁ m` (Nesterov) or `N = m`, and `x ← x - η (N + λ x)`.

    A vector or a scalar has no factor: its step is the graft's, with its momentum (the reference's behaviour
    for a parameter it does not precondition). An axis's last block is zero-padded to `block_size` when
    `block_size` does not divide it (the padding is exact: the factors are block-diagonal in it and the step
    drops it). Real parameters only (a complex one is a `TypeError` at `setup`). A new root that is not finite
    leaves the block's old one (the reference keeps it when its error is NaN or large).

    Args:
        lr: learning rate η, default 1e-3, >= 0.
        beta: (β₁, β₂): the momentum and the decay rate of the statistics and of the graft's `ν`, default
            (0.9, 0.999), each in [0, 1).
        block_size: the longest side of a block, default 1024, an integer >= 1 (structural: it decides the
            state's shapes).
        precondition_every: the inverse roots are recomputed when `t` is a multiple of it, default 100, an
            integer >= 1 (adjustable: a step decides with `jax.lax.cond`).
        start_preconditioning_step: the first `t` whose step is Shampoo's (before it, the graft's), default 101,
            an integer >= 0.
        graft: "adam" (default), "rmsprop", "adagrad" or "sgd" (structural).
        matrix_eps: ε, relative to the largest eigenvalue of each statistic, default 1e-6, >= 0.
        weight_decay: λ, decoupled, multiplied by η, default 0.0, >= 0.
        diagonal_eps: ε_d of the graft, default 1e-10, >= 0.
        nesterov: the Nesterov direction, default True (structural).

    State: `ShampooState(momentum, graft_momentum, nu, factors, roots, count)`: `m_S`, `m_A` (the parameter's
    dtype), `ν` (zeros with "sgd"), a tuple with the statistics of every block per axis and a tuple of their
    inverse roots (blocks x l x l, the compute dtype, all starting at 0), and the number of gradients seen
    (int32). Counts are per parameter: one with no step (a `None` gradient, frozen) keeps its count and factors.

    Reference: V. Gupta, T. Koren, Y. Singer, "Shampoo: Preconditioned Stochastic Tensor Optimization", ICML
    2018, https://arxiv.org/abs/1802.09568; R. Anil, V. Gupta, T. Koren, K. Regan, Y. Singer, "Scalable Second
    Order Optimization for Deep Learning", 2020, https://arxiv.org/abs/2002.09018; H.-J. M. Shi et al., "A
    Distributed Data-Parallel PyTorch Implementation of the Distributed Shampoo Optimizer", 2023,
    https://arxiv.org/abs/2309.06497. The algorithm is precondition-opt's `distributed_shampoo`
    (https://github.com/google-research/precondition) with `preconditioning_compute_steps=precondition_every`,
    `best_effort_shape_interpretation=False` (no merging of small axes), `skip_preconditioning_rank_lt=2`,
    no `skip_preconditioning_dim_size_gt`, `eigh=True`; its "rmsprop", "adagrad" and "sgd" grafts; "adam" is
    its RMSProp graft with `ν` bias-corrected (Shi et al.'s Adam grafting). Its `decoupled_weight_decay`
    multiplies λ by η twice; here once. Its grafting norm is over the whole parameter (Shi et al.'s, per block).

    optax: none (optax 0.2.8 has no Shampoo).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.zeros((2, 2))
    >>> rule = optim.Shampoo(0.1, precondition_every=1,
    ...                      start_preconditioning_step=0)
    >>> state = optim.setup(rule, x)
    >>> state, x = optim.update(state, x, jnp.array([[4.0, 0.0], [0.0, 1.0]]))
    >>> # L = R = 0.001 G², P = L^(-1/4) G R^(-1/4) ∝ I; grafted to
    >>> # ‖A‖ = √2: S = I, and the Nesterov direction S + 0.9 S (in hundredths)
    >>> (100 * x).round()
    Array([[-19.,   0.],
           [  0., -19.]], dtype=float32)
    """

    lr: Hyper = nonneg(1e-3)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    block_size: int = static(1024)
    precondition_every: int | jax.Array = count(100)
    start_preconditioning_step: int | jax.Array = steps(101)
    graft: str = static("adam")
    matrix_eps: Hyper = nonneg(1e-6)
    weight_decay: Hyper = nonneg(0.0)
    diagonal_eps: Hyper = nonneg(1e-10)
    nesterov: bool = flag(True)
    _across = False      # per parameter: `apply_tree` only batches a stack's linear algebra
    _stack_large = True  # large parameters are stacked too: one batched eigh per shape and axis
    _hoist = False       # all stacks in one `apply_tree`, so that their eigh run one at a time

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "block_size", _hyper.whole(
            "Shampoo", "block_size", self.block_size, 1, "it is the longest side of a block"))
        if not isinstance(self.graft, str):
            raise TypeError(f"Shampoo: graft must be a string, got {type(self.graft).__name__} {self.graft!r}")
        if self.graft not in GRAFTS:
            raise ValueError(f"Shampoo: graft must be one of {', '.join(map(repr, GRAFTS))}, got {self.graft!r}")

    def init(self, x):
        if jnp.iscomplexobj(x):
            raise TypeError("Shampoo needs real parameters (its statistics are real symmetric matrices)")
        dt = compute_dtype(x)
        layout = block_layout(tuple(x.shape), self.block_size)
        k = math.prod(n for n, _ in layout)
        square = tuple(jnp.zeros((k, n, n), dt) for _, n in layout)
        return ShampooState(jnp.zeros_like(x), jnp.zeros_like(x), jnp.zeros_like(x), square, square,
                            jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        new, steps_, after = [], [], None
        for s, x, d in zip(states, xs, dxs):
            # each device steps its share of the stack's members (optim._rules.split)
            st, step = _devices.rows(lambda rule_after, s, x, g: rule_after[0]._stack(s, x, g, rule_after[1]),
                                     (self, after), s, x, d[0])
            new.append(st)
            steps_.append(step)
            after = st.roots or after
        return new, steps_

    def _graft(self, nu: jax.Array, g: jax.Array, count: jax.Array, b2: jax.Array) -> tuple:
        """The graft's new `ν` and update `A` (a stack: leading axis over the members)."""
        eps = as_compute(self.diagonal_eps, g)
        if self.graft == "sgd":
            return nu, g
        if self.graft == "adagrad":
            nu = nu + g * g
            return nu, g / (jnp.sqrt(nu) + eps)
        nu = b2 * nu + (1 - b2) * g * g
        if self.graft == "rmsprop":
            return nu, g / (jnp.sqrt(nu) + eps)
        c2 = 1 - b2 ** (count + 1).astype(g.dtype)
        return nu, g / (jnp.sqrt(nu / c2.reshape(c2.shape + (1,) * (g.ndim - 1))) + eps)

    def _stack(self, state: ShampooState, x: jax.Array, g: jax.Array, after: Any = None) -> tuple:
        """One step of a stack: `x`, `g` and every state array have a leading axis over the members. `after`: the
        previous stack's new roots, which this one's eigh wait for (`soap._one_at_a_time`)."""
        dt = compute_dtype(x)
        shape = tuple(x.shape[1:])
        layout = block_layout(shape, self.block_size)
        ms, mg, nu, factors, roots = jax.tree.map(lambda a: _replicated(a).astype(dt), tuple(state[:5]))
        x, g, count = _replicated(x), _replicated(g).astype(dt), state.count
        b1, b2 = pair_of(self.beta, x)
        nu, a = self._graft(nu, g, count, b2)
        s = a
        if layout:
            every = jnp.asarray(self.precondition_every, count.dtype)
            member = lambda args: self._member(*args, layout, as_compute(self.matrix_eps, x), b2, every, after)  # noqa: E731
            factors, roots, p = jax.lax.map(member, (g, factors, roots, count))
            norm = lambda v: jnp.sqrt(jnp.sum(v * v, axis=tuple(range(1, v.ndim)), keepdims=True))  # noqa: E731
            s = norm(a) / (norm(p) + _NORM_EPS) * p
        ms, mg = b1 * ms + s, b1 * mg + a
        run = count >= jnp.asarray(self.start_preconditioning_step, count.dtype)
        m, u = where_leading(run, ms, mg), where_leading(run, s, a)
        n = u + b1 * m if self.nesterov else m
        step = as_compute(self.lr, x) * (n + as_compute(self.weight_decay, x) * x)
        new = ShampooState(ms.astype(state.momentum.dtype), mg.astype(state.graft_momentum.dtype),
                           nu.astype(state.nu.dtype), tuple(f.astype(o.dtype) for f, o in zip(factors, state.factors)),
                           tuple(q.astype(o.dtype) for q, o in zip(roots, state.roots)), count + 1)
        return new, step

    @staticmethod
    def _member(g: jax.Array, factors: tuple, roots: tuple, count: jax.Array, layout: tuple, eps: jax.Array,
                b2: jax.Array, every: jax.Array, after: Any) -> tuple:
        """One member of a stack (`jax.lax.map` over them: each member's matrix work is the same program whatever
        the stack's size, so a stacked parameter's roots equal its own bitwise): its new statistics, its inverse
        roots (recomputed when its count is a multiple of `every`) and `P`, its preconditioned gradient."""
        blocks = _split(g, layout)
        first = count == 0      # the statistics start at ε I
        factors = tuple(b2 * jnp.where(first, eps * jnp.eye(f.shape[-1], dtype=f.dtype), f)
                        + (1 - b2) * _gram(blocks, i) for i, f in enumerate(factors))
        factors = _one_at_a_time(factors, after)
        roots = jax.lax.cond(count % every == 0, lambda: _roots(factors, roots, 2 * len(layout), eps),
                             lambda: roots)
        return factors, roots, _merge(_precondition(blocks, roots), g.shape, layout)


def _roots(factors: tuple, roots: tuple, p: int, eps: jax.Array) -> tuple:
    """The inverse `p`-th roots of one parameter's statistics (one batched `eigh` per axis, one axis at a time),
    a block's old root kept where its new one is not finite."""
    out: list = []
    for f, q in zip(factors, roots):
        if out:     # one eigh at a time (`soap._one_at_a_time`)
            f = _one_at_a_time((f,), out[-1])[0]
        new = inverse_root(f, p, eps)
        out.append(jnp.where(jnp.all(jnp.isfinite(new), axis=(-2, -1), keepdims=True), new, q))
    return tuple(out)
