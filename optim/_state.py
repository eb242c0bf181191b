"""The optimiser state: `setup`, `State`, `Leaf` and the static `Layout` that `update` compiles against.

A `State` is a pytree. Its leaves are the rules' hyperparameters and each parameter's optimiser state; its
static part, the `Layout`, holds the model's treedef, every leaf's dotted path, the tie groups and the frozen
flags. The layout is hashable and compares by value, so a fresh `setup` of an equal structure never makes a
jitted function retrace; comparing a layout with itself is an identity check, so the per-call cost is nil.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import warnings
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ._tree import PyTree, describe, flatten, is_trainable, show
from ._ties import tie_groups, tie_positions


@dataclasses.dataclass(frozen=True)
class Param:
    """One real parameter: its canonical position, all tied positions, shape, dtype and rule index."""

    canonical: int
    members: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    rule: int = 0
    # Positions that hold f(canonical) rather than the canonical array itself: ((position, f, shape, dtype), ...)
    transforms: tuple = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Static description of a model as seen by a `State` (hashable, compares by value).

    Dotted paths are derived from the treedef the first time something needs a name (errors, `freeze`,
    `state[path]`, repr), so `setup` needs only JAX's C++ flatten.
    """

    treedef: Any
    params: tuple[Param, ...]
    frozen: tuple[bool, ...]

    def __post_init__(self):
        param_of = [-1] * self.treedef.num_leaves
        for u, p in enumerate(self.params):
            for i in p.members + tuple(t[0] for t in p.transforms):
                param_of[i] = u
        object.__setattr__(self, "param_of", tuple(param_of))
        object.__setattr__(self, "_hash", hash((self.treedef, self.params, self.frozen)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        if self is other:
            return True
        return (isinstance(other, Layout) and self._hash == other._hash and self.treedef == other.treedef
                and self.params == other.params and self.frozen == other.frozen)

    @functools.cached_property
    def paths(self) -> tuple[str, ...]:
        """The dotted path of every leaf position, in flatten order."""
        return tuple(leaf_paths(self.treedef))

    @functools.cached_property
    def index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.paths)}

    def param(self, path: str) -> int:
        """The index of the parameter at dotted `path` (any member of a tie group)."""
        i = self.index.get(path)
        if i is None:
            raise PathError(f"{show(path)} is not a leaf path of the model{_suggest(path, self.paths)}")
        u = self.param_of[i]
        if u < 0:
            raise PathError(f"{show(path)} is not a trainable leaf (only floating or complex arrays have state)")
        return u

    def match(self, pattern: str) -> list[int]:
        """Parameters with a member path equal to, below, or fnmatch-matching `pattern`."""
        hits = set()
        for i, p in enumerate(self.paths):
            if self.param_of[i] >= 0 and (p == pattern or p.startswith(pattern + ".") or pattern == ""
                                          or fnmatch.fnmatchcase(p, pattern)):
                hits.add(self.param_of[i])
        return sorted(hits)


class PathError(ValueError, KeyError):
    """A dotted path that does not name what it should. A `ValueError` (and a `KeyError` for `state[...]`)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


def _suggest(path: str, paths: tuple[str, ...]) -> str:
    import difflib

    close = difflib.get_close_matches(path, paths, n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """The optimiser state of one parameter: its rule, the rule's state and whether it is frozen."""

    rule: Any
    state: Any
    frozen: bool = False


@jax.tree_util.register_pytree_with_keys_class
class State:
    """Optimiser state for a whole model; build it with `optim.setup`.

    `state[path]` returns the `Leaf` of the parameter at a dotted path (any member of a tie group gives the
    canonical parameter's leaf). The state is a pytree: pass it through `jax.jit`, `pmap`, `vmap` as usual.
    """

    __slots__ = ("layout", "rules", "leaves", "step")

    def __init__(self, layout: Layout, rules: tuple, leaves: tuple, step: Any):
        self.layout = layout
        self.rules = rules      # one entry per distinct rule; Param.rule indexes into it
        self.leaves = leaves    # one optimiser state per parameter, in Layout.params order
        self.step = step        # number of update calls so far: what schedules are evaluated at

    def tree_flatten_with_keys(self):
        k = jax.tree_util.GetAttrKey
        return ((k("rules"), self.rules), (k("leaves"), self.leaves), (k("step"), self.step)), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(layout, *children)

    @property
    def rule(self) -> Any:
        """The rule, when the whole model uses one."""
        if len(self.rules) != 1:
            raise ValueError("this state uses several rules; look one up with state[path].rule")
        return unwrap(self.rules[0])

    def __getitem__(self, path: str) -> Leaf:
        if not isinstance(path, str):
            raise TypeError(f"state[...] takes a dotted path string, got {type(path).__name__}")
        u = self.layout.param(path)
        p = self.layout.params[u]
        return Leaf(unwrap(self.rules[p.rule]), self.leaves[u], self.layout.frozen[u])

    def __contains__(self, path: str) -> bool:
        i = self.layout.index.get(path)
        return i is not None and self.layout.param_of[i] >= 0

    def paths(self) -> list[str]:
        """The canonical path of every parameter, in flatten order."""
        return [self.layout.paths[p.canonical] for p in self.layout.params]

    def items(self) -> Iterator[tuple[str, Leaf]]:
        """`(canonical_path, Leaf)` for every parameter."""
        for path in self.paths():
            yield path, self[path]

    def ties(self) -> dict[str, tuple[str, ...]]:
        """`{canonical_path: (other tied paths, ...)}` for every group of more than one position."""
        paths = self.layout.paths
        return {paths[p.canonical]: tuple(paths[i] for i in p.members[1:]) + tuple(paths[t[0]] for t in p.transforms)
                for p in self.layout.params if len(p.members) + len(p.transforms) > 1}

    def __len__(self) -> int:
        return len(self.layout.params)

    def __repr__(self) -> str:
        lay = self.layout
        positions = sum(len(p.members) + len(p.transforms) for p in lay.params)
        lines = [f"State({len(lay.params)} parameters, {positions} positions)"]
        for u, p in enumerate(lay.params):
            shapes = jax.tree.map(lambda a: describe(a), self.leaves[u])
            flags = " frozen" if lay.frozen[u] else ""
            tied = ""
            if len(p.members) + len(p.transforms) > 1:
                tied = "  tied: " + ", ".join([lay.paths[i] for i in p.members[1:]]
                                              + [f"{lay.paths[t[0]]} = {_fname(t[1])}(·)" for t in p.transforms])
            lines.append(f"  {lay.paths[p.canonical] or '<root>'}: {jnp.dtype(p.dtype).name}{list(p.shape)} "
                         f"{unwrap(self.rules[p.rule])!r} state={shapes}{flags}{tied}")
        return "\n".join(lines)


def _fname(f: Callable) -> str:
    return getattr(f, "__name__", type(f).__name__)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """A user rule that is not a pytree, carried as static data (compared by identity)."""

    rule: Any


def unwrap(rule: Any) -> Any:
    return rule.rule if isinstance(rule, _Static) else rule


def _canonical_hyper(rule: Any) -> Any:
    """Hyperparameters as strong-typed device scalars, so every later value (from `adjust`) has the same
    abstract type and a jitted step never retraces. A rule that is not a pytree is kept as static data."""
    if jax.tree.leaves(rule) == [rule]:
        return _Static(rule)
    return canonical_numbers(rule)


def canonical_numbers(tree: Any) -> Any:
    """Python and numpy numbers in `tree` as strong-typed device scalars (int32, or the default float)."""

    def conv(v):
        if isinstance(v, (bool, np.bool_)):
            return v
        if isinstance(v, (int, np.integer)):
            return jnp.asarray(v, jnp.int32)
        if isinstance(v, (float, np.floating)) or (isinstance(v, np.ndarray) and v.ndim == 0):
            return jnp.asarray(v, jax.dtypes.canonicalize_dtype(jnp.float64))
        return v

    return jax.tree.map(conv, tree)


def _is_rule(rule: Any) -> bool:
    return callable(getattr(rule, "init", None)) and callable(getattr(rule, "apply", None))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:   # rules holding arrays do not compare; treat them as distinct
        return False


RuleSpec = Any  # a rule, or a function (path, array) -> rule


def setup(rule: RuleSpec, model: PyTree, *, ties: Mapping[str, Any] | None = None,
          like: State | None = None) -> State:
    """Initialise optimiser state for every trainable leaf of `model`.

    Runs once, outside `jit`. Leaves that are the same array object are one parameter (a tie group).
    `ties` adds explicit ones: `{path: canonical_path}`, or `{path: (canonical_path, f)}` when the leaf at
    `path` is `f(canonical)` for a linear `f` such as `jnp.transpose` (its gradient is pulled back through `f`,
    and after each step it is recomputed as `f(new canonical)`). Trainable leaves are jax / numpy arrays of a
    floating or complex dtype; everything else is carried through `update` untouched.

    `rule` may be a function `(path, array) -> rule` choosing a rule per parameter (all members of a tie group
    must get the same rule). `like=old_state` keeps the optimiser state of every parameter whose canonical path,
    shape, dtype and state structure still match, for a model that grew or shrank (new parameters start fresh).

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.ones(3)
    >>> state = optim.setup(optim.Adam(0.1), {"emb": w, "head": w, "step": 0})
    >>> state.ties()
    {'emb': ('head',)}
    >>> state = optim.setup(lambda path, x: optim.Muon(0.02) if x.ndim == 2 else optim.AdamW(3e-4),
    ...                     {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)})
    >>> type(state["w"].rule).__name__, type(state["b"].rule).__name__
    ('Muon', 'AdamW')
    """
    if not _is_rule(rule) and not callable(rule):
        raise TypeError(f"setup: {rule!r} is not a rule; a rule has init(x) and apply(state, x, dx, *dxs)")
    if like is not None and not isinstance(like, State):
        raise TypeError(f"setup: like= takes a State, got {type(like).__name__}")
    leaves, treedef = jax.tree_util.tree_flatten(model)
    paths = _LazyPaths(treedef)
    trainable = [is_trainable(x) for x in leaves]
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        warnings.warn("optim.setup was called inside a traced function: ties are found by object identity, "
                      "which jit does not preserve. Call setup outside jit.", stacklevel=2)
    plain = {k: v for k, v in (ties or {}).items() if isinstance(v, str)}
    groups = tie_groups(paths, leaves, trainable, plain)
    transforms = _transformed(ties or {}, groups, paths, leaves, trainable)
    if not groups:
        warnings.warn("optim.setup found no trainable leaves (floating or complex arrays) in the model",
                      stacklevel=2)
    rules, rule_of = _choose_rules(rule, groups, paths, leaves)
    params = tuple(Param(c, members, tuple(leaves[c].shape), jnp.dtype(leaves[c].dtype), rule_of[c],
                         transforms.get(c, ())) for c, members in groups.items())
    layout = Layout(treedef, params, (False,) * len(params))
    if paths.computed is not None:
        layout.__dict__["paths"] = paths.computed
    rules = tuple(_canonical_hyper(r) for r in rules)
    states: list = [None] * len(params)
    for k, r in enumerate(rules):
        idx = [u for u, p in enumerate(params) if p.rule == k]
        for u, st in zip(idx, _init_states(unwrap(r), [leaves[params[u].canonical] for u in idx],
                                           [params[u].canonical for u in idx], paths)):
            states[u] = st
    if like is not None:
        states = _keep_matching(like, layout, states)
    return State(layout, rules, tuple(states), jnp.zeros((), jnp.int32))


def _choose_rules(rule: RuleSpec, groups: dict, paths: Any, leaves: list) -> tuple[list, dict]:
    if _is_rule(rule):
        return [rule], {c: 0 for c in groups}
    rules: list = []
    rule_of = {}
    for c, members in groups.items():
        chosen = [rule(paths[i], leaves[i]) for i in members]
        for i, r in zip(members, chosen):
            if not _is_rule(r):
                raise TypeError(f"setup: the rule function returned {r!r} for {show(paths[i])}, which is not a rule")
            if not _same(r, chosen[0]):
                raise ValueError(f"setup: {show(paths[c])} and {show(paths[i])} are tied (one parameter) but the rule "
                                 f"function gives them different rules: {chosen[0]!r} and {r!r}")
        k = next((k for k, r in enumerate(rules) if _same(r, chosen[0])), None)
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
    index = {p: i for i, p in enumerate(paths)}
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
            raise ValueError(f"ties: {show(src)} is {describe(got)} but {_fname(f)}({show(dst)}) is "
                             f"{jnp.dtype(want.dtype).name}{list(want.shape)}")
        out.setdefault(c, []).append((i, f, tuple(got.shape), jnp.dtype(got.dtype)))
        del groups[canon_of[i]]
    return {c: tuple(v) for c, v in out.items()}


def _keep_matching(old: State, layout: Layout, fresh: list) -> list:
    """State surgery: reuse `old`'s state where the canonical path, shape, dtype and state structure match."""
    kept = list(fresh)
    for u, p in enumerate(layout.params):
        path = layout.paths[p.canonical]
        if path not in old:
            continue
        v = old.layout.param(path)
        q = old.layout.params[v]
        same_tree = jax.tree.structure(old.leaves[v]) == jax.tree.structure(fresh[u])
        if q.shape == p.shape and q.dtype == p.dtype and same_tree and all(
                np.shape(a) == np.shape(b) and jnp.dtype(a.dtype) == jnp.dtype(b.dtype)
                for a, b in zip(jax.tree.leaves(old.leaves[v]), jax.tree.leaves(fresh[u]))):
            kept[u] = old.leaves[v]
    return kept


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


def leaf_paths(treedef) -> list[str]:
    """Dotted paths of every leaf of `treedef`; they must be unique to name leaves."""
    paths = flatten(treedef.unflatten([0] * treedef.num_leaves))[0]
    if len(set(paths)) != len(paths):
        seen = set()
        dup = next(p for p in paths if p in seen or seen.add(p))
        raise ValueError(f"two leaves share the dotted path {show(dup)}; dotted paths name leaves in "
                         "freeze/thaw/ties/state[...], so they must be unique (rename a dict key)")
    return paths


def _init_states(rule: Any, xs: list, where: list[int], paths: Any) -> list:
    """`rule.init(x)` for every parameter, batched per (shape, dtype) group.

    An init that does not read the parameter's values (zeros, constants: every built-in rule but
    MixedPrecision) runs once per group; the group's states are read-only host (numpy) arrays shared by its
    members, which the first `update` moves to the device inside jit's argument handling. Creating a device
    array costs ~60 us of Python per array; this keeps `setup` at about a microsecond per parameter.
    Parameters that are not numpy or single-device arrays (sharded, traced) get a per-parameter init, which
    follows their placement.
    """
    out: list = [None] * len(xs)
    groups: dict = {}
    for i, x in enumerate(xs):
        groups.setdefault((tuple(x.shape), jnp.dtype(x.dtype), _local(x)), []).append(i)
    for (_, _, local), idx in groups.items():
        x0 = jnp.asarray(xs[idx[0]])
        try:
            if local and _reads_nothing(rule.init, x0):
                proto, treedef = jax.tree_util.tree_flatten(rule.init(x0))
                host = [np.array(a) for a in proto]
                for h in host:
                    h.flags.writeable = False
                shared = treedef.unflatten(host)
                for i in idx:
                    out[i] = shared
            else:
                inits: dict = {}
                for i in idx:
                    x = jnp.asarray(xs[i])
                    key = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
                    if key not in inits:
                        inits[key] = _placed_init(rule, x)
                    out[i] = inits[key](x)
        except (TypeError, ValueError) as e:
            raise type(e)(f"setup: at {show(paths[where[idx[0]]])}: {e}") from e
    return out


def _placed_init(rule: Any, x: jax.Array) -> Callable:
    """`rule.init` for parameters placed like `x`, creating every state array where it will be used: arrays of
    `x`'s shape get `x`'s sharding (FSDP / ZeRO: each device holds the state of its own shard), the others
    (scalars, Adam's beta powers) are replicated over `x`'s devices. One jitted init per placement, so a
    sharded parameter's state is never materialised whole on one device. An init that cannot be jitted (it
    reads concrete values) runs eagerly."""
    sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        rep = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        rep = sharding
    else:
        return rule.init
    try:
        shapes = jax.eval_shape(rule.init, x)
    except Exception:   # e.g. converts x to numpy: not traceable
        return rule.init
    place = jax.tree.map(lambda s: sharding if s.shape == x.shape else rep, shapes)
    return jax.jit(lambda a: rule.init(a), out_shardings=place)


def _local(x: Any) -> bool:
    """A numpy array, or a concrete jax array on the default device."""
    if isinstance(x, np.ndarray):
        return True
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding) or isinstance(x, jax.core.Tracer):
        return False
    return sharding == _default_sharding()


@functools.cache
def _default_sharding():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _reads_nothing(fn: Callable, x: jax.Array) -> bool:
    """Whether `fn(x)`'s outputs depend only on x's shape and dtype, not its values."""
    jaxpr = jax.make_jaxpr(fn)(x).jaxpr
    v = jaxpr.invars[0]
    return not any(a is v for e in jaxpr.eqns for a in e.invars) and not any(a is v for a in jaxpr.outvars)


def with_frozen(state: State, params: list[int], value: bool) -> State:
    frozen = list(state.layout.frozen)
    for u in params:
        frozen[u] = value
    lay = state.layout
    return State(Layout(lay.treedef, lay.params, tuple(frozen)), state.rules, state.leaves, state.step)
