"""Change hyperparameters (`adjust`) and frozen flags (`freeze`, `thaw`) of a state, returning a new one.

Hyperparameters are pytree leaves of the state, so `adjust` changes data, never the compiled program: the new
value keeps the old leaf's dtype and shape. Frozen flags are static (they decide which parameters the program
steps), so `freeze` / `thaw` compile a new program once per combination.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine.strategies import wide_rules
from .._rules.protocol import Rule, inner_fields, inner_rules, is_rule, looks_across
from .._rules.schedules import Schedule
from .._rules.hyper import canonical_numbers
from .layout import Layout, PathError
from .state import State, unwrap, with_frozen
from .._base.tree import replace_fields, show, suggest_pattern

def adjust(state: Any, *args: Any, **hyper: Any) -> Any:
    """Return `state` (or a rule) with hyperparameters replaced wherever a rule has them.

    `adjust(state, 1e-4)` sets `lr`; `adjust(state, beta=(0.8, 0.99), weight_decay=0.1)` sets those fields. It
    reaches every rule inside another: chains, `MixedPrecision`, `SkipNonFinite`, `AccumGrad`, factory-form
    `from_optax` rules, nested in any order. New values are checked like the constructor's (a negative `lr` is
    a `ValueError`) and keep the old value's dtype, so a jitted step never recompiles; a value given as an int
    is a float like any other. A keyword that no rule in the state has is a `TypeError` (a typo would otherwise
    be silently ignored); structural fields such as `RMSProp.centred` cannot be adjusted (run `setup` again).
    A field holding a rule (`SkipNonFinite(rule)`) may be swapped only for a rule whose state has the same
    structure, shapes and dtypes for every parameter.

    A decay rate changed mid-run (`adjust(state, beta=(0.5, 0.99))`, or a β schedule) takes effect at the next
    step, and the Adam family's bias correction stays exact: each step divides by `1 - ∏β` over the β's the
    steps actually used, the weight its moment's average has put on gradients so far (not `1 - βᵗ` of the new β,
    which optax's `inject_hyperparams` uses). Changed before the first step, it is as if given at `setup`.

    String arguments are path patterns, matched as `freeze` matches them (a dotted path, a prefix of one, or an
    fnmatch pattern; a tie group is one parameter): `adjust(state, "encoder.*", lr=1e-4)` changes only the
    parameters they select, and a pattern that selects none is a `ValueError` naming it. The first time a
    pattern singles out some of the parameters that share a rule, those get a copy of the rule of their own,
    which changes the state's layout and so compiles a new program once (as `freeze` does); every later adjust
    of their values, or of the whole state, changes data only.

    Args:
        state: an optimiser state from `setup`, or a rule.
        *args: path patterns (strings) selecting the parameters to change, then at most one number: the new
            `lr`.
        **hyper: the new values, by field name (`beta=(0.8, 0.99)`); each may be a schedule.

    Returns:
        A new state (or rule) of the same kind; `state` is not modified.

    Raises:
        TypeError: a keyword that no rule in the state has, or a structural field.
        ValueError: a value the constructor would refuse, or a pattern that selects no parameter.

    >>> import jax.numpy as jnp, optim
    >>> chain = optim.OptimiserChain(optim.ClipGrad(2.0), optim.Adam(0.1))
    >>> optim.adjust(chain, 0.2)
    OptimiserChain(ClipGrad(delta=2), Adam(lr=0.2, beta=(0.9, 0.999), eps=1e-08))
    >>> optim.adjust(optim.Descent(1), lr=0.5)
    Descent(lr=0.5)
    >>> model = {"enc": {"w": jnp.ones(2)}, "dec": {"w": jnp.ones(2)}}
    >>> state = optim.setup(optim.Adam(0.1), model)
    >>> state = optim.adjust(state, "enc", lr=0.01)
    >>> state["enc.w"].rule.lr, state["dec.w"].rule.lr
    (Array(0.01, dtype=float32), Array(0.1, dtype=float32))
    """
    patterns = tuple(a for a in args if isinstance(a, str))
    values = [a for a in args if not isinstance(a, str)]
    if len(values) > 1:
        raise TypeError(f"adjust: at most one positional value (the learning rate), got {len(values)}; give the "
                        "others by name, e.g. adjust(state, lr=1e-4, weight_decay=0.1)")
    if values:
        if "lr" in hyper:
            raise TypeError("adjust: lr given twice (positionally and as lr=)")
        hyper = {"lr": values[0], **hyper}
    if not hyper:
        raise TypeError("adjust: give at least one hyperparameter, e.g. adjust(state, lr=1e-4)")
    if patterns:
        if not isinstance(state, State):
            raise TypeError(f"adjust: path patterns ({', '.join(map(repr, patterns))}) select parameters of a State "
                            f"from optim.setup, got {type(state).__name__}")
        return _adjust_paths(state, patterns, hyper)
    used: set[str] = set()
    if isinstance(state, State):
        rules = tuple(_adjust_rule(r, hyper, used) for r in state.rules)
    else:
        rules = (_adjust_rule(state, hyper, used),)
    _check_used(hyper, used, state.rules if isinstance(state, State) else (state,))
    if isinstance(state, State):
        lay = state.layout
        rules = _swapped_in(lay, state.rules, rules, [p.rule for p in lay.params], hyper)
        return state.replace(layout=lay, rules=_placed_like(rules, state.step))
    return rules[0]


def _placed_like(rules: tuple, step: Any) -> tuple:
    """The rules' numbers put where the state's scalars live (`step`: replicated over the parameters' mesh, by
    `setup`) when that is a mesh: a new value made on the default device would give a jitted step an input on
    another sharding, and so compile it again."""
    place = getattr(step, "sharding", None)
    if isinstance(step, jax.core.Tracer) or not isinstance(place, jax.sharding.NamedSharding):
        return rules

    def put(a: Any) -> Any:
        if not isinstance(a, jax.Array) or isinstance(a, jax.core.Tracer) or a.sharding == place:
            return a
        return jax.device_put(a, place)

    return jax.tree.map(put, rules)


def _check_used(hyper: dict, used: set, rules: tuple) -> None:
    unknown = sorted(set(hyper) - used)
    if unknown:
        have = sorted(_fields(rules))
        raise TypeError(f"adjust: no rule here has {', '.join(unknown)}; adjustable: {', '.join(have) or 'none'}")


def _swapped_in(lay: Any, old: tuple, new: tuple, rule_of: list[int], hyper: dict) -> tuple:
    """The new rules, after checking that any rule swapped in keeps every parameter's state as it is
    (parameter `u` had `old[lay.params[u].rule]` and gets `new[rule_of[u]]`)."""
    if any(is_rule(v) or (isinstance(v, tuple) and any(map(is_rule, v))) for v in hyper.values()):
        _check_same_states(lay, [(old[p.rule], new[r]) for p, r in zip(lay.params, rule_of)])
        # Numbers inside a swapped-in rule become device scalars like setup's (no retrace on the next swap);
        # plain hyperparameters already took the old value's dtype in `_convert`.
        return tuple(canonical_numbers(r) for r in new)
    return tuple(new)


def _adjust_paths(state: State, patterns: tuple, hyper: dict) -> State:
    """`adjust` of the parameters that `patterns` select. A rule all of whose parameters are selected is
    adjusted in place; the selected parameters of a rule shared with unselected ones get an adjusted copy of
    it as a new rule, and the state is restacked under the new layout (a stack holds one rule)."""
    lay = state.layout
    chosen = set(select(state, patterns, "adjust"))
    users: dict[int, list[int]] = {}
    for u, p in enumerate(lay.params):
        users.setdefault(p.rule, []).append(u)
    rules, rule_of, used = list(state.rules), [p.rule for p in lay.params], set()
    for r, us in users.items():
        mine = [u for u in us if u in chosen]
        if not mine:
            continue
        new = _adjust_rule(state.rules[r], hyper, used)
        if new is state.rules[r]:       # this rule has none of the fields: nothing to split
            continue
        if len(mine) == len(us):
            rules[r] = new
        else:
            across = looks_across(state.rules[r])
            if across:
                raise ValueError(
                    f"adjust: {show(lay.paths[lay.params[mine[0]].canonical])} shares its rule with "
                    f"{len(us) - len(mine)} parameter(s) that the pattern does not select, and the rule looks across "
                    f"its parameters ({across}): an adjusted copy for the selected ones would clip or skip them on "
                    "their own, not with the others. Adjust every parameter of the rule (no pattern), or give the "
                    "parts rules of their own at setup with optim.by_path if separate norms are what you want")
            for u in mine:
                rule_of[u] = len(rules)
            rules.append(new)
    _check_used(hyper, used, tuple(state.rules[r] for r in sorted({lay.params[u].rule for u in chosen})))
    rules = _placed_like(_swapped_in(lay, state.rules, tuple(rules), rule_of, hyper), state.step)
    if len(rules) == len(state.rules):
        return state.replace(layout=lay, rules=rules)
    params = tuple(p if p.rule == r else dataclasses.replace(p, rule=r) for p, r in zip(lay.params, rule_of))
    layout = Layout(lay.treedef, params, lay.frozen, wide_rules(tuple(unwrap(r) for r in rules)))
    if "paths" in lay.__dict__:
        layout.__dict__["paths"] = lay.paths
    return state.regroup(layout, rules)


def _fields(rules) -> set[str]:
    out = set()
    for r in rules:
        if dataclasses.is_dataclass(r):
            out |= {f.name for f in dataclasses.fields(r) if f.name not in getattr(r, "_static", ())}
            out |= _fields(inner_rules(r))
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
    inner = inner_fields(rule)
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
            if (v is None) != (old is None):   # an optional part of the rule (Adafactor's momentum) on or off
                raise ValueError(f"adjust: {type(rule).__name__}.{k}: between None and a number is structural "
                                 f"(it changes the state or the program); call optim.setup again with the new rule")
        if k not in inner:
            _check_shape(type(rule).__name__, k, v, getattr(rule, k))
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


def _check_shape(owner: str, name: str, new: Any, old: Any) -> None:
    """A new value takes the old one's place in the state, keeping its shape (so that a jitted step never
    retraces): a scalar hyperparameter gets one number (or a schedule). Checked for every field, also those of
    rules whose constructor does not check them, and for traced values (their shape is known)."""
    if isinstance(old, tuple) and isinstance(new, (tuple, list)):
        for k, (n, o) in enumerate(zip(new, old)):
            _check_shape(owner, f"{name}[{k}]", n, o)
        return
    if not isinstance(old, jax.Array) or is_rule(new) or isinstance(new, Schedule):
        return
    try:
        shape = np.shape(new)
    except Exception:  # noqa: BLE001 (not array-like: the conversion below says what it is)
        return
    if math.prod(shape) != old.size:
        what = "a scalar" if old.ndim == 0 else f"of shape {tuple(old.shape)}"
        raise ValueError(f"adjust: {owner}.{name} is {what} but the new value is an array of shape {shape}: a "
                         "hyperparameter is one number (or an optim schedule, for one that changes with the step) "
                         "and keeps its shape in the state; give parameters different values with "
                         "adjust(state, pattern, ...)")


def _check_same_states(lay: Any, pairs: list) -> None:
    """A swapped-in rule must keep the same state (structure, shapes, dtypes) as the rule it replaces: `pairs`
    holds each parameter's (old rule, new rule)."""
    seen = set()
    for p, (old, new) in zip(lay.params, pairs):
        if (id(old), id(new), p.shape, p.dtype) in seen:     # one check per rule pair, shape and dtype
            continue
        seen.add((id(old), id(new), p.shape, p.dtype))
        old, new = unwrap(old), unwrap(new)
        path = lay.paths[p.canonical]
        x = jax.ShapeDtypeStruct(p.shape, p.dtype)
        try:
            a, b = jax.eval_shape(old.init, x), jax.eval_shape(new.init, x)
        except Exception as e:  # noqa: BLE001 (any failure of the new rule's init is the user's to see)
            raise ValueError(f"adjust: the new rule cannot initialise {show(path)}: {e}") from e
        shapes = lambda t: [(tuple(s.shape), jnp.dtype(s.dtype)) for s in jax.tree.leaves(t)]  # noqa: E731
        if jax.tree.structure(a) != jax.tree.structure(b) or shapes(a) != shapes(b):
            raise ValueError(f"adjust: the new rule keeps a different optimiser state for "
                             f"{show(path)} than the rule it replaces ({jax.tree.structure(b)} "
                             f"instead of {jax.tree.structure(a)}); build a fresh state with "
                             "optim.setup(new_rule, model, like=state) to keep what still fits")


def _swap(rule: Any, changes: dict) -> Any:
    """A copy of `rule` with `changes`, each new value in the form (dtype) of the field it replaces. Built without
    `__init__`, like JAX's unflatten: the values were validated above, and may be tracers."""
    return replace_fields(rule, {f.name: _convert(changes[f.name], getattr(rule, f.name))
                                 for f in dataclasses.fields(rule) if f.name in changes})


def freeze(state: State, *patterns: str) -> State:
    """Freeze the parameters whose dotted path (any tied member) equals, lies below, or fnmatch-matches a
    pattern; with no pattern, every parameter. A frozen parameter gets no step and its state is kept.

    Args:
        state: the optimiser state, from `setup`.
        *patterns: dotted paths (`"encoder.w"`), prefixes (`"encoder"`) or fnmatch patterns (`"*.bias"`).

    Returns:
        A new state with those parameters frozen; `state` is not modified.

    Raises:
        PathError: a pattern that matches no trainable path (a `ValueError`).

    >>> import jax.numpy as jnp, optim
    >>> model = {"encoder": {"w": jnp.ones(2)}, "head": jnp.ones(2)}
    >>> state = optim.freeze(optim.setup(optim.Descent(0.5), model), "encoder")
    >>> grads = {"encoder": {"w": jnp.ones(2)}, "head": jnp.ones(2)}
    >>> state, model = optim.update(state, model, grads)
    >>> model["encoder"]["w"], model["head"]
    (Array([1., 1.], dtype=float32), Array([0.5, 0.5], dtype=float32))
    """
    return with_frozen(state, select(state, patterns, "freeze"), True)


def thaw(state: State, *patterns: str) -> State:
    """Undo `freeze` for the matching parameters (all of them with no pattern).

    Args:
        state: the optimiser state, from `setup`.
        *patterns: as for `freeze`.

    Returns:
        A new state with those parameters stepping again; `state` is not modified.
    """
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
            raise PathError(f"{who}: {pat!r} matches no trainable path of the model"
                            + (suggest_pattern(pat, state.paths())
                               or f" (paths look like {', '.join(repr(p) for p in state.paths()[:3])})"))
        hits += found
    return hits
