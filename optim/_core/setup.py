"""`setup`: find a model's trainable leaves and ties, choose each parameter's rule and build the initial `State`."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._engine.strategies import wide_rules
from .._rules.hyper import canonical_numbers
from .._engine.stack import init_stack, placement
from .._rules.protocol import is_rule
from .._base.cache import LRU
from .layout import Layout, Param, TiedCopy, leaf_paths
from .state import State, StaticRule, func_name, unwrap
from .ties import tie_groups, tie_positions
from .._base.tree import (PyTree, canonical_dtype, describe, is_trainable, match_positions, show, suggest_pattern,
                    unique_index)


def _canonical_hyper(rule: Any, place: Any = None) -> Any:
    """Hyperparameters as strong-typed device scalars, so every later value (from `adjust`) has the same
    abstract type and a jitted step never retraces; on `place` (a sharding) when given. A rule that is not a
    pytree is kept as static data."""
    if jax.tree.leaves(rule) == [rule]:
        return StaticRule(rule)
    out = canonical_numbers(rule)
    return out if place is None else jax.tree.map(lambda a: jax.device_put(a, place), out)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:   # rules holding arrays do not compare; treat them as distinct
        return False


RuleSpec = Any  # a rule, or a function (path, array) -> rule


class by_path:   # noqa: N801 (a function-like name: it is used as `setup(by_path({...}), model)`)
    """A rule per parameter from a table of path patterns: the first pattern (in dict order) that matches a
    leaf's dotted path gives its rule. Patterns match as in `freeze`: the path itself, a prefix of it
    (`"encoder"` matches `encoder.w`), or an fnmatch pattern (`"*.bias"`, where `*` also crosses dots). Give it
    to `setup` in place of a rule.

    A trainable leaf that no pattern matches is a `ValueError` naming it (end the table with `"*"` for a
    default); so is a pattern that matches no trainable leaf (a typo such as `"*.bais"` would otherwise give
    its rule to nothing; a `"*"` default that every leaf reaches through an earlier pattern is fine), and so
    is a tie group whose members match patterns with different rules (a tie group is one parameter, with one
    rule). Entries stay separate rules even when they are equal, so each pattern's
    parameters can be adjusted alone, `adjust(state, "*.bias", lr=...)`, without compiling a new program
    (the same rule object under several patterns is one rule).

    Args:
        table: `{pattern: rule}`, a non-empty dict; the first pattern that matches a leaf gives its rule.

    Raises:
        TypeError: a pattern that is not a string, or an entry that is not a rule.

    >>> import jax.numpy as jnp, optim
    >>> dense = {"w": jnp.ones((2, 2)), "bias": jnp.zeros(2)}
    >>> model = {"dense": dense, "norm": {"scale": jnp.ones(2)}}
    >>> rule = optim.by_path({"*.bias": optim.Adam(1e-3), "norm": optim.Adam(1e-3),
    ...                       "*": optim.AdamW(1e-3, weight_decay=0.1)})
    >>> state = optim.setup(rule, model)
    >>> [(path, type(leaf.rule).__name__) for path, leaf in state.items()]
    [('dense.bias', 'Adam'), ('dense.w', 'AdamW'), ('norm.scale', 'Adam')]
    """

    def __init__(self, table: Mapping[str, Any]):
        if not isinstance(table, Mapping) or not table:
            raise TypeError(f"by_path takes a non-empty dict {{pattern: rule}}, e.g. by_path({{'*.bias': Adam(), "
                            f"'*': AdamW()}}); got {table!r}")
        for pattern, rule in table.items():
            if not isinstance(pattern, str):
                raise TypeError(f"by_path: patterns are dotted-path strings, got {type(pattern).__name__} "
                                f"{pattern!r}")
            if not is_rule(rule):
                raise TypeError(f"by_path: the entry for {pattern!r} is {rule!r}, which is not a rule (a rule has "
                                "init(x) and apply(state, x, dx, *dxs))")
        self.table = dict(table)

    def assign(self, paths: Sequence[str], positions: Sequence[int]) -> dict[int, Any]:
        """`{position: rule}` for the given (trainable) positions of a model whose leaves have dotted `paths`."""
        out: dict[int, Any] = {}
        for pattern, rule in self.table.items():
            found = match_positions(paths, pattern, positions)
            if not found and positions:
                raise ValueError(_unmatched(pattern, paths, positions))
            for i in found:
                out.setdefault(i, rule)
        for i in positions:
            if i not in out:
                raise ValueError(f"by_path: no pattern matches the trainable leaf {show(paths[i])} (patterns: "
                                 f"{', '.join(map(repr, self.table))}); add an entry for it, or '*' for every "
                                 "other leaf")
        return out

    def __repr__(self) -> str:
        return "by_path({" + ", ".join(f"{k!r}: {v!r}" for k, v in self.table.items()) + "})"


def _unmatched(pattern: str, paths: Sequence[str], positions: Sequence[int]) -> str:
    """Why a `by_path` pattern that selects no trainable leaf is refused (as `adjust` and `freeze` refuse one):
    it would give its rule to nothing, silently, and it is most often a typo."""
    trainable, chosen = sorted({paths[i] for i in positions}), set(positions)
    others = match_positions(paths, pattern, [i for i in range(len(paths)) if i not in chosen])
    why = (f" (it matches only {show(paths[others[0]])}, which is not trainable: only floating or complex arrays "
           "have a rule)" if others else suggest_pattern(pattern, trainable)
           or f" (paths look like {', '.join(map(repr, trainable[:3]))})")
    end = "" if why.endswith("?") else "."
    return (f"by_path: the pattern {pattern!r} matches no trainable leaf of the model{why}{end} Fix the pattern, "
            "or remove the entry: a pattern that selects nothing would give its rule to no parameter")


def setup(rule: RuleSpec, model: PyTree, *, ties: Mapping[str, Any] | None = None,
          like: State | None = None, state_sharding: Callable[[str, Any], Any] | None = None) -> State:
    """Initialise optimiser state for every trainable leaf of `model`.

    Runs once, outside `jit`. Trainable leaves are jax / numpy arrays of a floating or complex dtype; everything
    else is carried through `update` untouched. Leaves that are the same array object are one parameter (a tie
    group) with one state. Same-shaped parameters are stacked into one array per state field, with a leading
    member axis (the docs' [stacking page](../concepts/stacking.md)).

    Args:
        rule: the rule of every parameter (`optim.Adam(1e-3)`); or a function `(path, array) -> rule` choosing
            one per parameter (all members of a tie group must get the same rule); or an `optim.by_path` table.
        model: a pytree holding the parameters (and anything else, carried through).
        ties: explicit ties, `{path: canonical_path}`, or `{path: (canonical_path, f)}` when the leaf at `path`
            is `f(canonical)` for a linear `f` such as `jnp.transpose` (its gradient is pulled back through
            `f`; after each step it is recomputed as `f(new canonical)`). Inside a traced function (`jit`,
            `vmap`, `grad`, `eval_shape`) one array passed in at two positions arrives as two tracers, and
            identity cannot see the tie: there, distinct traced leaves of one shape and dtype are treated as
            separate parameters, with a `UserWarning` naming two of them (once per model structure in a
            process), unless `ties` says which are tied (`ties={}`: none, and no warning). The explicit ties
            are kept, and a tracer at several positions is still found by identity.
        like: an old `State`: every parameter whose canonical path, shape, dtype and state structure still
            match keeps its optimiser state, for a model that grew or shrank (new parameters start fresh).
        state_sharding: `fn(path, x)`, to place the optimiser state apart from the parameters (ZeRO-1:
            replicated parameters, moments sharded over the data axis). Called once per parameter (tie group)
            with its canonical dotted path and array, it returns a `jax.sharding.NamedSharding` (or
            `SingleDeviceSharding`) for that parameter's state, or None for the default (the state lives like
            the parameter). The state arrays of the parameter's shape (Adam's m and v) get that sharding; the
            rule's other state arrays (Adam's β powers, Adafactor's row / column statistics, counters) are
            replicated over the same mesh. `update`, eager or inside your `jit`, keeps the new state on these
            shardings and the parameters on theirs (each step then all-gathers the updated parameters). A
            parameter committed to devices needs its state on the same devices (over the same mesh when it is
            sharded); one not committed to any (numpy, an array made without a device) is put where its state
            is. A stack is sharded on the parameter's axes, never on the member axis (a member's `P(*spec)` is
            the stack's `P(None, *spec)`), and only parameters with equal state shardings share a stack.

    Returns:
        The `State`: the rules, each parameter's state (a tie group's once) and the step counter, 0.

    Raises:
        TypeError: `rule` is not a rule, a function or a `by_path` table; `like` is not a `State`; `ties` is
            not of the forms above; `state_sharding` is not callable or returns something other than such a
            sharding.
        ValueError: a tie that cannot hold (a path naming several leaves, a member given another rule); a
            state sharding that cannot shard the parameter's shape (a spec longer than its rank, a dimension
            the mesh axes do not divide evenly) or is on other devices than the parameter. Each error names
            the path, before any state is made.

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.ones(3)
    >>> state = optim.setup(optim.Adam(0.1), {"emb": w, "head": w, "step": 0})
    >>> state.ties()
    {'emb': ('head',)}
    >>> def choose(path, x):
    ...     return optim.Muon(0.02) if x.ndim == 2 else optim.AdamW(3e-4)
    >>> state = optim.setup(choose, {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)})
    >>> type(state["w"].rule).__name__, type(state["b"].rule).__name__
    ('Muon', 'AdamW')
    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> # ZeRO-1 over the data axis (here one device)
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> zero1 = lambda path, x: NamedSharding(mesh, P("data")) if x.ndim else None
    >>> model = {"w": jnp.ones((4, 2)), "gain": jnp.ones(())}
    >>> state = optim.setup(optim.Adam(0.1), model, state_sharding=zero1)
    >>> # Adam's moments where fn says, the β powers replicated
    >>> m, v, beta = state["w"].state
    >>> m.sharding.is_equivalent_to(zero1("w", m), m.ndim)
    True
    >>> beta.sharding.is_fully_replicated
    True
    """
    if not is_rule(rule) and not callable(rule) and not isinstance(rule, by_path):
        raise TypeError(f"setup: {rule!r} is not a rule; a rule has init(x) and apply(state, x, dx, *dxs)")
    if like is not None and not isinstance(like, State):
        raise TypeError(f"setup: like= takes a State, got {type(like).__name__}")
    leaves, treedef = jax.tree_util.tree_flatten(model)
    paths = _LazyPaths(treedef)
    trainable = [is_trainable(x) for x in leaves]
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
    _check_ties_form(ties)
    if traced and ties is None:
        _warn_traced_ties(leaves, trainable, paths, treedef)
    if ties:
        clash = set(paths) - unique_index(paths).keys()     # dotted names that several leaves share
        for p in [q for k, v in ties.items() for q in (k, v if isinstance(v, str) else v[0])]:
            if p in clash:
                raise ValueError(f"ties: {show(p)} names several leaves (the model's dotted names collide, e.g. "
                                 "a key 'a.b' beside a subtree 'a' with key 'b'); rename a key to tie it")
    plain = {k: v for k, v in (ties or {}).items() if isinstance(v, str)}
    groups = tie_groups(paths, leaves, trainable, plain)
    transforms = _transformed(ties or {}, groups, paths, leaves, trainable)
    if not groups:
        warnings.warn("optim.setup found no trainable leaves (floating or complex arrays) in the model",
                      stacklevel=2)
    rules, rule_of = _choose_rules(rule, groups, paths, leaves)
    shardings = _state_shardings(state_sharding, groups, paths, leaves)
    params = tuple(Param(c, members, tuple(leaves[c].shape), canonical_dtype(leaves[c].dtype), rule_of[c],
                         transforms.get(c, ()), placement(leaves[c]), shardings.get(c))
                   for c, members in groups.items())
    layout = Layout(treedef, params, (False,) * len(params), wide_rules(tuple(unwrap(r) for r in rules)))
    if paths.computed is not None:
        layout.__dict__["paths"] = paths.computed
    mesh_scalar = _replicated(params, traced)
    rules = tuple(_canonical_hyper(r, mesh_scalar) for r in rules)
    cache: dict = {}
    stacks = tuple(init_stack(unwrap(rules[params[members[0]].rule]), [leaves[params[u].canonical] for u in members],
                              lambda members=members: paths[params[members[0]].canonical], cache,
                              local=not traced and params[members[0]].place is None,
                              sharding=params[members[0]].state_place) for members in layout.stacks)
    step = jnp.zeros((), jnp.int32)
    state = State(layout, rules, stacks, step if mesh_scalar is None else jax.device_put(step, mesh_scalar))
    if mesh_scalar is not None:
        state = jax.tree.map(_jit_spec, state)
    if like is not None:
        state = _keep_matching(like, state)
    return state


def _replicated(params: tuple, traced: bool) -> Any:
    """Where the state's scalars go (the step counter, the rules' hyperparameters): replicated over the mesh
    of the parameters (or of their state) when they are sharded, else None (the default device). A jitted step
    over that mesh returns them there, so a fresh state placed like that is not compiled for twice (once for
    scalars on one device, once for the replicated ones the first step returns), and a restore target built
    from it (orbax) puts them where the step accepts them."""
    if not traced:
        for p in params:
            s = p.state_place if p.state_place is not None else p.place
            if isinstance(s, jax.sharding.NamedSharding):
                return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
    return None


def _jit_spec(a: Any) -> Any:
    """`a` with its `NamedSharding`'s spec in the form a jitted step returns, sharing its buffers: on a mesh with
    `Explicit` axes one entry per axis (`P()` on a matrix becomes `P(None, None)`), on one with only `Auto` axes
    without trailing `None`s. The forms place the data alike, but a jitted step's cache tells them apart: a
    fresh state in another form than the step's outputs would be compiled for twice."""
    s = getattr(a, "sharding", None)
    if not isinstance(a, jax.Array) or not isinstance(s, jax.sharding.NamedSharding):
        return a
    spec = list(s.spec) + [None] * (a.ndim - len(s.spec))
    if all(t == jax.sharding.AxisType.Auto for t in s.mesh.axis_types):
        while spec and spec[-1] is None:
            spec.pop()
    if tuple(spec) == tuple(s.spec):
        return a
    form = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=s.memory_kind)
    return jax.make_array_from_single_device_arrays(a.shape, form, [d.data for d in a.addressable_shards])


def _state_shardings(fn: Any, groups: dict, paths: Any, leaves: list) -> dict:
    """`setup(..., state_sharding=fn)`: `{canonical position: sharding}` for the parameters `fn` places, each
    checked against its parameter's shape (see `setup`)."""
    if fn is None:
        return {}
    if not callable(fn):
        raise TypeError(f"setup: state_sharding= takes a function (path, array) -> jax.sharding.Sharding or None, "
                        f"got {type(fn).__name__} {fn!r}")
    out = {}
    for c in groups:
        x = leaves[c]
        s = fn(paths[c], x)
        if s is None:
            continue
        if not isinstance(s, jax.sharding.Sharding):
            hint = (" (a PartitionSpec says how, not over which devices: wrap it, NamedSharding(mesh, spec))"
                    if isinstance(s, jax.sharding.PartitionSpec) else "")
            raise TypeError(f"setup: state_sharding returned {s!r} for {show(paths[c])}{hint}; it must return a "
                            "jax.sharding.Sharding (e.g. NamedSharding(mesh, P('data'))) or None")
        if not isinstance(s, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
            raise TypeError(f"setup: state_sharding returned a {type(s).__name__} for {show(paths[c])}; optim places "
                            "stacked state from a NamedSharding or a SingleDeviceSharding: use one of those")
        _check_devices(s, x, paths[c])
        shape = tuple(np.shape(x))
        try:
            s.check_compatible_aval(shape)
            s.shard_shape(shape)
        except (ValueError, IndexError) as e:
            raise ValueError(f"setup: state_sharding gives {show(paths[c])} ({describe(x)}) the sharding {s}, which "
                             f"cannot shard that shape: {e}") from None
        out[c] = s
    return out


def _check_devices(s: Any, x: Any, path: str) -> None:
    """A parameter's state lives on the parameter's devices (the same device set) and, for a parameter sharded
    over a mesh, over that mesh. The step reads both in one program, which JAX refuses for arrays committed to
    different devices or meshes, at the first `update` and without naming the parameter. A parameter not
    committed to devices (numpy, an array made without a device) has no devices of its own: jit puts it where
    its state is."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or not getattr(x, "committed", False):
        return
    have, want = x.sharding.device_set, s.device_set
    if have != want:
        ids = lambda devs: sorted(d.id for d in devs)   # noqa: E731
        raise ValueError(f"setup: state_sharding gives {show(path)} a sharding on devices {ids(want)}, but the "
                         f"parameter lives on devices {ids(have)}; a parameter's state must live on the "
                         "parameter's devices (the same set, e.g. a NamedSharding over the parameter's mesh)")
    mesh = getattr(x.sharding, "mesh", None)
    if isinstance(s, jax.sharding.NamedSharding) and isinstance(x.sharding, jax.sharding.NamedSharding) \
            and s.mesh != mesh:
        # JAX's programs take one mesh: "Mesh for all inputs should be equal", again only at `update`.
        raise ValueError(f"setup: state_sharding gives {show(path)} a sharding over the mesh {s.mesh}, but the "
                         f"parameter is sharded over {mesh}; shard its state over the parameter's mesh "
                         "(NamedSharding(x.sharding.mesh, spec))")


# Model structures (treedefs) already warned about by `_warn_traced_ties`. 64: a program traces setup for a few
# model structures; past that, evicting one only means its warning may be given once more.
_WARNED_TRACED = LRU(64)


def _warn_traced_ties(leaves: list, trainable: list, paths: Any, treedef: Any) -> None:
    """`setup` inside a traced function (jit, vmap, grad, eval_shape) without `ties=`: a `UserWarning` when a
    tie could have been lost, once per model structure (`treedef`) in a process (a jitted function traces once
    per shape, `eval_shape` on every call: one warning is enough to act on). Each array argument of a traced
    function becomes its own tracer, so one array at two positions of a model passed in arrives as two objects,
    and identity no longer finds the tie. A tracer at several positions (a model built inside the trace) is
    still one object, and leaves of different shapes or dtypes cannot be tied; so only distinct traced
    trainable leaves of one shape and dtype are ambiguous. They are treated as separate parameters (a trace
    cannot tell, and optax-style code such as `jax.jit(tx.init)` or `jax.eval_shape(tx.init, params)` must
    work); `ties=` (`{}` for none) says which are tied, and is then what `setup` uses, without a warning."""
    seen: dict = {}
    pairs = []
    for i, (x, t) in enumerate(zip(leaves, trainable)):
        if not (t and isinstance(x, jax.core.Tracer)):
            continue
        j = seen.setdefault((tuple(x.shape), jnp.dtype(x.dtype)), i)
        if leaves[j] is not x:
            pairs.append((j, i))
    if not pairs or treedef in _WARNED_TRACED:
        return
    _WARNED_TRACED[treedef] = True
    (j, i), more = pairs[0], len({k for pair in pairs for k in pair}) - 2
    others = f" ({more} other leaf{'s' if more > 1 else ''} could be tied likewise)" if more > 0 else ""
    warnings.warn(
        f"setup: called inside a traced function (jit, vmap, grad, eval_shape), where object identity cannot be "
        f"seen (each array argument becomes its own tracer): the leaves {show(paths[j])} and {show(paths[i])} "
        f"({describe(leaves[i])}){others} could be one array passed in twice (a tie), and are treated as separate "
        f"parameters. If they are tied, declare it: ties={{{paths[i]!r}: {paths[j]!r}}} (ties={{}} for none, which "
        "also silences this warning; to_optax(rule, ties=...) for a to_optax transformation), or call setup "
        "(or the to_optax transformation's init) once outside the traced function, where ties are found by "
        "identity. (Warned once per model structure.)", UserWarning, stacklevel=3)


def _check_ties_form(ties: Any) -> None:
    """`ties=` is `{path: canonical_path}` or `{path: (canonical_path, f)}`: refuse anything else up front."""
    if ties is None:
        return
    if not isinstance(ties, Mapping):
        raise TypeError(f"setup: ties= takes a dict {{path: canonical_path}}, e.g. ties={{'head.w': 'emb.w'}}; got "
                        f"{type(ties).__name__} {ties!r}" + (" (for a list of pairs, write ties=dict(pairs))"
                                                             if isinstance(ties, (list, tuple)) else ""))
    for k, v in ties.items():
        if not isinstance(k, str):
            raise TypeError(f"setup: ties= keys are dotted paths (str), got {type(k).__name__} {k!r}; "
                            "write ties={'head.w': 'emb.w'}")
        if not (isinstance(v, str) or (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)
                                       and callable(v[1]))):
            raise TypeError(f"setup: ties[{k!r}] must be a canonical path (str) or (path, function), got {v!r}")


def _choose_rules(rule: RuleSpec, groups: dict, paths: Any, leaves: list) -> tuple[list, dict]:
    if is_rule(rule):
        return [rule], {c: 0 for c in groups}
    # Parameters with equal rules share one rule (and so can be stacked): a function that builds a new rule per
    # call is common. A by_path table's entries stay apart even when equal, so that `adjust` of one pattern's
    # parameters never has to split a rule (which would compile a new program).
    if isinstance(rule, by_path):
        table = rule.assign(tuple(paths), [i for members in groups.values() for i in members])
        choose, same = table.__getitem__, (lambda a, b: a is b)
    else:
        choose, same = (lambda i: rule(paths[i], leaves[i])), _same
    rules: list = []
    rule_of = {}
    for c, members in groups.items():
        chosen = [choose(i) for i in members]
        for i, r in zip(members, chosen):
            if not is_rule(r):
                raise TypeError(f"setup: the rule function returned {r!r} for {show(paths[i])}, which is not a rule")
            if not same(r, chosen[0]):
                raise ValueError(f"setup: {show(paths[c])} and {show(paths[i])} are tied (one parameter) but the rule "
                                 f"function gives them different rules: {chosen[0]!r} and {r!r}")
        k = next((k for k, r in enumerate(rules) if same(r, chosen[0])), None)
        if k is None:
            k = len(rules)
            rules.append(chosen[0])
        rule_of[c] = k
    return rules, rule_of


def _transformed(ties: Mapping[str, Any], groups: dict, paths: Any, leaves: list, trainable: list) -> dict:
    """Explicit ties through a function: `{path: (canonical_path, f)}` -> {canonical: ((pos, f, shape, dtype),)}."""
    out: dict = {}
    if not any(not isinstance(v, str) for v in ties.values()):
        return out
    index = unique_index(paths)
    canon_of = {i: c for c, members in groups.items() for i in members}
    for src, spec in ties.items():
        if isinstance(spec, str):
            continue
        if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and callable(spec[1])):
            raise TypeError(f"ties[{src!r}]: expected a path or (path, function), got {spec!r}")
        dst, f = spec
        i, j = tie_positions(index, leaves, trainable, src, dst)
        c = canon_of[j]
        if len(groups.get(canon_of[i], ())) > 1 or canon_of[i] in out or i == c:
            raise ValueError(f"ties: {show(src)} is already tied to other positions; a transformed tie needs a "
                             "leaf of its own")
        want = jax.eval_shape(f, jax.ShapeDtypeStruct(leaves[c].shape, leaves[c].dtype))
        got = leaves[i]
        if tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype:
            raise ValueError(f"ties: {show(src)} is {describe(got)} but {func_name(f)}({show(dst)}) is "
                             f"{jnp.dtype(want.dtype).name}{list(want.shape)}")
        out.setdefault(c, []).append(TiedCopy(i, f, tuple(got.shape), canonical_dtype(got.dtype)))
        del groups[canon_of[i]]
    return {c: tuple(v) for c, v in out.items()}


def _keep_matching(old: State, fresh: State) -> State:
    """State surgery: reuse `old`'s state where the canonical path, shape, dtype and state structure match."""
    layout, kept = fresh.layout, {}
    for u, p in enumerate(layout.params):
        path = layout.paths[p.canonical]
        if path not in old:
            continue
        v = old.layout.param(path)
        q = old.layout.params[v]
        was, new = old.param_state(v), fresh.param_state(u)
        same_tree = jax.tree.structure(was) == jax.tree.structure(new)
        if q.shape == p.shape and q.dtype == p.dtype and same_tree and all(
                np.shape(a) == np.shape(b) and jnp.dtype(a.dtype) == jnp.dtype(b.dtype)
                for a, b in zip(jax.tree.leaves(was), jax.tree.leaves(new))):
            kept[u] = was
    return fresh.with_param_states(kept) if kept else fresh


class _LazyPaths:
    """Dotted paths of a treedef's leaves, computed (and checked for duplicates) on first use."""

    def __init__(self, treedef):
        self.treedef, self.computed = treedef, None

    def __getitem__(self, i):
        if self.computed is None:
            self.computed = tuple(leaf_paths(self.treedef))
        return self.computed[i]

    def __iter__(self):
        return iter([self[i] for i in range(self.treedef.num_leaves)])

