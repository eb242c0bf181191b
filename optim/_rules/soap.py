"""SOAP: Adam run in the eigenbasis of Shampoo's Kronecker-factored preconditioner.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
SOAP is defined over a stack of same-shaped parameters (`apply_tree`), so that the eigendecompositions, QR
factorisations and matrix products of a stack are one batched operation each, and a refresh that no member of
the stack needs is skipped (`jax.lax.cond` on the whole stack; members that do not refresh keep their basis).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import hyper as _hyper
from . import split as _devices
from .._base.export import register_for_export
from .fields import Small, count, flag, nonneg, static, unit
from .protocol import Rule, apply_one, as_compute, compute_dtype, eps_of, pair_of, where_leading
from .schedules import Hyper

__all__ = ["SOAP"]


@register_for_export
class SOAPState(NamedTuple):
    """The state of SOAP."""
    exp_avg: Any         # first moment, in the rotated basis (parameter's real dtype)
    exp_avg_sq: Any      # second moment, in the rotated basis (parameter's real dtype)
    factors: Any         # tuple: per preconditioned axis, its Kronecker factor (d x d, compute dtype)
    bases: Any           # tuple: per preconditioned axis, the eigenbasis of its factor (d x d, compute dtype)
    count: Small         # the number of gradients seen, int32 (0: the next one only builds factors and bases)


def preconditioned_axes(shape: tuple[int, ...], max_precond_dim: int, precondition_1d: bool) -> tuple[int, ...]:
    """The axes of a parameter of `shape` that SOAP preconditions (the reference's `merge_dims=False`): every
    axis of length <= `max_precond_dim` of a parameter with 2 or more axes; the one axis of a vector only with
    `precondition_1d`; none of a scalar."""
    if len(shape) == 1 and not precondition_1d:
        return ()
    return tuple(i for i, n in enumerate(shape) if n <= max_precond_dim)


# ----------------------------------------------------------------------------------------------- one parameter
def _rotate(a: jax.Array, bases: tuple, axes: tuple[int, ...], back: bool = False) -> jax.Array:
    """`a` in the bases (`back`: from them): axis `i` contracted with `Q[:, k]` (`Qᵀ a` along that axis), or
    with `Q[k, :]` going back (`Q a`)."""
    for q, i in zip(bases, axes):
        a = jnp.moveaxis(jnp.tensordot(a, q, axes=([i], [1 if back else 0])), -1, i)
    return a


def _outer(g: jax.Array, axes: tuple[int, ...]) -> tuple:
    """Per axis `i`: `G_(i) G_(i)ᵀ`, the gradient contracted with itself over every other axis."""
    out = []
    for i in axes:
        gm = jnp.moveaxis(g, i, 0).reshape(g.shape[i], -1)
        out.append(gm @ gm.T)
    return tuple(out)


def _eigenbasis(m: jax.Array) -> jax.Array:
    """The eigenvectors of the symmetric `m + 1e-30 I` (its lower triangle, as LAPACK's), largest eigenvalue
    first."""
    _, q = jnp.linalg.eigh(m + 1e-30 * jnp.eye(m.shape[0], dtype=m.dtype), symmetrize_input=False)
    return q[:, ::-1]


def _power_step(factors: tuple, bases: tuple, v: jax.Array, axes: tuple[int, ...]) -> tuple[tuple, jax.Array]:
    """The reference's refresh of the bases: per axis, the old basis's columns sorted by their estimated
    eigenvalues `diag(Qᵀ L Q)` (largest first, `v`'s entries along that axis permuted alike), then one power
    iteration `Q ← qr(L Q)`."""
    new: list = []
    for m, o, i in zip(factors, bases, axes):
        if new:     # one QR at a time (`_one_at_a_time`)
            (m,) = _one_at_a_time((m,), new[-1])
        est = jnp.sum(o * (m @ o), axis=0)
        order = jnp.argsort(est, descending=True, stable=True)
        v = jnp.take(v, order, axis=i)
        new.append(jnp.linalg.qr(m @ o[:, order])[0])
    return tuple(new), v


def _one_at_a_time(factors: tuple, after: Any) -> tuple:
    """`factors`, available only once `after` (the bases the previous stack's eigh / qr computed) is: jaxlib's CPU
    LAPACK kernels (jax 0.10) split a batched eigh or qr over XLA's thread pool and block until it is done, so
    as many such calls running at once as the pool has threads (2 on a 2-core machine: a stack's L and R) wait
    for each other for ever. SOAP's run one after another (within a stack too), leaving the pool free. The
    dependence is data (`+ 0 · a`, with `a` one finite number of `after`: adding ±0 leaves every value as it
    is): XLA:CPU removes optimization barriers before it schedules, and runs what does not depend at once."""
    if after is None or not factors:
        return factors
    a = jax.tree.leaves(after)[-1]
    zero = jnp.nan_to_num(a.reshape(-1)[0]) * 0
    return tuple(f + zero.astype(f.dtype) for f in factors)


def _replicated(a: jax.Array) -> jax.Array:
    """`a` replicated over its mesh where its sharding is part of its type and splits it (ZeRO-1's state on
    Explicit mesh axes): the products contract the axes such a sharding splits, which JAX refuses to type."""
    s = getattr(jax.typeof(a), "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding) or s.mesh.empty or all(d is None for d in s.spec):
        return a
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec()))


class SOAP(Rule):
    """SOAP (Vyas et al. 2025): Adam in the eigenbasis of Shampoo's preconditioner. For a matrix `G` (m x n) the
    factors `L ← β_s L + (1 - β_s) G Gᵀ`, `R ← β_s R + (1 - β_s) Gᵀ G` have eigenbases `Q_L`, `Q_R`; with
    `t` the parameter's number of steps,

    - `G' = Q_Lᵀ G Q_R`, `m ← β₁ m + (1 - β₁) G'`, `v ← β₂ v + (1 - β₂) G'²` (the moments live in the rotated
      basis), `N = Q_L (m / (√v + ε)) Q_Rᵀ`, with `normalize_grads` `N ← N / (10⁻³⁰ + RMS(N))`;
    - `x ← x - η_t N` with `η_t = η √(1 - β₂ᵗ) / (1 - β₁ᵗ)` (η without `correct_bias`), then
      `x ← x - η λ x` (decoupled weight decay on the updated parameter);
    - then `L`, `R` take the gradient, and every `precondition_frequency` steps the bases are refreshed by one
      power iteration: the columns of `Q` sorted by `diag(Qᵀ L Q)` (the axis of `v` permuted alike),
      `Q ← qr(L Q)`, and `m` rotated into the new basis.

    The first gradient of a parameter takes no step: it builds `L`, `R` and their eigenbases (`eigh`, largest
    eigenvalue first), so that no step uses its own gradient in its basis; the count still advances. A parameter
    with more axes has a factor per axis (`G` contracted with itself over the others), an axis longer than
    `max_precond_dim` has none (the identity basis), a vector has one only with `precondition_1d`, and a scalar
    none (Adam with the first step skipped). The reference's `merge_dims` is not offered (`merge_dims=False`).
    Real parameters only (a complex one is a `TypeError` at `setup`).

    Args:
        lr: learning rate η, default 3e-3, >= 0.
        beta: decay rates (β₁, β₂) of Adam's moments, default (0.95, 0.95), each in [0, 1).
        shampoo_beta: β_s, the decay rate of the factors, default None (β₂), in [0, 1). None or a number is
            a different program (adjusting between them retraces); a number is adjustable.
        eps: ε, default 1e-8, >= 0 (at least 1e-7 for 16-bit parameters), added to `√v`.
        weight_decay: λ, decoupled, multiplied by η (not `η_t`), default 0.01, >= 0.
        precondition_frequency: the bases are refreshed when the count of steps is a multiple of it, default 10,
            an integer >= 1 (adjustable: a step decides with `jax.lax.cond`).
        max_precond_dim: the longest axis that gets a factor, default 10000, an integer >= 0 (structural: it
            decides the state's shapes).
        precondition_1d: give vectors a factor too, default False; structural.
        normalize_grads: divide `N` by its RMS, default False; structural.
        correct_bias: Adam's bias correction `√(1 - β₂ᵗ) / (1 - β₁ᵗ)`, default True; structural.

    State: `SOAPState(exp_avg, exp_avg_sq, factors, bases, count)`: the moments `m`, `v` in the rotated basis
    (the parameter's real dtype, starting at 0), a tuple with one factor per preconditioned axis and a tuple of
    their bases (d x d, in the compute dtype, starting at 0), and the number of gradients seen (int32, starting
    at 0). Counts are per parameter: one with no step (a `None` gradient, frozen) keeps its count and bases.

    Reference: N. Vyas, D. Morwani, R. Zhao, M. Kwun, I. Shapira, D. Brandfonbrener, L. Janson, S. Kakade,
    "SOAP: Improving and Stabilizing Shampoo using Adam", ICLR 2025, https://arxiv.org/abs/2409.11321; the
    authors' implementation (whose algorithm and defaults this follows, computing in the parameter's dtype where
    it casts to float32 for `eigh` and `qr`): https://github.com/nikhilvyas/SOAP (`soap.py`). Where it projects
    `m` back and forth with an unchanged basis (`Qᵀ Q = I`), that round trip is skipped.

    optax: none (optax has no SOAP).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.zeros((2, 2))
    >>> state = optim.setup(optim.SOAP(0.1, weight_decay=0.0), x)
    >>> g = jnp.array([[2.0, 0.0], [0.0, 1.0]])
    >>> state, x = optim.update(state, x, g)
    >>> # the first gradient only builds L = R = 0.05 g², and Q_L = Q_R =
    >>> # eigenvectors
    >>> x
    Array([[0., 0.],
           [0., 0.]], dtype=float32)
    >>> state, x = optim.update(state, x, g)
    >>> # then an Adam step in that basis: η √(1 - β₂) / (1 - β₁) · (1 - β₁) G' /
    >>> # (√(1 - β₂) |G'|)
    >>> x.round(3)
    Array([[-0.1,  0. ],
           [ 0. , -0.1]], dtype=float32)
    """

    lr: Hyper = nonneg(3e-3)
    beta: tuple[Hyper, Hyper] = unit((0.95, 0.95))
    shampoo_beta: Hyper | None = unit(None)
    eps: Hyper = nonneg(1e-8)
    weight_decay: Hyper = nonneg(0.01)
    precondition_frequency: int | jax.Array = count(10)
    max_precond_dim: int = static(10000)
    precondition_1d: bool = flag(False)
    normalize_grads: bool = flag(False)
    correct_bias: bool = flag(True)
    _across = False      # per parameter: `apply_tree` only batches a stack's linear algebra
    _stack_large = True  # large parameters are stacked too: one batched eigh / qr per shape
    _hoist = False       # all stacks in one `apply_tree`, so that their eigh / qr run one at a time

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "max_precond_dim", _hyper.whole(
            "SOAP", "max_precond_dim", self.max_precond_dim, 0, "it is the longest axis that gets a factor"))

    @classmethod
    def _checked(cls, name: str, v: Any) -> Any:
        if name == "shampoo_beta" and v is None:
            return None
        return super()._checked(name, v)

    def _axes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return preconditioned_axes(tuple(shape), self.max_precond_dim, self.precondition_1d)

    def init(self, x):
        if jnp.iscomplexobj(x):
            raise TypeError("SOAP needs real parameters (its factors are real symmetric matrices)")
        dt = compute_dtype(x)
        square = tuple(jnp.zeros((x.shape[i], x.shape[i]), dt) for i in self._axes(x.shape))
        return SOAPState(jnp.zeros_like(x), jnp.zeros_like(x), square, square, jnp.zeros((), jnp.int32))

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
            after = st.bases or after
        return new, steps

    def _stack(self, state: SOAPState, x: jax.Array, g: jax.Array, after: Any = None) -> tuple[SOAPState, jax.Array]:
        """One step of a stack: `x`, `g` and every state array have a leading axis over the members. `after`: the
        previous stack's new bases, which this one's eigh / qr wait for (`_one_at_a_time`)."""
        c = lambda v: as_compute(v, x)   # noqa: E731
        dt = c(0).dtype
        axes = self._axes(x.shape[1:])
        m, v, factors, bases = jax.tree.map(lambda a: _replicated(a).astype(dt), tuple(state[:4]))
        x, g, count = _replicated(x), _replicated(g).astype(dt), state.count
        b1, b2 = pair_of(self.beta, x)
        bs = b2 if self.shampoo_beta is None else c(self.shampoo_beta)
        into = jax.vmap(lambda a, q: _rotate(a, q, axes))
        back = jax.vmap(lambda a, q: _rotate(a, q, axes, back=True))
        first = count == 0                       # per member: only build the factors and bases
        # Adam in the rotated basis (a first member's bases are 0: its moments stay 0)
        gp = into(g, bases)
        m = b1 * m + (1 - b1) * gp
        v = b2 * v + (1 - b2) * gp * gp
        u = back(m / (jnp.sqrt(v) + eps_of(self.eps, x)), bases)
        if self.normalize_grads:
            rms = jnp.sqrt(jnp.mean(u * u, axis=tuple(range(1, u.ndim)), keepdims=True))
            u = u / (1e-30 + rms)
        lr = c(self.lr)
        size = lr
        if self.correct_bias:
            t = jnp.maximum(count, 1).astype(dt)    # the reference's step, after its increment
            size = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            size = size.reshape(size.shape + (1,) * (x.ndim - 1))
        step = size * u
        step = step + lr * c(self.weight_decay) * (x - step)
        step = where_leading(first, jnp.zeros_like(step), step)
        m, v = (where_leading(first, jnp.zeros_like(a), a) for a in (m, v))
        # the preconditioner takes the gradient after the step
        factors = tuple(f + (1 - bs) * (o - f) for f, o in zip(factors, jax.vmap(lambda a: _outer(a, axes))(g)))
        factors = _one_at_a_time(factors, after)
        if axes:
            bases = self._bases(first, factors, bases)
            refresh = ~first & (count % jnp.asarray(self.precondition_frequency, count.dtype) == 0)
            bases, m, v = jax.lax.cond(jnp.any(refresh),
                                       lambda: self._refresh(refresh, factors, bases, m, v, into, back),
                                       lambda: (bases, m, v))
        new = SOAPState(m.astype(state.exp_avg.dtype), v.astype(state.exp_avg_sq.dtype),
                        tuple(f.astype(o.dtype) for f, o in zip(factors, state.factors)),
                        tuple(q.astype(o.dtype) for q, o in zip(bases, state.bases)), count + 1)
        return new, step

    @staticmethod
    def _bases(first: jax.Array, factors: tuple, bases: tuple) -> tuple:
        """The eigenbases of the members' first gradients (one batched `eigh` per factor), skipped when no
        member of the stack takes its first gradient."""
        def build():
            out: list = []
            for f, q in zip(factors, bases):
                if out:     # one eigh at a time (`_one_at_a_time`)
                    f = _one_at_a_time((f,), out[-1])[0]
                out.append(where_leading(first, jax.vmap(_eigenbasis)(f), q))
            return tuple(out)
        return jax.lax.cond(jnp.any(first), build, lambda: bases)

    def _refresh(self, refresh, factors, bases, m, v, into, back):
        """The refreshed bases, `m` rotated into them and `v` re-sorted, for the members in `refresh`."""
        axes = self._axes(m.shape[1:])
        new_bases, new_v = jax.vmap(lambda f, q, a: _power_step(f, q, a, axes))(factors, bases, v)
        new_m = into(back(m, bases), new_bases)
        pick = lambda a, b: where_leading(refresh, a, b)    # noqa: E731
        return tuple(map(pick, new_bases, bases)), pick(new_m, m), pick(new_v, v)
