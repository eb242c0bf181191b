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

from ._step import Rule, is_rule
from ._schedules import Schedule
from ._hyper import canonical_numbers
from ._state import PathError, State, unwrap, with_frozen
from ._tree import show

_MISSING = object()


def adjust(state: Any, lr: Any = _MISSING, **hyper: Any) -> Any:
    """Return `state` (or a rule) with hyperparameters replaced wherever a rule has them.

    `adjust(state, 1e-4)` sets `lr`; `adjust(state, beta=(0.8, 0.99), weight_decay=0.1)` sets those fields. It
    reaches every rule inside another: chains, `MixedPrecision`, `SkipNonFinite`, `AccumGrad`, factory-form
    `from_optax` rules, nested in any order. New values are checked like the constructor's (a negative `lr` is
    a `ValueError`) and keep the old value's dtype, so a jitted step never recompiles; a value given as an int
    is a float like any other. A keyword that no rule in the state has is a `TypeError` (a typo would otherwise
    be silently ignored); structural fields such as `RMSProp.centred` cannot be adjusted (run `setup` again).
    A field holding a rule (`SkipNonFinite(rule)`) may be swapped only for a rule whose state has the same
    structure, shapes and dtypes for every parameter.

    >>> import optim
    >>> optim.adjust(optim.OptimiserChain(optim.ClipGrad(2.0), optim.Adam(0.1)), 0.2)
    OptimiserChain(ClipGrad(delta=2), Adam(lr=0.2, beta=(0.9, 0.999), eps=1e-08))
    >>> optim.adjust(optim.Descent(1), lr=0.5)
    Descent(lr=0.5)
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
        if any(is_rule(v) or (isinstance(v, tuple) and any(map(is_rule, v))) for v in hyper.values()):
            _check_same_states(state, rules)
            # Numbers inside a swapped-in rule become device scalars like setup's (no retrace on the next swap);
            # plain hyperparameters already took the old value's dtype in `_convert`.
            rules = tuple(canonical_numbers(r) for r in rules)
        return State(state.layout, rules, state.stacks, state.step)
    return rules[0]


def _inner(rule: Any) -> list[str]:
    """The fields of `rule` that hold rules (`SkipNonFinite.rule`, `OptimiserChain.rules`): adjust goes inside."""
    if not dataclasses.is_dataclass(rule):
        return []
    out = []
    for f in dataclasses.fields(rule):
        v = getattr(rule, f.name)
        if is_rule(v) or (isinstance(v, tuple) and v and all(map(is_rule, v))):
            out.append(f.name)
    return out


def _fields(rules) -> set[str]:
    out = set()
    for r in rules:
        if dataclasses.is_dataclass(r):
            out |= {f.name for f in dataclasses.fields(r) if f.name not in getattr(r, "_static", ())}
            for name in _inner(r):
                v = getattr(r, name)
                out |= _fields(v if isinstance(v, tuple) else (v,))
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
    if isinstance(old, jax.Array) and not is_rule(new):
        return jnp.asarray(new, dtype=old.dtype).reshape(old.shape)
    return new


def _adjust_rule(rule: Any, hyper: dict, used: set) -> Any:
    if not dataclasses.is_dataclass(rule):
        return rule
    names = {f.name for f in dataclasses.fields(rule)}
    inner = _inner(rule)
    changes = {}
    for k, v in hyper.items():
        if k not in names:
            continue
        if k in getattr(rule, "_static", ()):
            raise ValueError(f"adjust: {type(rule).__name__}.{k} is structural (it changes the state's shape "
                             "or the program); call optim.setup again with the new rule")
        used.add(k)
        if isinstance(rule, Rule) and k not in inner:
            old = getattr(rule, k)
            if isinstance(old, tuple) and not isinstance(v, (tuple, list)):
                raise ValueError(f"adjust: {type(rule).__name__}.{k} is a tuple of {len(old)} values, got {v!r}")
            v = type(rule)._checked(k, v)      # the constructor's checks, and ints made floating
        changes[k] = v
    for k in inner:   # inside wrapped rules, unless the wrapped rule itself is being replaced
        if k not in changes:
            v = getattr(rule, k)
            if isinstance(v, tuple):
                new = tuple(_adjust_rule(r, hyper, used) for r in v)
            else:
                new = _adjust_rule(v, hyper, used)
            if new is not v and (not isinstance(v, tuple) or any(a is not b for a, b in zip(new, v))):
                changes[k] = new
    if not changes:
        return rule
    return _swap(rule, changes)


def _check_same_states(state: State, rules: tuple) -> None:
    """A swapped-in rule must have the same state (structure, shapes, dtypes) as the one it replaces."""
    seen = set()
    for u, p in enumerate(state.layout.params):
        if (p.rule, p.shape, p.dtype) in seen:     # one check per rule, shape and dtype
            continue
        seen.add((p.rule, p.shape, p.dtype))
        old, new = unwrap(state.rules[p.rule]), unwrap(rules[p.rule])
        x = jax.ShapeDtypeStruct(p.shape, p.dtype)
        try:
            a, b = jax.eval_shape(old.init, x), jax.eval_shape(new.init, x)
        except Exception as e:  # noqa: BLE001 (any failure of the new rule's init is the user's to see)
            raise ValueError(f"adjust: the new rule cannot initialise {show(state.paths()[u])}: {e}") from e
        shapes = lambda t: [(tuple(s.shape), jnp.dtype(s.dtype)) for s in jax.tree.leaves(t)]  # noqa: E731
        if jax.tree.structure(a) != jax.tree.structure(b) or shapes(a) != shapes(b):
            raise ValueError(f"adjust: the new rule keeps a different optimiser state for "
                             f"{show(state.paths()[u])} than the rule it replaces ({jax.tree.structure(b)} "
                             f"instead of {jax.tree.structure(a)}); build a fresh state with "
                             "optim.setup(new_rule, model, like=state) to keep what still fits")


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
    return with_frozen(state, select(state, patterns, "freeze"), True)


def thaw(state: State, *patterns: str) -> State:
    """Undo `freeze` for the matching parameters (all of them with no pattern)."""
    return with_frozen(state, select(state, patterns, "thaw"), False)


def select(state: State, patterns: tuple[str, ...], who: str) -> list[int]:
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
