"""Change hyperparameters (`adjust`) and frozen flags (`freeze`, `thaw`) of a state, returning a new one.

Hyperparameters are pytree leaves of the state, so `adjust` changes data, never the compiled program: the new
value keeps the old leaf's dtype and shape. Frozen flags are static (they decide which parameters the program
steps), so `freeze` / `thaw` compile a new program once per combination.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ._rules import MixedPrecision, OptimiserChain, Rule
from ._schedules import Schedule
from ._state import PathError, State, canonical_numbers, with_frozen

_MISSING = object()


def adjust(state: Any, lr: Any = _MISSING, **hyper: Any) -> Any:
    """Return `state` (or a rule) with hyperparameters replaced wherever a rule has them, chains included.

    `adjust(state, 1e-4)` sets `lr`; `adjust(state, beta=(0.8, 0.99), weight_decay=0.1)` sets those fields.
    A keyword that no rule in the state has is a `TypeError` (a typo would otherwise be silently ignored);
    structural fields such as `RMSProp.centred` cannot be adjusted (run `setup` again).

    >>> import optim
    >>> optim.adjust(optim.OptimiserChain(optim.ClipGrad(2.0), optim.Adam(0.1)), 0.2)
    OptimiserChain(ClipGrad(delta=2), Adam(lr=0.2, beta=(0.9, 0.999), eps=1e-08))
    """
    if lr is not _MISSING:
        hyper = {"lr": lr, **hyper}
    if not hyper:
        raise TypeError("adjust: give at least one hyperparameter, e.g. adjust(state, lr=1e-4)")
    used: set[str] = set()
    if isinstance(state, State):
        rules = tuple(_adjust_rule(r, hyper, used) for r in state.rules)
    else:
        rules = (_adjust_rule(state, hyper, used),)
    unknown = sorted(set(hyper) - used)
    if unknown:
        have = sorted(_fields(state.rules if isinstance(state, State) else (state,)))
        raise TypeError(f"adjust: no rule here has {', '.join(unknown)}; adjustable: {', '.join(have) or 'none'}")
    if isinstance(state, State):
        return State(state.layout, rules, state.stacks, state.step)
    return rules[0]


def _fields(rules) -> set[str]:
    out = set()
    for r in rules:
        if isinstance(r, OptimiserChain):
            out |= _fields(r.rules)
        elif isinstance(r, MixedPrecision):
            out |= _fields((r.rule,))
        elif dataclasses.is_dataclass(r):
            out |= {f.name for f in dataclasses.fields(r) if f.name not in getattr(r, "_static", ())}
    return out


def _convert(new: Any, old: Any) -> Any:
    """`new` in the form of `old`: same dtype for array leaves, so that jit sees the same abstract type."""
    if isinstance(new, Schedule) or isinstance(old, Schedule):
        new = canonical_numbers(new)
        if jax.tree.structure(new) == jax.tree.structure(old):    # same kind of schedule: data only
            return jax.tree.map(lambda n, o: jnp.asarray(n, o.dtype) if hasattr(o, "dtype") else n, new, old)
        return new
    if isinstance(old, tuple):
        if not isinstance(new, (tuple, list)) or len(new) != len(old):
            raise ValueError(f"adjust: expected a tuple of {len(old)} values, got {new!r}")
        return tuple(_convert(n, o) for n, o in zip(new, old))
    if isinstance(old, jax.Array):
        return jnp.asarray(new, dtype=old.dtype).reshape(old.shape)
    return new


def _adjust_rule(rule: Any, hyper: dict, used: set) -> Any:
    if isinstance(rule, OptimiserChain):
        return OptimiserChain(*(_adjust_rule(r, hyper, used) for r in rule.rules))
    if isinstance(rule, MixedPrecision):
        return MixedPrecision(rule.dtype, _adjust_rule(rule.rule, hyper, used))
    if not dataclasses.is_dataclass(rule):
        return rule
    names = {f.name for f in dataclasses.fields(rule)}
    changes = {}
    for k, v in hyper.items():
        if k not in names:
            continue
        if k in getattr(rule, "_static", ()):
            raise ValueError(f"adjust: {type(rule).__name__}.{k} is structural (it changes the state's shape "
                             "or the program); call optim.setup again with the new rule")
        used.add(k)
        changes[k] = v
    if not changes:
        return rule
    if isinstance(rule, Rule):
        type(rule).__post_init__(_Probe(rule, changes))   # validate the plain values (e.g. lr >= 0)
    return _swap(rule, changes)


class _Probe:
    """Attribute view of a rule with some fields replaced, for running its validation on new values."""

    def __init__(self, rule, changes):
        self._rule, self._changes = rule, changes

    def __getattr__(self, name):
        return self._changes[name] if name in self._changes else getattr(self._rule, name)


def _swap(rule: Any, changes: dict) -> Any:
    """A copy of `rule` with `changes`, each new value in the form (dtype) of the field it replaces. Built without
    `__init__`, like JAX's unflatten: the values were validated above, and may be tracers."""
    new = object.__new__(type(rule))
    for f in dataclasses.fields(rule):
        old = getattr(rule, f.name)
        object.__setattr__(new, f.name, _convert(changes[f.name], old) if f.name in changes else old)
    return new


def freeze(state: State, *patterns: str) -> State:
    """Freeze the parameters whose dotted path (any tied member) equals, lies below, or fnmatch-matches a
    pattern; with no pattern, every parameter. A frozen parameter gets no step and its state is kept."""
    return with_frozen(state, _select(state, patterns, "freeze"), True)


def thaw(state: State, *patterns: str) -> State:
    """Undo `freeze` for the matching parameters (all of them with no pattern)."""
    return with_frozen(state, _select(state, patterns, "thaw"), False)


def _select(state: State, patterns: tuple[str, ...], who: str) -> list[int]:
    if not isinstance(state, State):
        raise TypeError(f"{who}: expected the State from optim.setup, got {type(state).__name__} "
                        "(freeze the optimiser state, not the model)")
    if not patterns:
        return list(range(len(state.layout.params)))
    hits = []
    for pat in patterns:
        if not isinstance(pat, str):
            raise TypeError(f"{who}: patterns are dotted-path strings, got {type(pat).__name__}")
        found = state.layout.match(pat)
        if not found:
            raise PathError(f"{who}: {pat!r} matches no trainable path of the model "
                            f"(paths look like {', '.join(repr(p) for p in state.paths()[:3])})")
        hits += found
    return hits
