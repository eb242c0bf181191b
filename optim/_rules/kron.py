"""Kron: PSGD with Kronecker-factored preconditioners (psgd-jax's `kron`).

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
Like Shampoo, Kron is defined over a stack of same-shaped parameters (`apply_tree`): each member's matrix work
(its triangular solves and products) runs in `jax.lax.map` over the members, so it is the same program whatever
the stack's size, and the stacks run one after another (`soap._one_at_a_time`). Its random numbers come from
`seed` and the parameter's count alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import hyper as _hyper
from . import split as _devices
from .._base.export import register_for_export
from .fields import Small, decay, nonneg, static, unit
from .protocol import Rule, apply_one, as_compute, compute_dtype
from .schedules import Hyper
from .soap import _one_at_a_time, _replicated

__all__ = ["Kron"]

_DAMP = float(np.sqrt(np.finfo(np.float32).eps))    # the reference's damping of the probe, whatever the dtype


@register_for_export
class KronState(NamedTuple):
    """The state of Kron."""
    mu: Any              # the momentum (parameter's dtype)
    Qs: Any              # tuple: per axis its factor Q_i, upper-triangular (d x d) or diagonal (d), compute dtype
    update_counter: Small  # steps since the preconditioner's last update, int32
    count: Small         # the number of gradients seen, int32


def triangular_axes(shape: tuple[int, ...], max_size_triangular: int) -> tuple[bool, ...]:
    """Per axis of a parameter of `shape`, whether its factor is triangular (else diagonal): an axis of length
    2 to `max_size_triangular` of a parameter with 2 or more axes. A scalar is treated as a vector of one."""
    if len(shape) < 2:
        return (False,) * max(len(shape), 1)
    return tuple(1 < d <= max_size_triangular for d in shape)


# ----------------------------------------------------------------------------------------------- one member
def _along(a: jax.Array, i: int, f) -> jax.Array:
    """`f` applied to `a` seen as a matrix with axis `i` first (`d x rest`), the result put back."""
    m = jnp.moveaxis(a, i, 0)
    return jnp.moveaxis(f(m.reshape(m.shape[0], -1)).reshape(m.shape), 0, i)


def _apply_q(qs: tuple, a: jax.Array) -> jax.Array:
    """`a` with `Q_i` applied along each axis `i` (`Q a` along it; a diagonal factor multiplies)."""
    for i, q in enumerate(qs):
        a = _along(a, i, lambda m, q=q: q[:, None] * m if q.ndim == 1 else q @ m)
    return a


def _solve_q(qs: tuple, a: jax.Array) -> jax.Array:
    """`a` with `Q_i⁻ᵀ` applied along each axis `i` (a triangular solve; a diagonal factor divides)."""
    for i, q in enumerate(qs):
        a = _along(a, i, lambda m, q=q: m / q[:, None] if q.ndim == 1 else
                   jax.lax.linalg.triangular_solve(q, m, left_side=True, lower=False, transpose_a=True))
    return a


def precondition(qs: tuple, g: jax.Array) -> jax.Array:
    """`P = g` with `Q_iᵀ Q_i` applied along each axis (a diagonal factor: `q²`)."""
    for i, q in enumerate(qs):
        a = _along(g, i, lambda m, q=q: q[:, None] ** 2 * m if q.ndim == 1 else q.T @ (q @ m))
        g = a
    return g


def _gram(a: jax.Array, i: int, triangular: bool) -> jax.Array:
    """`a_(i) a_(i)ᵀ` (contracted over every other axis), or its diagonal for a diagonal factor."""
    m = jnp.moveaxis(a, i, 0).reshape(a.shape[i], -1)
    return m @ m.T if triangular else jnp.sum(m * m, axis=1)


def norm_lower_bound(a: jax.Array) -> jax.Array:
    """A cheap lower bound of the spectral norm of the symmetric `a` (the reference's `_norm_lower_bound`):
    with `s = max|a|`, the row or column of `a / s` with the largest norm, `x`, and `s ‖(x̂ᵀ A) Aᵀ‖`, `x̂ = xᵀ A
    / ‖xᵀ A‖` (0 for `a = 0`)."""
    s = jnp.max(jnp.abs(a))
    b = a / jnp.where(s > 0, s, 1)
    col, row = jnp.sum(b * b, axis=0), jnp.sum(b * b, axis=1)
    by_col = jnp.max(col) > jnp.max(row)
    x = jnp.where(by_col, b[:, jnp.argmax(col)] @ b, b @ b[jnp.argmax(row), :])
    x = x / jnp.where(jnp.any(x != 0), jnp.linalg.norm(x), 1)
    y = jnp.where(by_col, x @ b.T, b.T @ x)
    return jnp.where(s > 0, s * jnp.linalg.norm(y), s)


def _balance(qs: tuple) -> tuple:
    """The factors rescaled to the geometric mean of their largest entries (their product unchanged)."""
    norms = [jnp.max(jnp.abs(q)) for q in qs]
    mean = jnp.prod(jnp.stack(norms)) ** (1 / len(qs))
    return tuple(q * (mean / n) for q, n in zip(qs, norms))


def _keys(seed: int, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The keys of the balancing draw and of the probe `V` at a parameter's count (the reference's, for a model
    of that one parameter, with `seed` its 5318008)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
    _, sub = jax.random.split(key)
    key, balance = jax.random.split(sub)
    _, probe = jax.random.split(key)
    return balance, jax.random.split(probe, 1)[0]


def update_qs(qs: tuple, g: jax.Array, count: jax.Array, seed: int, precond_lr: jax.Array) -> tuple:
    """One update of the factors from `g` (the bias-corrected momentum): see `Kron`."""
    balance, probe = _keys(seed, count)
    if len(qs) > 1:
        qs = jax.lax.cond(jax.random.uniform(balance) < 0.01, _balance, lambda q: q, qs)
    v = jax.random.normal(probe, g.shape, g.dtype)
    a = _apply_q(qs, g + _DAMP * jnp.mean(jnp.abs(g)) * v)
    b = _solve_q(qs, v)
    new = []
    for i, q in enumerate(qs):
        t1, t2 = _gram(a, i, q.ndim == 2), _gram(b, i, q.ndim == 2)
        tiny = jnp.finfo(q.dtype).tiny
        if q.ndim == 1:
            new.append(q - precond_lr * (t1 - t2) * q / (tiny + jnp.max(jnp.abs(t1 + t2))))
        else:
            new.append(q - precond_lr * jnp.triu(t1 - t2) / (tiny + norm_lower_bound(t1 + t2)) @ q)
    return tuple(new)


# ----------------------------------------------------------------------------------------------- the rule
class Kron(Rule):
    """PSGD Kron (Li 2018, 2024): SGD with momentum, preconditioned by `P = Qᵀ Q` with `Q = Q_1 ⊗ ... ⊗ Q_r`
    fitted online, one factor per axis of the parameter. With `t` the parameter's step (1 on the first):

    - `m ← β₁ m + (1 - β₁) g`, `m̂ = m / (1 - β₁ᵗ)`;
    - when the preconditioner updates (every step with `preconditioner_update_probability` p = 1; every
      `⌈1/p⌉`-th step otherwise, deterministically, as the reference counts): with one chance in a hundred the
      factors are first balanced (each scaled to the geometric mean of their largest entries); a probe
      `V ~ N(0, I)` and `h = m̂ + √ε₃₂ mean|m̂| V` give `A = Q h` (each `Q_i` applied along axis `i`) and
      `B = Q⁻ᵀ V`; per axis, with `T₁ = A_(i) A_(i)ᵀ`, `T₂ = B_(i) B_(i)ᵀ` (contracted over the other axes),
      `Q_i ← Q_i - η_p triu(T₁ - T₂) Q_i / ‖T₁ + T₂‖` (`‖·‖` a lower bound of the spectral norm), or for a
      diagonal factor `q ← q - η_p (T₁ - T₂) q / max|T₁ + T₂|` (the diagonals of `T`);
    - `u = Qᵀ Q m̂` (each `Q_iᵀ Q_i` along its axis), clipped to an RMS of at most 1.1: `u / max(1, RMS(u) /
      1.1)`; `x ← x - η (u + λ x)`.

    The factors start at the identity (`I` or ones). An axis of length 1 or longer than `max_size_triangular`
    has a diagonal factor, as has a vector; a scalar is a vector of one. The random numbers are drawn from keys
    derived from `seed` and the parameter's count (`jax.random.fold_in`): the same steps for the same seed,
    gradients and counts, in any model (parameters of one shape draw the same probes at the same count). Real
    parameters only (a complex one is a `TypeError` at `setup`).

    Args:
        lr: learning rate η, default 1e-3, >= 0.
        b1: momentum β₁, default 0.9, in [0, 1).
        weight_decay: λ, multiplied by η, default 0.0, >= 0.
        preconditioner_update_probability: p, default 1.0 (every step), in [0, 1] (0: never).
        max_size_triangular: the longest axis with a triangular factor, default 8192, an integer >= 0
            (structural: it decides the state's shapes).
        precond_lr: η_p, the preconditioner's learning rate, default 0.1, >= 0.
        seed: the seed of the random numbers, default 0, an integer >= 0 (structural).

    State: `KronState(mu, Qs, update_counter, count)`: the momentum `m` (the parameter's dtype, starting at 0),
    a tuple with a factor per axis (d x d upper-triangular or d, the compute dtype), the steps since the last
    preconditioner update and the number of gradients seen (int32). Counts are per parameter: one with no step
    (a `None` gradient, frozen) keeps its count, factors and random stream.

    Reference: X.-L. Li, "Preconditioned Stochastic Gradient Descent", IEEE TNNLS 2018,
    https://arxiv.org/abs/1512.04202; X.-L. Li, "Stochastic Hessian Fittings with Lie Groups", 2024,
    https://arxiv.org/abs/2402.11858. The algorithm is psgd-jax's `kron` (https://github.com/evanatyourservice/psgd_jax)
    with its defaults but for `preconditioner_update_probability` (the reference's default anneals it); its
    `precond_update_precision` and `precond_grads_precision` are not offered (the products run at JAX's default
    precision), nor `memory_save_mode`, `mu_dtype`, `precond_dtype` or `preconditioner_init_scale` (1). Its
    random key is derived from a fixed seed (5318008) and the global count, split per leaf of the tree; here
    from `seed` and the parameter's count, the same for a model of one parameter.

    optax: none (optax 0.2.8 has no PSGD); `psgd_jax.kron` is an optax transformation.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.zeros((2, 2))
    >>> state = optim.setup(optim.Kron(0.1), x)
    >>> g = jnp.array([[0.5, 0.0], [0.0, 0.5]])
    >>> state, x = optim.update(state, x, g)
    >>> # m̂ = g; Q moved once from I (a random probe): the step η Qᵀ Q g is
    >>> # near η g
    >>> bool(jnp.allclose(x, -0.1 * g, atol=0.02))
    True
    """

    lr: Hyper = nonneg(1e-3)
    b1: Hyper = unit(0.9)
    weight_decay: Hyper = nonneg(0.0)
    preconditioner_update_probability: Hyper = decay(1.0)
    max_size_triangular: int = static(8192)
    precond_lr: Hyper = nonneg(0.1)
    seed: int = static(0)
    _across = False      # per parameter: `apply_tree` only orders the stacks' linear algebra
    _stack_large = True  # large parameters are stacked too: one program per shape
    _hoist = False       # all stacks in one `apply_tree`, so that their solves run one at a time

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "max_size_triangular", _hyper.whole(
            "Kron", "max_size_triangular", self.max_size_triangular, 0, "it is the longest triangular axis"))
        object.__setattr__(self, "seed", _hyper.whole("Kron", "seed", self.seed, 0))

    def init(self, x):
        if jnp.iscomplexobj(x):
            raise TypeError("Kron needs real parameters")
        dt = compute_dtype(x)
        shape = tuple(x.shape) or (1,)
        qs = tuple(jnp.eye(d, dtype=dt) if tri else jnp.ones((d,), dt)
                   for d, tri in zip(shape, triangular_axes(tuple(x.shape), self.max_size_triangular)))
        return KronState(jnp.zeros_like(x), qs, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        new, steps, after = [], [], None
        for s, x, d in zip(states, xs, dxs):
            # each device steps its share of the stack's members (optim._rules.split)
            st, step = _devices.rows(lambda rule_after, s, x, g: rule_after[0]._stack(s, x, g, rule_after[1]),
                                     (self, after), s, x, d[0])
            new.append(st)
            steps.append(step)
            after = st.Qs
        return new, steps

    def _stack(self, state: KronState, x: jax.Array, g: jax.Array, after: Any) -> tuple:
        """One step of a stack (leading axis over the members); `after`: the previous stack's factors, which
        this one's solves wait for (`soap._one_at_a_time`)."""
        dt = compute_dtype(x)
        mu, qs = jax.tree.map(lambda a: _replicated(a).astype(dt), (state.mu, state.Qs))
        x, g, count = _replicated(x), _replicated(g).astype(dt), state.count
        b1, lr_p = as_compute(self.b1, x), as_compute(self.precond_lr, x)
        mu = b1 * mu + (1 - b1) * g
        t = (count + 1).astype(dt)
        mhat = mu / (1 - b1 ** t).reshape(t.shape + (1,) * (x.ndim - 1))
        counter = state.update_counter + 1
        update = counter.astype(dt) >= 1 / as_compute(self.preconditioner_update_probability, x)
        counter = jnp.where(update, 0, counter)
        qs = _one_at_a_time(qs, after)

        def member(args):
            m, q, n, up = args
            m = m.reshape(m.shape or (1,))
            q = jax.lax.cond(up, lambda: update_qs(q, m, n, self.seed, lr_p), lambda: q)
            return q, precondition(q, m)

        qs, u = jax.lax.map(member, (mhat, qs, count, update))
        u = u.reshape(x.shape)
        rms = jnp.sqrt(jnp.mean(u * u, axis=tuple(range(1, u.ndim)), keepdims=True))
        u = u / jnp.maximum(1, rms / 1.1)
        step = as_compute(self.lr, x) * (u + as_compute(self.weight_decay, x) * x)
        new = KronState(mu.astype(state.mu.dtype), tuple(q.astype(o.dtype) for q, o in zip(qs, state.Qs)),
                        counter, count + 1)
        return new, step
