"""Averaged parameters: `EMA` keeps an exponential moving average of each parameter in its state, and
`averaged(state, model)` (optim._core.average) returns the model to evaluate with (a rule keeps an average by
defining `average(state, x)`; see `optim._rules.protocol.average_of`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from .._base.export import register_for_export
from .fields import decay
from .schedules import Hyper
from .protocol import (Gated, Rule, where_leading, apply_all, apply_one, apply_step, as_compute,
                       inner_fields, inner_rules, is_rule, widened)
from .._base.tree import replace_fields

__all__ = ["EMA"]


@register_for_export
class EMAState(NamedTuple):
    inner: Any           # the wrapped rule's state
    average: Any         # the moving average of the parameter


class EMA(Rule):
    """Run `rule`, and keep an exponential moving average of each parameter's value after every step:
    `a ← δ a + (1 - δ) x_new`, starting from the parameter's value at `setup` (so there is no bias to
    correct). The steps are `rule`'s; `optim.averaged(state, model)` returns the model with each parameter
    replaced by its average, to evaluate with. A call with no step for a parameter (a `None` gradient, frozen,
    an `AccumGrad` call that only accumulates, a step skipped by `SkipNonFinite`) leaves its average as is.

    Where it may sit: the average is of the parameter after the whole step, which EMA knows only where nothing
    after it changes its rule's step. So EMA goes outermost, `EMA(chain(ClipGlobalNorm(1.0), AdamW(3e-4)))`,
    or inside wrappers that only gate or carry the whole step: `SkipNonFinite(EMA(...))`,
    `SkipLargeUpdates(EMA(...))`, `MixedPrecision(EMA(...))` (it averages the master copy), an outer `EMA`;
    or as the last stage of a chain, `chain(AccumGrad(4), EMA(Adam()))`. A rule per path (`by_path`, a rule
    function) may give only some parameters an EMA. Refused, by a `ValueError` at `setup` that names the
    parameter's path and gives the form to write: an EMA in a stage of a chain with stages after it
    (`chain(EMA(Adam()), Scale(0.5))`, before `ClipNorm`, ...: they change the step after EMA took it) and an
    EMA inside `Cautious` (which masks it): there it would average `x` minus its own rule's step, a point the
    model never takes. Write `EMA(chain(Adam(), Scale(0.5)))` and `EMA(Cautious(AdamW()))`. A wrapper of your
    own that changes the step of a rule inside it is not checked: keep EMA outside it.

    Args:
        rule: the rule that takes the steps (required, positional).
        decay: δ, default 0.999, in [0, 1] (adjustable, or a schedule: a warmup of the decay such as
            `Linear(0.9, 0.999, 1000)` lets the average follow the fast early changes).

    State: `EMAState(inner, average)`: `rule`'s state and the average, in the parameter's dtype or float32 if
    that is wider (a bfloat16 average would round away updates smaller than its precision).

    optax: the average of `optax.ema(δ, debias=False)` fed with the parameters after each step, its state
    starting at the initial parameters.

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.EMA(optim.Descent(1.0), decay=0.5), x)
    >>> for _ in range(2):
    ...     state, x = optim.update(state, x, jnp.array([1.0, 1.0]))
    >>> # 0.5 (0.5 · 1 + 0.5 · 0) + 0.5 · (-1) = -0.25
    >>> x, optim.averaged(state, x)
    (Array([-1.,  0.], dtype=float32), Array([-0.25,  0.75], dtype=float32))
    """

    rule: Any = None
    decay: Hyper = decay(0.999)
    _across = False     # per parameter; its inner rule may look across
    _gate = True        # `apply_tree` takes an outer gate (`Rule._gate`)

    def __init__(self, rule: Any, decay: Hyper = 0.999):
        if not is_rule(rule):
            raise TypeError(f"EMA: rule must be a rule (it needs init and apply), got {rule!r}; "
                            "write EMA(Adam(1e-3), decay=0.999)")
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "decay", decay)
        self.__post_init__()

    def init(self, x):
        return EMAState(self.rule.init(x), x.astype(jnp.promote_types(x.dtype, jnp.float32)))

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs, ok=None):
        inner, steps = apply_all(self.rule, [s[0] for s in states], xs, list(dxs))
        new = []
        for (_, avg), x, st, step in zip(states, xs, inner, steps):
            if step is not None:
                # Under an outer gate `ok` (`skip_unless`'s selects), the average is taken of the gated new
                # value: equal where it is kept, and the very expression of the parameter's own update, which
                # XLA then computes once (the ungated `x - step` read the old parameter after the kernel that
                # overwrote it in place: a copy of each parameter, compiled for an H100).
                gated = Gated(step, ok) if ok is not None and not isinstance(step, Gated) else step
                d = as_compute(self.decay, avg)
                moved = d * avg + (1 - d) * widened(apply_step(x, gated), avg.dtype)   # the value stored
                avg = where_leading(gated.ok, moved, avg) if isinstance(gated, Gated) else moved
            new.append(EMAState(st, avg))
        return new, steps

    def average(self, state, x):
        return state[1].astype(x.dtype)


def _emas(rule: Any) -> list:
    """Every `EMA` in `rule` (itself, a chain's stages, a wrapper's rule: `inner_fields`), outermost first."""
    found = [rule] if isinstance(rule, EMA) else []
    for r in inner_rules(rule):
        found += _emas(r)
    return found


def _without_emas(rule: Any) -> Any:
    """`rule` with each `EMA` in it replaced by its rule (for the form an error suggests)."""
    if isinstance(rule, EMA):
        return _without_emas(rule.rule)
    changes = {}
    for name in inner_fields(rule):
        v = getattr(rule, name)
        changes[name] = tuple(map(_without_emas, v)) if isinstance(v, tuple) else _without_emas(v)
    return replace_fields(rule, changes) if changes else rule


def refuse_ema_in_chain(chain: Any) -> None:
    """A `ValueError` where an `EMA` sits in a stage of `chain` that has stages after it (see `EMA`): called by
    `OptimiserChain.init`, so that `setup` names the parameter's path."""
    stages = chain.rules
    for k, stage in enumerate(stages[:-1]):
        found = _emas(stage)
        if found:
            fixed = EMA(replace_fields(chain, {"rules": tuple(map(_without_emas, stages))}), found[0].decay)
            raise ValueError(
                f"EMA: {found[0]!r} is in stage {k + 1} of the {len(stages)} of {chain!r}, and the stages after it "
                "change the step: it would average the parameter minus its rule's step, a point the model never "
                f"takes. An EMA must see the whole step: put it outermost, {fixed!r} (or make it the chain's last "
                "stage)")


def refuse_ema_in(wrapper: Any, rule: Any, what: str) -> None:
    """A `ValueError` where `rule`, the rule inside `wrapper` (`Cautious`), holds an `EMA`: `wrapper` changes
    the step after EMA took it (`what` says how). Called by the wrapper's `init`, so that `setup` names the
    parameter's path."""
    found = _emas(rule)
    if found:
        fixed = EMA(replace_fields(wrapper, {"rule": _without_emas(rule)}), found[0].decay)
        raise ValueError(
            f"EMA: {found[0]!r} is inside {type(wrapper).__name__}, which {what} the step after EMA took it: it "
            "would average the parameter minus its rule's step, a point the model never takes. An EMA must see "
            f"the whole step: put it outermost, {fixed!r}")
