"""Cautious: a wrapper that keeps only the entries of a rule's step that agree in sign with the gradient.

The protocol, the notation and the conventions all rules share are in `optim._rules` (the package docstring).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp

from .._base.tree import replace_fields
from .ademamix import AdEMAMix
from .adafactor import Adafactor
from .adam import AdamW
from .average import refuse_ema_in
from .muon import Muon, NorMuon
from .protocol import Gated, Replace, Rule, apply_all, apply_one, as_compute, average_of, is_rule
from .wrappers import MixedPrecision, OptimiserChain, SkipLargeUpdates, SkipNonFinite

__all__ = ["Cautious"]

# The built-in rules whose step is `adaptive part + decoupled decay`: the decay, as a function of the rule and
# the parameter. Cautious runs the rule with `weight_decay = 0` (its step is then exactly the adaptive part) and
# adds this term unmasked.
_DECAYS: dict[type, Callable[[Any, Any], Any]] = {
    AdamW: lambda r, x: (as_compute(r.lr, x) * as_compute(r.weight_decay, x) * x if r.couple
                         else as_compute(r.weight_decay, x) * x),
    AdEMAMix: lambda r, x: as_compute(r.lr, x) * as_compute(r.weight_decay, x) * x,
    Muon: lambda r, x: as_compute(r.lr, x) * as_compute(r.weight_decay, x) * x,
    NorMuon: lambda r, x: as_compute(r.lr, x) * as_compute(r.weight_decay, x) * x,
    Adafactor: lambda r, x: as_compute(r.weight_decay, x) * x,
}


def split_decay(rule: Any) -> tuple[Any, Callable[[Any], Any] | None]:
    """`(bare, decay)`: `rule` without its decoupled weight decay and the decay term `decay(x)` it adds to its
    step (elementwise in `x`, so `x` may be a stack), or `(rule, None)` when its step has no separable decay.

    Separable: `AdamW`, `AdEMAMix`, `Muon`, `NorMuon`, `Adafactor`; a rule with a method `split_decay()`
    returning such a pair; an `OptimiserChain` whose last stage is separable (the stages before it are kept:
    `ClipGlobalNorm`); `SkipNonFinite` and `SkipLargeUpdates` around a separable rule (their gate covers the
    decay too)."""
    own = getattr(rule, "split_decay", None)
    if callable(own):
        return own()
    make = _DECAYS.get(type(rule))
    if make is not None:
        return replace_fields(rule, {"weight_decay": 0.0}), lambda x: make(rule, x)
    if isinstance(rule, OptimiserChain) and rule.rules:
        bare, decay = split_decay(rule.rules[-1])
        if decay is not None:
            return OptimiserChain(*rule.rules[:-1], bare), decay
    if isinstance(rule, (SkipNonFinite, SkipLargeUpdates)):
        bare, decay = split_decay(rule.rule)
        if decay is not None:
            return replace_fields(rule, {"rule": bare}), decay
    return rule, None


def _cautious(u: Any, g: Any) -> Any:
    """`u` masked where it disagrees with `g` and rescaled per member of the stack (leading axis):
    `u · mask · n / (Σ mask + 1)` with `mask = Re(conj(u) g) > 0` and `n` the number of entries of a member."""
    agree = (jnp.real(jnp.conj(u) * g) if jnp.iscomplexobj(u) or jnp.iscomplexobj(g) else u * g) > 0
    axes = tuple(range(1, jnp.ndim(u)))
    count = jnp.sum(agree, axis=axes, keepdims=True, dtype=jnp.int32)     # exact, also beyond 2^24 entries
    real = jnp.finfo(u.dtype).dtype
    scale = jnp.asarray(math.prod(jnp.shape(u)[1:]), real) / (count.astype(real) + 1)
    return u * (agree.astype(real) * scale)


class Cautious(Rule):
    """Cautious `rule`: each step of `rule` keeps only the entries that agree in sign with the gradient `g`, and
    is rescaled so that its size is about kept. Per parameter of `n` entries, with `u` the step of `rule`:
    `mask = (u g > 0)`, `step = u · mask · n / (Σ mask + 1)`.

    - `g` is the parameter's gradient as `rule` receives it (a tie group's summed gradient); in a chain
      `Cautious(chain(ClipGlobalNorm(1.0), AdamW(...)))` the mask compares the chain's whole step with the
      gradient before clipping (the same signs).
    - A decoupled weight decay is not masked: for `AdamW`, `AdEMAMix`, `Muon`, `NorMuon` and `Adafactor`, and
      for a chain whose last stage is one of them (or `SkipNonFinite` / `SkipLargeUpdates` around either), `u`
      is the step without the decay, and the decay (`η λ x` for AdamW) is added to the masked step. Any other
      rule's whole step is masked (a decay inside it, `Lamb`'s, a stage after AdamW, is masked too). A rule of
      your own opts in with a method `split_decay()` returning `(rule without the decay, decay(x))`.
    - The sum is over each parameter (each member of a stack alone: stacking does not change the step).
    - Complex parameters: `mask = Re(conj(u) g) > 0`, the sign of the real inner product of the two entries as
      vectors of ℝ² (for real ones, `u g > 0`).
    - A step of `None` stays `None`, a `Gated` one is masked inside its gate; `MixedPrecision` must wrap
      `Cautious`, not the reverse (`MixedPrecision(Cautious(AdamW()))`), and so must `EMA`
      (`EMA(Cautious(AdamW()))`): an EMA inside `Cautious` would average a point the model never takes, and
      `setup` refuses it (a `ValueError` naming the parameter's path).

    C-Optim's code now divides the mask by `max(mean(mask), 1e-3)` (timm's variant); this is the paper's
    original `n / (Σ mask + 1)`.

    Args:
        rule: the rule whose steps are masked (required, positional); `adjust` reaches into it.

    State: `rule`'s state, as it is (Cautious keeps none of its own).

    Reference: K. Liang, L. Chen, B. Liu, Q. Liu, "Cautious Optimizers: Improving Training with One Line of
    Code", 2024, https://arxiv.org/abs/2411.16085; code: https://github.com/kyleliang919/C-Optim

    optax: none (not in optax).

    >>> import jax.numpy as jnp, optim
    >>> x = jnp.array([1.0, 2.0, 3.0])
    >>> state = optim.setup(optim.Cautious(optim.Momentum(0.1, 0.9)), x)
    >>> state, x = optim.update(state, x, jnp.array([1.0, 1.0, 1.0]))
    >>> x              # all agree: the step 0.1 scaled by 3 / (3 + 1)
    Array([0.925, 1.925, 2.925], dtype=float32)
    >>> state, x = optim.update(state, x, jnp.array([-0.5, 1.0, 1.0]))
    >>> # u = 0.9 · 0.1 + 0.1 g = (0.04, 0.19, 0.19): the first masked,
    >>> # the others scaled by 3 / (2 + 1) = 1
    >>> [round(float(v), 4) for v in x]
    [0.925, 1.735, 2.735]
    """

    rule: Any = None
    _across = False     # per parameter; its inner rule may look across

    def __init__(self, rule: Any):
        if isinstance(rule, type):
            raise TypeError(f"Cautious: rule must be a rule, got the class {rule.__name__}; write "
                            f"Cautious({rule.__name__}(...)), e.g. Cautious(AdamW(1e-3))")
        if not is_rule(rule):
            raise TypeError(f"Cautious: rule must be a rule (it needs init and apply), got {rule!r}; write "
                            "Cautious(AdamW(1e-3))")
        if isinstance(rule, MixedPrecision):
            raise TypeError("Cautious: MixedPrecision must wrap Cautious, not the reverse: "
                            "MixedPrecision(jnp.float32, Cautious(AdamW(1e-3)))")
        object.__setattr__(self, "rule", rule)

    def init(self, x):
        refuse_ema_in(self, self.rule, "masks")     # EMA(Cautious(rule)) is the form that averages the step taken
        return self.rule.init(x)

    def apply(self, state, x, dx, *dxs):
        return apply_one(self, state, x, (dx, *dxs))

    def apply_tree(self, states, xs, dxs):
        bare, decay = split_decay(self.rule)
        new, steps = apply_all(bare, list(states), xs, list(dxs))
        return new, [_masked(st, ds[0], x, decay) for st, ds, x in zip(steps, dxs, xs)]

    def average(self, state, x):
        return average_of(self.rule, state, x)


def _masked(step: Any, g: Any, x: Any, decay: Callable | None) -> Any:
    if step is None:
        return None
    if isinstance(step, Gated):
        return Gated(_masked(step.step, g, x, decay), step.ok)
    if isinstance(step, Replace):
        raise TypeError("Cautious: the rule inside replaces the parameter (MixedPrecision); MixedPrecision must "
                        "wrap Cautious")
    u = _cautious(step, g)
    return u if decay is None else u + decay(x)
