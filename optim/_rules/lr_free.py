"""Learning-rate-free rules that estimate their step size from the whole model: `Prodigy` and `DoG`.

Both keep a few global numbers (Prodigy's `d`, DoG's `r̄` and `G`) that one sum over every parameter updates.
optim's state is per parameter, so every parameter's state holds a *copy* of them, stamped with `t`, the number
of whole-model steps that copy belongs to. `apply_tree` (see `optim._rules.protocol.apply_all`) sees the states
of the parameters that step in this update: it takes the copy with the largest stamp (the first such row where
several have it), steps, and writes the new numbers, stamped `t + 1`, into every stepping parameter's state. A
parameter that does not step (a `None` gradient, frozen) keeps its old copy, which is then stale and is never
read while a fresher one steps beside it.

The rest follows `ClipGlobalNorm`: each sum covers the parameters that share the rule and step now, each
counted once with the summed gradient of its tie group (a parameter with a `None` gradient does not count, in
the gradient sums nor in the sums over `x - x₀`); members of a stack are counted one by one (a stack's arrays
carry a leading member axis, and the sums run over it too); with a rule per leaf (`by_path`), each distinct
rule instance has its own global numbers over its own parameters.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._base.export import register_for_export
from . import hyper as _hyper
from .fields import Small, flag, nonneg, unit
from .protocol import Rule, abs2, apply_one, compute_dtype
from .schedules import Hyper

__all__ = ["Prodigy", "DoG"]


# ----------------------------------------------------------------------------------------------- helpers
def _widest(xs: list) -> Any:
    """The dtype the global numbers are computed in: the widest compute dtype of the parameters (float32 at
    least), so that a bfloat16 parameter does not round what a float32 one steps with."""
    return functools.reduce(jnp.promote_types, [compute_dtype(x) for x in xs], jnp.dtype(jnp.float32))


def _freshest(states: list, names: tuple, dtype: Any) -> tuple[jax.Array, list]:
    """`(t, values)`: the stamp and the copies of the global numbers `names` of the row (over every stack's rows)
    with the largest stamp `t`."""
    rows = lambda a: jnp.concatenate([jnp.reshape(getattr(s, a), (-1,)) for s in states])   # noqa: E731
    t = rows("t").astype(jnp.int32)
    k = jnp.argmax(t)
    return t[k], [rows(n)[k].astype(dtype) for n in names]


def _total(parts: list, dtype: Any) -> jax.Array:
    """The sum of every entry of `parts` (one array per stack, members included), accumulated in `dtype`."""
    return sum((jnp.sum(p.astype(dtype)) for p in parts), jnp.zeros((), dtype))


def _copy(v: jax.Array, like: jax.Array) -> jax.Array:
    """The global number `v` as a stack's copies (one per row, in the state's dtype)."""
    return jnp.broadcast_to(v.astype(like.dtype), jnp.shape(like))


def _real_only(name: str, x: jax.Array) -> None:
    if jnp.iscomplexobj(x):
        raise TypeError(f"{name} needs real parameters (its global sums are over real gradients)")


# ----------------------------------------------------------------------------------------------- Prodigy
@register_for_export
class ProdigyState(NamedTuple):
    """The state of Prodigy (per parameter; `d`, `numerator` and `t` are copies of global numbers)."""
    mu: Any              # m: the moving average of d·g
    nu: Any              # v: the moving average of (d·g)²
    s: Any               # the weighted sum of the scaled gradients
    x0: Any              # the parameter at setup
    d: Small             # the copy of the step size estimate d (0-d; not read while t = 0)
    numerator: Small     # the copy of the weighted numerator r of d's estimate (0-d)
    t: Small             # the number of whole-model steps this copy belongs to, int32


class Prodigy(Rule):
    """Prodigy, D-Adapt Adam with a faster estimate of the step size `d`. With `k = t + 1` the whole-model step
    (`t` the stamp, see the module docstring), `d` starting at `d₀`, and `Σ` over every entry of every stepping
    parameter:

        λ = η d √(1 - β₂ᵏ) / (1 - β₁ᵏ),
        m ← β₁ m + (1 - β₁) d g,     v ← β₂ v + (1 - β₂) d² g²,
        s ← β₃ s + (c / d₀) d g   with c = λ, or c = d with `safeguard_warmup`,
        r ← β₃ r + (d / d₀) λ Σ g (x₀ - x),     d' = max(d, κ r / Σ|s|),
        step = λ m / (√v + d' ε) + λ w x,

    and `d ← d'` (kept where `Σ|s| = 0`, which would make it 0 / 0). `η` scales the estimate: a schedule with
    base 1 (a linear decay, a warmup) is what the paper recommends.

    Global numbers (`d`, `r`, the count `k`) are kept per parameter as stamped copies: each parameter's state
    holds them, the freshest copy among the parameters that step is used and the new numbers are written to all
    of them (a parameter with a `None` gradient or frozen keeps a stale copy; it does not count in the sums, and
    its `m`, `v`, `s` wait). Each parameter counts once, with its tie-summed gradient (like `ClipGlobalNorm`);
    stacked parameters count member by member; with `by_path`, each distinct Prodigy instance adapts its own `d`.
    Real parameters only (a complex one is a `TypeError` at `setup`).

    Args:
        lr: η, default 1.0, >= 0: multiplies the estimated step size.
        beta: (β₁, β₂), default (0.9, 0.999), each in [0, 1).
        beta3: β₃, the decay of `s` and `r`, default None (√β₂, following β₂ when it is a schedule); a number
            in [0, 1). None or a number is structural (it changes the program); the number is adjustable.
        eps: ε, default 1e-8, >= 0, scaled by `d'`.
        estim_lr0: d₀, the initial (under-)estimate of d, default 1e-6, > 0 (read as d at the first step; the
            updates of `s` and `r` divide by its current value).
        estim_lr_coef: κ, which multiplies each new estimate, default 1.0, >= 0.
        weight_decay: w, decoupled (multiplied by λ, AdamW's convention), default 0.0, >= 0.
        safeguard_warmup: leave η out of the sum `s` (c = d), for a warmup of η; default False (structural).

    State: `ProdigyState(mu, nu, s, x0, d, numerator, t)`: `m`, `v`, `s` (the parameter's dtype, 0 at first),
    the parameter at setup, and the copies of `d`, `r` (0-d, the compute dtype) and the stamp `t` (int32, 0).

    Reference: K. Mishchenko, A. Defazio, "Prodigy: An Expeditiously Adaptive Parameter-Free Learner", 2023,
    https://arxiv.org/abs/2306.06101

    optax: equals `optax.contrib.prodigy(η, (β₁, β₂), β₃, ε, d₀, κ, w, safeguard_warmup)` on an untied model
    whose parameters all step; optax counts a tied weight once per position, with each position's gradient, and
    gives NaN where `Σ|s| = 0` (here d is kept).

    >>> import jax.numpy as jnp, optim
    >>> m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array(-1.0)}
    >>> state = optim.setup(optim.Prodigy(estim_lr0=0.1), m)
    >>> g = {"a": jnp.array([0.5, -1.0]), "b": jnp.array(2.0)}
    >>> state, m = optim.update(state, m, g)
    >>> # Adam's first step, sign(g), times η d₀ = 0.1
    >>> m["a"].round(4), m["b"].round(4)
    (Array([0.9, 2.1], dtype=float32), Array(-1.1, dtype=float32))
    >>> for _ in range(5):
    ...     state, m = optim.update(state, m, g)
    >>> # the gradient kept its direction: d grew from d₀ = 0.1
    >>> round(float(state["b"].state.d), 3)
    0.301
    """

    lr: Hyper = nonneg(1.0)
    beta: tuple[Hyper, Hyper] = unit((0.9, 0.999))
    beta3: Hyper | None = unit(None)
    eps: Hyper = nonneg(1e-8)
    estim_lr0: Hyper = 1e-6
    estim_lr_coef: Hyper = nonneg(1.0)
    weight_decay: Hyper = nonneg(0.0)
    safeguard_warmup: bool = flag(False)
    _across = True      # one d over the parameters that share the rule (see `protocol.looks_across`)

    @classmethod
    def _checked(cls, name: str, v: Any) -> Any:
        if name == "beta3" and v is None:
            return None
        if name == "estim_lr0":     # divided by: > 0
            return _hyper.hyper(cls.__name__, name, v, "positive")
        return super()._checked(name, v)

    def init(self, x):
        _real_only("Prodigy", x)
        zero = jnp.zeros((), compute_dtype(x))
        return ProdigyState(jnp.zeros_like(x), jnp.zeros_like(x), jnp.zeros_like(x), jnp.array(x, copy=True),
                            zero, zero, jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        if not xs:
            return [], []
        dt = _widest(xs)
        c = lambda v: jnp.asarray(v, dt)   # noqa: E731
        b1, b2 = c(self.beta[0]), c(self.beta[1])
        b3 = jnp.sqrt(b2) if self.beta3 is None else c(self.beta3)
        d0 = c(self.estim_lr0)
        t, (d, r) = _freshest(states, ("d", "numerator"), dt)
        d = jnp.where(t == 0, d0, d)       # d₀ is read at the first step: it may be a schedule, or adjusted
        r = jnp.where(t == 0, 0, r)
        k = (t + 1).astype(dt)
        lam = d * c(self.lr) * jnp.sqrt(1 - b2 ** k) / (1 - b1 ** k)
        gs = [ds[0].astype(dt) for ds in dxs]
        r = b3 * r + (d / d0) * lam * _total([g * (s.x0.astype(dt) - x.astype(dt))
                                              for g, s, x in zip(gs, states, xs)], dt)
        scale = (d if self.safeguard_warmup else lam) / d0
        ms = [b1 * s.mu.astype(dt) + (1 - b1) * (d * g) for s, g in zip(states, gs)]
        vs = [b2 * s.nu.astype(dt) + (1 - b2) * (d * g) * (d * g) for s, g in zip(states, gs)]
        ss = [b3 * s.s.astype(dt) + scale * (d * g) for s, g in zip(states, gs)]
        den = _total([jnp.abs(s) for s in ss], dt)
        d_new = jnp.where(den > 0, jnp.maximum(d, c(self.estim_lr_coef) * r / jnp.where(den > 0, den, 1)), d)
        wd, eps = c(self.weight_decay), c(self.eps)
        steps = [lam * m / (jnp.sqrt(v) + d_new * eps) + wd * lam * x.astype(dt) for m, v, x in zip(ms, vs, xs)]
        new = [ProdigyState(m.astype(s.mu.dtype), v.astype(s.nu.dtype), u.astype(s.s.dtype), s.x0,
                            _copy(d_new, s.d), _copy(r, s.numerator), _copy(t + 1, s.t))
               for s, m, v, u in zip(states, ms, vs, ss)]
        return new, steps


# ----------------------------------------------------------------------------------------------- DoG
@register_for_export
class DoGState(NamedTuple):
    """The state of DoG (per parameter; `r`, `g2` and `t` are copies of global numbers)."""
    x0: Any              # the parameter at setup
    r: Small             # the copy of r̄, the largest distance from x₀ so far (0-d)
    g2: Small            # the copy of G, the sum of the squared gradient norms so far (0-d)
    t: Small             # the number of whole-model steps this copy belongs to, int32


class DoG(Rule):
    """DoG, Distance over Gradients: SGD whose step size is the largest distance travelled over the root of the
    summed squared gradient norms, with the norms over the whole model:

        r̄ ← max(r̄, ‖x - x₀‖, r_ε),     G ← G + ‖g‖²,     step = η (r̄ / √(G + ε)) g,

    with `r_ε = reps_rel (1 + ‖x₀‖)` (the paper's heuristic; r̄ starts at 0, and `r_ε` is taken in at every step,
    so r̄ ≥ r_ε also after `adjust` or under a schedule; r̄ never decreases). With `init_learning_rate` `v` instead,
    `r_ε = 0` and the first step is `η v g`. `‖·‖` is the 2-norm over every stepping parameter.

    Global numbers (`r̄`, `G`, whether it is the first step) are kept per parameter as stamped copies: each
    parameter's state holds them, the freshest copy among the parameters that step is used and the new numbers
    are written to all of them (a parameter with a `None` gradient or frozen keeps a stale copy and counts in no
    norm: neither its gradient, nor its `x - x₀`, nor its `x₀` in `r_ε`). Each parameter counts once, with its
    tie-summed gradient (like `ClipGlobalNorm`); stacked parameters count member by member; with `by_path`,
    each distinct DoG instance has its own step size. Real parameters only (a complex one is a `TypeError` at
    `setup`).

    Args:
        lr: η, default 1.0, >= 0: multiplies the step size (a schedule, or 1).
        reps_rel: the relative initial distance in `r_ε`, default 1e-6, >= 0 (the paper suggests 1e-4 with
            batch normalisation); not used when `init_learning_rate` is given.
        eps: ε, added to G, default 1e-8, >= 0.
        init_learning_rate: v, the step size of the first step, default None (the heuristic `r_ε`); a number
            >= 0. None or a number is structural; the number is adjustable.

    State: `DoGState(x0, r, g2, t)`: the parameter at setup, the copies of r̄ and G (0-d, the compute dtype,
    starting at 0) and the stamp `t` (int32, 0).

    Reference: M. Ivgi, O. Hinder, Y. Carmon, "DoG is SGD's Best Friend: A Parameter-Free Dynamic Step Size
    Schedule", ICML 2023, https://arxiv.org/abs/2302.12022

    optax: equals `optax.contrib.dog(η, init_step=("heuristic", reps_rel), eps=ε)`, or with
    `init_learning_rate=v` `init_step=("learning_rate", v)`, on an untied model whose parameters all step
    (optax's `weight_decay` is `chain(WeightDecay(w), DoG())` here); optax counts a tied weight once per
    position, with each position's gradient.

    >>> import jax.numpy as jnp, optim
    >>> m = {"a": jnp.array([3.0, 0.0]), "b": jnp.array(4.0)}
    >>> state = optim.setup(optim.DoG(reps_rel=0.1), m)
    >>> g = {"a": jnp.array([1.0, 0.0]), "b": jnp.array(0.0)}
    >>> state, m = optim.update(state, m, g)
    >>> m              # r_ε = 0.1 (1 + ‖x₀‖) = 0.6 and ‖g‖ = 1: a step of 0.6 g
    {'a': Array([2.4, 0. ], dtype=float32), 'b': Array(4., dtype=float32)}
    """

    lr: Hyper = nonneg(1.0)
    reps_rel: Hyper = nonneg(1e-6)
    eps: Hyper = nonneg(1e-8)
    init_learning_rate: Hyper | None = nonneg(None)
    _across = True      # one step size over the parameters that share the rule

    @classmethod
    def _checked(cls, name: str, v: Any) -> Any:
        if name == "init_learning_rate" and v is None:
            return None
        return super()._checked(name, v)

    def init(self, x):
        _real_only("DoG", x)
        zero = jnp.zeros((), compute_dtype(x))
        return DoGState(jnp.array(x, copy=True), zero, zero, jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        if not xs:
            return [], []
        dt = _widest(xs)
        c = lambda v: jnp.asarray(v, dt)   # noqa: E731
        t, (r, g2) = _freshest(states, ("r", "g2"), dt)
        x0s = [s.x0.astype(dt) for s in states]
        dist = jnp.sqrt(_total([abs2(a - x.astype(dt)) for a, x in zip(x0s, xs)], dt))
        r = jnp.maximum(r, dist)
        if self.init_learning_rate is None:
            r = jnp.maximum(r, c(self.reps_rel) * (1 + jnp.sqrt(_total([abs2(a) for a in x0s], dt))))
        gs = [ds[0].astype(dt) for ds in dxs]
        g2 = g2 + _total([abs2(g) for g in gs], dt)
        size = r / jnp.sqrt(g2 + c(self.eps))
        if self.init_learning_rate is not None:
            size = jnp.where(t == 0, c(self.init_learning_rate), size)
        lr = c(self.lr)
        new = [DoGState(s.x0, _copy(r, s.r), _copy(g2, s.g2), _copy(t + 1, s.t)) for s in states]
        return new, [lr * (size * g) for g in gs]
