"""Rules made of rules, and rules that look at the whole model.

`OptimiserChain` (`chain`) runs rules in sequence, `AccumGrad` turns `n` calls into one step, `MixedPrecision`
keeps a high-precision master copy, `ClipGlobalNorm` and `SkipNonFinite` look across all the parameters that
share the rule, and so does `SkipLargeUpdates`, which skips a step whose gradient norm is an outlier. Those that
look across parameters implement `apply_tree` over stacks of parameters (see `optim._rules.protocol.apply_all`); their
per-parameter `apply` is `apply_one`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._base.export import register_for_export
from .average import refuse_ema_in_chain
from .fields import count, nonneg, static, steps, unit
from .schedules import Hyper
from .protocol import (Gated, Replace, Rule, compute_dtype, apply_all, apply_one, apply_step, average_of,
                       clip_factor, gate_state, inner_rules, is_rule, skip_unless, sum_squares, where)

__all__ = ["OptimiserChain", "chain", "AccumGrad", "MixedPrecision", "ClipGlobalNorm", "SkipNonFinite",
           "SkipLargeUpdates", "joint_norm"]


# ----------------------------------------------------------------------------------------------- composition
# Named states of the wrappers (tuples with names: `state["w"].state.inner`, keyed by name in `state_dict`).
@register_for_export
class AccumGradState(NamedTuple):
    acc: Any             # the mean of the gradients so far
    k: Any               # the number of the current call in the cycle, int32, 1 to n


@register_for_export
class MixedPrecisionState(NamedTuple):
    master: Any          # the high-precision master copy of the parameter
    inner: Any           # the wrapped rule's state


@register_for_export
class SkipNonFiniteState(NamedTuple):
    inner: Any
    skipped: Any         # the number of skipped steps, int32


@register_for_export
class SkipLargeUpdatesState(NamedTuple):
    inner: Any
    stats: Any           # the running statistics of the norms: {"count", "mean", "var", "skipped"}


class OptimiserChain(Rule):
    """Apply rules in sequence, each to the previous one's step: `OptimiserChain(ClipGrad(1), Adam())`.

    A stage that returns no step (`None`) stops the chain; a `Gated` step (from `AccumGrad`) makes every later
    stage keep its state where the gate is closed, without branching. An empty chain acts like `Descent(1)`.
    The chain runs stage by stage across all parameters, so a stage that looks at the whole model
    (`ClipGlobalNorm`) sees the steps of the stages before it. `MixedPrecision` may not be a stage (it wraps
    the whole chain); `adjust` reaches into the stages.

    Args:
        *rules: the stages, in order (or one list or tuple of them); each needs `init` and `apply`.

    State: a tuple with each stage's state.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> rule = optim.OptimiserChain(optim.ClipGrad(0.5), optim.Momentum(0.1))
    >>> state = optim.setup(rule, x)
    >>> state, x = optim.update(state, x, jnp.array([0.5, -1.0]))
    >>> x
    Array([0.95, 2.05], dtype=float32)
    >>> state[""].state
    (None, Array([ 0.05, -0.05], dtype=float32))
    """

    rules: tuple = ()
    _across = False     # a sequence; its stages may look across

    def __init__(self, *rules: Any):
        if len(rules) == 1 and isinstance(rules[0], (list, tuple)):
            rules = tuple(rules[0])
        for r in rules:
            if isinstance(r, MixedPrecision):
                raise TypeError("MixedPrecision must wrap the whole chain, not sit inside it: "
                                "MixedPrecision(jnp.float32, OptimiserChain(...))")
            if not (hasattr(r, "init") and hasattr(r, "apply")):
                raise TypeError(f"OptimiserChain: {r!r} is not a rule (it needs init and apply)")
        object.__setattr__(self, "rules", tuple(rules))

    def init(self, x):
        refuse_ema_in_chain(self)       # an EMA with stages after it averages a point never taken (see EMA)
        return tuple(r.init(x) for r in self.rules)

    def apply(self, states, x, dx, *dxs):
        return apply_one(self, states, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        n = len(xs)
        new = [list(s) for s in states]
        steps = [d[0] for d in dxs]
        oks: list = [None] * n
        for k, rule in enumerate(self.rules):
            live = [i for i in range(n) if steps[i] is not None]    # stages after a None step are skipped
            if not live:
                break
            got_states, got_steps = apply_all(rule, [states[i][k] for i in live], [xs[i] for i in live],
                                              [(steps[i], *dxs[i][1:]) for i in live])
            for i, st, step in zip(live, got_states, got_steps):
                new[i][k] = gate_state(st, states[i][k], oks[i])
                if isinstance(step, Gated):
                    oks[i] = step.ok if oks[i] is None else oks[i] & step.ok
                    step = step.step
                if isinstance(step, Replace):
                    raise TypeError(f"{type(rule).__name__} replaces the parameter and must be the outermost rule")
                steps[i] = step
        out = [Gated(st, ok) if st is not None and ok is not None else st for st, ok in zip(steps, oks)]
        return [tuple(s) for s in new], out

    def average(self, states, x):
        """The first stage's average that there is (`optim.averaged`)."""
        for rule, st in zip(self.rules, states):
            avg = average_of(rule, st, x)
            if avg is not None:
                return avg
        return None

    def __repr__(self):
        return "OptimiserChain(" + ", ".join(map(repr, self.rules)) + ")"


def chain(*rules: Any) -> OptimiserChain:
    """Alias of `OptimiserChain(*rules)`.

    >>> import optim
    >>> optim.chain(optim.ClipNorm(1.0), optim.Descent(1e-3))
    OptimiserChain(ClipNorm(max_norm=1, p=2), Descent(lr=0.001))
    """
    return OptimiserChain(*rules)


class AccumGrad(Rule):
    """Accumulate `g / n` over `n` calls and return the sum on the n-th, no step on the others (branch-free: a
    `Gated` step, so the later stages of a chain keep their state on the other calls).

    Put it first in a chain: `OptimiserChain(AccumGrad(4), Adam())` steps Adam once every 4 calls, with the
    mean of the 4 gradients.

    Args:
        n: the number of calls per step, default 1, an integer >= 1 (adjustable; stays an integer).

    State: `AccumGradState(acc, k)`: the mean so far (parameter dtype) and the number of the current call in the cycle
    (int32, 1 to n).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.chain(optim.AccumGrad(2), optim.Descent(1.0)), x)
    >>> state, x = optim.update(state, x, jnp.array([1.0, 1.0]))
    >>> x              # first call: no step
    Array([1., 2.], dtype=float32)
    >>> state, x = optim.update(state, x, jnp.array([3.0, 3.0]))
    >>> x              # second call: a step with the mean gradient, 2
    Array([-1.,  0.], dtype=float32)
    """

    n: int | jax.Array = count(1)

    def init(self, x):
        return AccumGradState(jnp.zeros_like(x), jnp.ones((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        acc, k = state
        n = jnp.asarray(self.n, jnp.int32)
        acc = where(k == 1, dx / n.astype(x.dtype), acc + dx / n.astype(x.dtype))   # see `where`
        done = k >= n
        return AccumGradState(acc, jnp.where(done, 1, k + 1)), Gated(acc, done)


def _rounds_stochastically(rule: Any) -> bool:
    """Whether `rule`, or a rule inside it, is a `StochasticRounding` (which marks itself so: it imports this
    module)."""
    return getattr(rule, "_rounds_stochastically", False) or any(map(_rounds_stochastically, inner_rules(rule)))


class MixedPrecision(Rule):
    """Run `rule` on a high-precision master copy kept in the state, then write it back rounded to `x`'s dtype
    (a `Replace` step): `MixedPrecision(jnp.float32, Adam())` for float16 / bfloat16 parameters. It must wrap
    the whole chain. Gradients are cast to `dtype` before `rule` sees them.

    Args:
        dtype: the master copy's floating dtype, default float32 (structural); may be omitted:
            `MixedPrecision(rule)`.
        rule: the rule to run on the master copy (required).

    State: `MixedPrecisionState(master, inner)`: the master copy of the parameter (in `dtype`) and `rule`'s state
    for it.

    Reference: P. Micikevicius et al., "Mixed Precision Training", 2017, https://arxiv.org/abs/1710.03740

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0], jnp.bfloat16)
    >>> state = optim.setup(optim.MixedPrecision(optim.Descent(0.001)), x)
    >>> for _ in range(10):
    ...     state, x = optim.update(state, x, jnp.ones(2, jnp.bfloat16))
    >>> # each step alone rounds away in bfloat16; the float32 master copy is at
    >>> # [0.99, 1.99]
    >>> x
    Array([0.988281, 1.99219], dtype=bfloat16)
    """

    dtype: Any = static(jnp.float32)
    rule: Any = None
    _across = False     # per parameter; its inner rule may look across

    def __init__(self, dtype: Any = jnp.float32, rule: Any = None):
        if rule is None and hasattr(dtype, "apply"):
            dtype, rule = jnp.float32, dtype
        if rule is None:
            raise TypeError("MixedPrecision(dtype, rule) needs a rule")
        if not is_rule(rule):
            raise TypeError(f"MixedPrecision: rule must be a rule (it needs init and apply), got {rule!r}; write "
                            "MixedPrecision(jnp.float32, Adam(1e-3))")
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.inexact):
            raise TypeError(f"MixedPrecision: {dtype!r} is not a floating dtype")
        if _rounds_stochastically(rule):
            # the inner rule steps the float32 master copy, which StochasticRounding passes through unrounded
            raise TypeError("MixedPrecision: a StochasticRounding inside it would round nothing (it steps the "
                            f"{jnp.dtype(dtype).name} master copy): use one of them, MixedPrecision(AdamW(1e-3)) "
                            "or StochasticRounding(AdamW(1e-3))")
        object.__setattr__(self, "dtype", jnp.dtype(dtype))
        object.__setattr__(self, "rule", rule)

    def init(self, x):
        xt = x.astype(self.dtype)
        return MixedPrecisionState(xt, self.rule.init(xt))

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        masters = [s[0] for s in states]
        inner, steps = apply_all(self.rule, [s[1] for s in states], masters,
                                 [tuple(d.astype(self.dtype) for d in ds) for ds in dxs])
        new_masters = [apply_step(m, st) for m, st in zip(masters, steps)]
        return ([MixedPrecisionState(m, st) for m, st in zip(new_masters, inner)],
                [Replace(m.astype(x.dtype)) for m, x in zip(new_masters, xs)])

    def average(self, state, x):
        avg = average_of(self.rule, state[1], state[0])     # the inner rule sees the master copy
        return None if avg is None else avg.astype(x.dtype)


# ----------------------------------------------------------------------------------------------- whole-model rules
def joint_norm(dxs: list) -> jax.Array:
    """The 2-norm of several arrays taken together, accumulated in float32 or wider.

    >>> import jax.numpy as jnp
    >>> from optim._rules.wrappers import joint_norm
    >>> joint_norm([jnp.array([3.0]), jnp.array([4.0])])
    Array(5., dtype=float32)
    """
    total = sum((sum_squares(d) for d in dxs), jnp.zeros((), jnp.float32))
    return jnp.sqrt(total)


class ClipGlobalNorm(Rule):
    """Rescale all gradients together so that their joint 2-norm is at most `max_norm`: `g · min(ω / ‖g‖, 1)`.

    The norm counts each parameter once, with the summed gradient of its tie group (optax's
    `clip_by_global_norm` counts a tied weight once per position). Put it first in a chain:
    `OptimiserChain(ClipGlobalNorm(1.0), AdamW(3e-4))`. Parameters with a `None` gradient do not count.
    The norm covers the parameters that share this rule: all of them, unless `setup` was given a rule per leaf,
    in which case each distinct rule clips its own parameters.

    Args:
        max_norm: ω, default 1.0, >= 0.

    State: none (`None`).

    Reference: R. Pascanu, T. Mikolov, Y. Bengio, "On the difficulty of training recurrent neural networks",
    2013, https://arxiv.org/abs/1211.5063

    >>> import jax.numpy as jnp, optim
    >>> m = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    >>> rule = optim.chain(optim.ClipGlobalNorm(1.0), optim.Descent(1.0))
    >>> s = optim.setup(rule, m)
    >>> optim.update(s, m, {"a": jnp.array([3.0]), "b": jnp.array([4.0])})[1]
    {'a': Array([-0.6], dtype=float32), 'b': Array([-0.8], dtype=float32)}
    """

    max_norm: Hyper = nonneg(1.0)
    _across = True      # one norm over the parameters that share the rule (see `optim._rules.protocol.looks_across`)
    _formula = "clip"

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        g = [d[0] for d in dxs]
        f = self.factor(g)
        return list(states), [d * f.astype(compute_dtype(d)) for d in g]

    def factor(self, dxs: list, norm: jax.Array | None = None) -> jax.Array:
        """`min(ω / ‖g‖, 1)` over the gradients `dxs`: one factor for all of them, computed in float32 (or the
        widest compute dtype among them), so that a bfloat16 parameter does not round the factor that a float32
        one is scaled by (a mixed-precision model's norms and matrices are clipped alike). `norm`: their
        `joint_norm`, where the caller has it already."""
        dtype = functools.reduce(jnp.promote_types, [compute_dtype(d) for d in dxs], jnp.dtype(jnp.float32))
        norm = joint_norm(dxs) if norm is None else norm
        return clip_factor(jnp.asarray(self.max_norm, dtype), norm.astype(dtype))


class SkipNonFinite(Rule):
    """Skip the whole step when any gradient has a NaN or Inf: the model and every parameter's state are left
    as they were (on CPU a conditional skips the inner rule; elsewhere selects discard its results: see
    `skip_unless`), and the state counts the skipped steps. Wrap the whole rule:
    `SkipNonFinite(OptimiserChain(ClipGlobalNorm(1.0), Adam()))`. Like `ClipGlobalNorm`, it looks at the
    parameters that share it.

    Args:
        rule: the rule to run when every gradient is finite (required).

    State: `SkipNonFiniteState(inner, skipped)`: `rule`'s state and the number of skipped steps (int32, starting at 0).

    >>> import jax.numpy as jnp, optim
    >>> m = {"a": jnp.ones(2)}
    >>> s = optim.setup(optim.SkipNonFinite(optim.Adam()), m)
    >>> s, m2 = optim.update(s, m, {"a": jnp.array([1.0, jnp.nan])})
    >>> m2["a"], int(s["a"].state.skipped)
    (Array([1., 1.], dtype=float32), 1)
    """

    rule: Any = None
    _across = True      # a NaN anywhere among the rule's parameters skips them all

    def __init__(self, rule: Any):
        if not is_rule(rule):
            raise TypeError(f"SkipNonFinite: rule must be a rule (it needs init and apply), got {rule!r}; write "
                            "SkipNonFinite(Adam(1e-3))")
        object.__setattr__(self, "rule", rule)

    def init(self, x):
        return SkipNonFiniteState(self.rule.init(x), jnp.zeros((), jnp.int32))

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(d)) for ds in dxs for d in ds]))
        inner, steps = skip_unless(ok, self.rule, [s[0] for s in states], xs, list(dxs))
        new = [SkipNonFiniteState(st, s[1] + jnp.where(ok, 0, 1).astype(jnp.int32))
               for st, s in zip(inner, states)]
        return new, [None if st is None else Gated(st, ok) for st in steps]

    def average(self, state, x):
        return average_of(self.rule, state[0], x)


class SkipLargeUpdates(Rule):
    """Skip a step whose gradient norm is far above the norms seen so far: the model and `rule`'s state are
    left as they were (branch-free) and the state counts the skipped steps. Wrap the whole rule:
    `SkipLargeUpdates(OptimiserChain(ClipGlobalNorm(1.0), AdamW(3e-4)))` looks at the raw gradients, before any
    clipping (inside a chain after `ClipGlobalNorm` it would see the clipped ones).

    The norm `‖g‖` is the 2-norm of the gradients of all the parameters that share this rule, each parameter
    counted once with the summed gradient of its tie group (what `ClipGlobalNorm` sees); parameters with a
    `None` gradient do not count and their state is not advanced; only the first gradient tree counts (extra
    ones, `update(state, model, grads, grads2)`, go to `rule` as they are). With the running statistics `n` (the number
    of norms taken in), mean `μ` and variance `v`, and `τ = μ + sigma · √v`, a step is skipped when

    - `‖g‖` is NaN or ±Inf (always, also during warmup), or
    - `n >= warmup`, `v > 0` and `‖g‖ > τ`.

    (With `v = 0`, after one norm or after identical norms, there is no spread to compare with: clamping at
    `τ = μ` would then skip every larger norm for ever.) A finite norm is then taken into the statistics as
    `y = min(‖g‖, τ)` when it was skipped and `y = ‖g‖` otherwise, so that one spike cannot inflate them, while a
    lasting rise is absorbed: each clamped step multiplies `v` by `(1 - α)(1 + α · sigma²)`, more than 1 when
    `sigma² > 1 / (1 - α)`, so keep `sigma` above about 1.5. A non-finite norm is not taken in. Taking in `y`,
    with `β = norm_decay`:

        n ← n + 1,   α = (1 - β) / (1 - βⁿ)  (α = 1 when n = 1),   δ = y - μ,
        μ ← μ + α δ,   v ← (1 - α)(v + α δ²),

    which makes `μ` and `v` exactly the mean and (population) variance of the `n` values taken in, weighted by
    `β^(n-k)` for the k-th: an exponential moving average, bias-corrected by the count, so the first norms are
    not pulled toward 0 (the first `μ` is the first norm, the first `v` is 0).

    Nested with `SkipNonFinite`, a step is counted by the outer wrapper that skips it (the outer one keeps the
    inner one's state, its counter included): `SkipNonFinite(SkipLargeUpdates(rule))` counts NaN / Inf steps
    in `SkipNonFinite` and large ones here.

    Args:
        rule: the rule to run when the step is not skipped (required, positional).
        sigma: how many standard deviations above the mean a norm may be, default 6.0, >= 0 (adjustable).
        warmup: the number of norms to take in before anything but a non-finite step is skipped, default 100,
            an integer >= 0 (adjustable; stays an integer).
        norm_decay: β, default 0.99, in [0, 1) (adjustable): the statistics weigh the norm of k steps ago by
            `β^k`, about the last `1 / (1 - β)` steps.

    State: `SkipLargeUpdatesState(inner, stats)`: `rule`'s state and a dict of 0-d arrays: `"count"` (n, int32),
    `"mean"` (μ, float32), `"var"` (v, float32) and `"skipped"` (the number of skipped steps, int32). Every
    parameter that shares the rule holds the same statistics (one whose gradient was `None` keeps older ones; the
    step uses those of the parameter that has seen the most steps).

    >>> import jax.numpy as jnp, optim
    >>> m = {"a": jnp.zeros(2)}
    >>> rule = optim.SkipLargeUpdates(optim.Descent(0.5), sigma=3.0, warmup=4)
    >>> s = optim.setup(rule, m)
    >>> for g in [1.0, 2.0, 1.0, 2.0]:
    ...     s, m = optim.update(s, m, {"a": jnp.array([g, 0.0])})
    >>> # about the mean and variance of 1, 2, 1, 2
    >>> stats = s["a"].state.stats
    >>> m["a"], round(float(stats["mean"]), 3), round(float(stats["var"]), 3)
    (Array([-3.,  0.], dtype=float32), 1.503, 0.25)
    >>> # 100 > 1.5 + 3 * 0.5: skipped
    >>> s, m = optim.update(s, m, {"a": jnp.array([100.0, 0.0])})
    >>> m["a"], int(s["a"].state.stats["skipped"])
    (Array([-3.,  0.], dtype=float32), 1)
    >>> s, m = optim.update(s, m, {"a": jnp.array([2.0, 0.0])})
    >>> m["a"], int(s["a"].state.stats["skipped"]), int(s["a"].state.stats["count"])
    (Array([-4.,  0.], dtype=float32), 1, 6)
    """

    rule: Any = None
    sigma: Hyper = nonneg(6.0)
    warmup: int | jax.Array = steps(100)
    norm_decay: Hyper = unit(0.99)
    _across = True      # one norm, and one decision, for the parameters that share the rule

    def __init__(self, rule: Any, sigma: Hyper = 6.0, warmup: int | jax.Array = 100, norm_decay: Hyper = 0.99):
        if not (callable(getattr(rule, "init", None)) and callable(getattr(rule, "apply", None))):
            raise TypeError(f"SkipLargeUpdates: rule must be a rule (it needs init and apply), got {rule!r}")
        for name, v in (("rule", rule), ("sigma", sigma), ("warmup", warmup), ("norm_decay", norm_decay)):
            object.__setattr__(self, name, v)
        self.__post_init__()

    def init(self, x):
        stats = {"count": jnp.zeros((), jnp.int32), "mean": jnp.zeros((), jnp.float32),
                 "var": jnp.zeros((), jnp.float32), "skipped": jnp.zeros((), jnp.int32)}
        return SkipLargeUpdatesState(self.rule.init(x), stats)

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        if not xs:
            return [], []
        norm = joint_norm([d[0] for d in dxs])
        # Every row of every stack should hold the same statistics; one that missed steps (a `None` gradient,
        # frozen) holds older ones, so take those of the row that has seen the most steps.
        rows = {k: jnp.concatenate([jnp.reshape(s[1][k], (-1,)) for s in states]) for k in states[0][1]}
        pick = jnp.argmax(rows["count"].astype(jnp.int32) + rows["skipped"].astype(jnp.int32))
        n, mean, var, skipped = (rows[k][pick] for k in ("count", "mean", "var", "skipped"))
        n, skipped = n.astype(jnp.int32), skipped.astype(jnp.int32)
        mean, var = mean.astype(jnp.float32), var.astype(jnp.float32)
        sigma = jnp.asarray(self.sigma, jnp.float32)
        beta = jnp.asarray(self.norm_decay, jnp.float32)

        threshold = mean + sigma * jnp.sqrt(var)
        finite = jnp.isfinite(norm)
        large = finite & (n >= jnp.asarray(self.warmup, jnp.int32)) & (var > 0) & (norm > threshold)
        ok = finite & ~large
        # Take y in: the weighted incremental mean and variance with weights beta^(n-k) (see the docstring).
        y = jnp.where(large, threshold, jnp.where(finite, norm, mean))
        n1 = n + 1
        # alpha = (1 - beta) / (1 - beta^n1), with 1 - beta^n1 = -expm1(n1 log beta) accurate for beta near 1.
        alpha = (1 - beta) / -jnp.expm1(n1.astype(jnp.float32) * jnp.log1p(-(1 - beta)))
        alpha = jnp.where(n1 == 1, 1.0, jnp.clip(alpha, 0.0, 1.0))
        delta = y - mean
        new_stats = {
            "count": jnp.where(finite, n1, n),
            "mean": jnp.where(finite, mean + alpha * delta, mean),
            "var": jnp.where(finite, jnp.maximum((1 - alpha) * (var + alpha * delta * delta), 0.0), var),
            "skipped": skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        }

        inner, steps = apply_all(self.rule, [s[0] for s in states], xs, list(dxs))
        new = [SkipLargeUpdatesState(gate_state(st, s[0], ok),
                {k: jnp.broadcast_to(v.astype(s[1][k].dtype), jnp.shape(s[1][k])) for k, v in new_stats.items()})
               for st, s in zip(inner, states)]
        return new, [None if st is None else Gated(st.step, st.ok & ok) if isinstance(st, Gated) else Gated(st, ok)
                     for st in steps]

    def average(self, state, x):
        return average_of(self.rule, state[0], x)
