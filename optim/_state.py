"""The optimiser state: `setup`, `State`, `Leaf` and the static `Layout` that `update` compiles against.

A `State` is a pytree. Its leaves are the rules' hyperparameters and the optimiser state, stored *stacked*:
parameters with the same rule, shape, dtype and placement form groups (`Layout.groups`), and each group's
states are one array per state field with a leading axis over its members. `update` then runs a rule once per
group (vmapped), so the compiled program does not grow with the number of small leaves; `state[path]` slices a
parameter's own state out. The static part, the `Layout`, holds the model's treedef, every leaf's dotted path,
the tie groups, the stacking groups and the frozen flags. It is hashable and compares by value, so a fresh
`setup` of an equal structure never makes a jitted function retrace; comparing a layout with itself is an
identity check, so the per-call cost is nil.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import warnings
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ._tree import PyTree, describe, flatten, is_trainable, show, unique_index
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
    # Where the parameter lives when it is not an ordinary single-device array (its sharding): only parameters
    # placed alike are stacked together. Not part of equality: the layout compares its groups instead.
    place: Any = dataclasses.field(default=None, compare=False)


# Stacking rule (measured on XLA:CPU, Adam, `bench/NOTES.md`): for leaves of up to ~8k elements one kernel per
# group beats one per leaf (2.6x faster at 1.6k elements, even at 8k), and compiling is 3-4x faster; for larger
# leaves stacking costs an extra pass over memory (1.7x slower at 16k), so they stay alone. Groups are capped
# because XLA's compile time grows quadratically with the number of slices taken from one array.
STACK_MAX_SIZE = 8192
STACK_MAX_MEMBERS = 64


def stacking_groups(params: tuple[Param, ...]) -> tuple[tuple[int, ...], ...]:
    """Partition parameter indices into stacking groups: same rule, shape, dtype and placement; small ones
    together (at most `STACK_MAX_MEMBERS`), large ones alone. Deterministic, in parameter order."""
    by_key: dict = {}
    out: list[list[int]] = []
    for u, p in enumerate(params):
        if math.prod(p.shape) > STACK_MAX_SIZE:
            out.append([u])
            continue
        key = (p.rule, p.shape, p.dtype, p.place)
        g = by_key.get(key)
        if g is None or len(g) >= STACK_MAX_MEMBERS:
            g = by_key[key] = []
            out.append(g)
        g.append(u)
    return tuple(tuple(g) for g in out)


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
        # The stacking groups: tuples of parameter indices whose states are stored stacked, in this order.
        object.__setattr__(self, "groups", stacking_groups(self.params))
        # Hashing 10000 Params costs ~10 ms; equal layouts already agree on everything below, and `__eq__`
        # compares the params themselves.
        object.__setattr__(self, "_hash", hash((self.treedef, len(self.params), self.frozen, self.groups)))

    @functools.cached_property
    def slot(self) -> tuple[tuple[int, int], ...]:
        """Per parameter: (its group, its position in the group's stack)."""
        out: list = [None] * len(self.params)
        for g, members in enumerate(self.groups):
            for k, u in enumerate(members):
                out[u] = (g, k)
        return tuple(out)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        if self is other:
            return True
        return (isinstance(other, Layout) and self._hash == other._hash and self.treedef == other.treedef
                and self.params == other.params and self.frozen == other.frozen and self.groups == other.groups)

    @functools.cached_property
    def paths(self) -> tuple[str, ...]:
        """The dotted path of every leaf position, in flatten order."""
        return tuple(leaf_paths(self.treedef))

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """`{dotted path: position}` for the paths that name one leaf (see `ambiguous`)."""
        return unique_index(self.paths)

    @functools.cached_property
    def ambiguous(self) -> frozenset[str]:
        """Dotted paths shared by several leaves (`{"a.b": x, "a": {"b": y}}`): names are for people only, so such
        a model trains normally, but these names cannot select a leaf."""
        return frozenset(p for p in self.paths if p not in self.index)

    @functools.cached_property
    def keypaths(self) -> tuple[tuple, ...]:
        """JAX's key path of every leaf position: how gradients are matched to the model (dotted names can
        collide, key paths cannot)."""
        return tuple(kp for kp, _ in jax.tree_util.tree_flatten_with_path(
            self.treedef.unflatten([0] * self.treedef.num_leaves))[0])

    @functools.cached_property
    def key_index(self) -> dict[tuple, int]:
        """`{key path: position}`."""
        return {kp: i for i, kp in enumerate(self.keypaths)}

    @functools.cached_property
    def key_nodes(self) -> frozenset[tuple]:
        """Every key path that is a subtree of the model (a proper prefix of a leaf's key path)."""
        return frozenset(kp[:k] for kp in self.keypaths for k in range(len(kp)))

    def param(self, path: str) -> int:
        """The index of the parameter at dotted `path` (any member of a tie group)."""
        i = self.index.get(path)
        if i is None:
            if path in self.ambiguous:
                raise PathError(f"{show(path)} names several leaves of this model (its dotted names collide, e.g. "
                                "a key 'a.b' beside a subtree 'a' with key 'b'); rename a key to select one")
            raise PathError(f"{show(path)} is not a leaf path of the model{_suggest(path, self.paths)}")
        u = self.param_of[i]
        if u < 0:
            raise PathError(f"{show(path)} is not a trainable leaf (only floating or complex arrays have state)")
        return u

    def match(self, pattern: str) -> list[int]:
        """Parameters with a member path equal to `pattern`; if none is, those with a member below it or, for a
        pattern that names no path, fnmatch-matching it. An exact path means that path only: `"w[0]"` (a dict
        key with brackets) is not the glob that also matches `"w0"`."""
        if pattern in self.index:
            u = self.param_of[self.index[pattern]]
            return [u] if u >= 0 else []
        hits = set()
        for i, p in enumerate(self.paths):
            if self.param_of[i] >= 0 and (p.startswith(pattern + ".") or pattern == "" or p == pattern):
                hits.add(self.param_of[i])
        if not hits:
            hits = {self.param_of[i] for i, p in enumerate(self.paths)
                    if self.param_of[i] >= 0 and fnmatch.fnmatchcase(p, pattern)}
        clash = sorted({self.paths[i] for i, p in enumerate(self.param_of) if p in hits} & self.ambiguous)
        if clash:
            raise PathError(f"{show(pattern)} selects {show(clash[0])}, a dotted name that several leaves of this "
                            "model share (e.g. a key 'a.b' beside a subtree 'a' with key 'b'); rename a key")
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

    __slots__ = ("layout", "rules", "stacks", "step")

    def __init__(self, layout: Layout, rules: tuple, stacks: tuple, step: Any):
        self.layout = layout
        self.rules = rules      # one entry per distinct rule; Param.rule indexes into it
        self.stacks = stacks    # per stacking group (Layout.groups): its members' states, stacked on axis 0
        self.step = step        # number of update calls so far: what schedules are evaluated at

    @classmethod
    def of_params(cls, layout: Layout, rules: tuple, states: list, step: Any) -> "State":
        """A state from one optimiser state per parameter (in `layout.params` order), stacked per group."""
        return cls(layout, rules, tuple(stack_states([states[u] for u in g]) for g in layout.groups), step)

    def param_state(self, u: int) -> Any:
        """The optimiser state of parameter `u`: its row of its group's stack (numpy stays numpy). A state
        that went through `vmap` / `pmap` (`jax.tree.map(lambda a: jnp.stack([a, a]), state)`) has extra
        leading axes; they are kept, and the row is taken on the group's axis after them."""
        g, k = self.layout.slot[u]
        stack = self.stacks[g]
        leaves, treedef = jax.tree_util.tree_flatten(stack)
        extra = [np.ndim(a) - d for a, d in zip(leaves, _member_ndims(self, u, treedef))]
        return treedef.unflatten([a[(slice(None),) * (e - 1) + (k,)] for a, e in zip(leaves, extra)])

    @property
    def leaves(self) -> tuple:
        """One optimiser state per parameter, in `layout.params` order (sliced from `stacks`; read-only). Kept
        for code written before states were stacked; `state[path].state` is the usual way in."""
        return tuple(self.param_states())

    def param_states(self) -> list:
        """One optimiser state per parameter, in `layout.params` order."""
        return [self.param_state(u) for u in range(len(self.layout.params))]

    def with_param_states(self, new: Mapping[int, Any]) -> "State":
        """This state with the states of some parameters (`{index: state}`) replaced; untouched groups keep
        their arrays."""
        stacks = list(self.stacks)
        for g in sorted({self.layout.slot[u][0] for u in new}):
            members = self.layout.groups[g]
            stacks[g] = stack_states([new[u] if u in new else self.param_state(u) for u in members])
        return State(self.layout, self.rules, tuple(stacks), self.step)

    def tree_flatten_with_keys(self):
        k = jax.tree_util.GetAttrKey
        return ((k("rules"), self.rules), (k("stacks"), self.stacks), (k("step"), self.step)), self.layout

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
        return Leaf(unwrap(self.rules[p.rule]), self.param_state(u), self.layout.frozen[u])

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
            shapes = jax.tree.map(lambda a: describe(a), self.param_state(u))
            flags = " frozen" if lay.frozen[u] else ""
            tied = ""
            if len(p.members) + len(p.transforms) > 1:
                tied = "  tied: " + ", ".join([lay.paths[i] for i in p.members[1:]]
                                              + [f"{lay.paths[t[0]]} = {_fname(t[1])}(·)" for t in p.transforms])
            lines.append(f"  {lay.paths[p.canonical] or '<root>'}: {jnp.dtype(p.dtype).name}{list(p.shape)} "
                         f"{unwrap(self.rules[p.rule])!r} state={shapes}{flags}{tied}")
        return "\n".join(lines)


_NDIMS: dict = {}


def _member_ndims(state: State, u: int, treedef: Any) -> tuple[int, ...]:
    """The ndim of each of one parameter's state arrays, without stacking (from the rule's init, cached per
    rule structure, shape and dtype): how `param_state` finds the group axis behind any batch axes."""
    p = state.layout.params[u]
    rule = unwrap(state.rules[p.rule])
    key = (jax.tree.structure(rule), p.shape, p.dtype, treedef)
    nd = _NDIMS.get(key)
    if nd is None:
        try:
            shapes = jax.eval_shape(rule.init, jax.ShapeDtypeStruct(p.shape, p.dtype))
            leaves, got = jax.tree_util.tree_flatten(shapes)
            nd = tuple(len(a.shape) for a in leaves) if got == treedef else None
        except Exception:    # an init that cannot be traced: assume no batch axes
            nd = None
        if nd is None:
            nd = tuple(np.ndim(a) - 1 for a in jax.tree.leaves(state.stacks[state.layout.slot[u][0]]))
        if len(_NDIMS) > 4096:
            _NDIMS.clear()
        _NDIMS[key] = nd
    return nd


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
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
    if traced:
        warnings.warn("optim.setup was called inside a traced function: ties are found by object identity, "
                      "which jit does not preserve. Call setup outside jit.", stacklevel=2)
    _check_ties_form(ties)
    if ties:
        seen: set = set()
        clash = {p for p in paths if p in seen or seen.add(p)}
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
    params = tuple(Param(c, members, tuple(leaves[c].shape), canonical_dtype(leaves[c].dtype), rule_of[c],
                         transforms.get(c, ()), _placement(leaves[c])) for c, members in groups.items())
    layout = Layout(treedef, params, (False,) * len(params))
    if paths.computed is not None:
        layout.__dict__["paths"] = paths.computed
    rules = tuple(_canonical_hyper(r) for r in rules)
    cache: dict = {}
    stacks = tuple(init_group(unwrap(rules[params[g[0]].rule]), [leaves[params[u].canonical] for u in g],
                              lambda g=g: paths[params[g[0]].canonical], cache,
                              local=not traced and params[g[0]].place is None) for g in layout.groups)
    state = State(layout, rules, stacks, jnp.zeros((), jnp.int32))
    if like is not None:
        state = _keep_matching(like, state)
    return state


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
            raise ValueError(f"ties: {show(src)} is {describe(got)} but {_fname(f)}({show(dst)}) is "
                             f"{jnp.dtype(want.dtype).name}{list(want.shape)}")
        out.setdefault(c, []).append((i, f, tuple(got.shape), canonical_dtype(got.dtype)))
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


def leaf_paths(treedef) -> list[str]:
    """Dotted paths of every leaf of `treedef` (two leaves may share one: see `Layout.ambiguous`)."""
    return flatten(treedef.unflatten([0] * treedef.num_leaves))[0]


def init_group(rule: Any, xs: list, where: Callable[[], str], cache: dict | None = None,
               local: bool | None = None) -> Any:
    """The stacked initial state of one group: `rule.init` of each of `xs`, stacked on a new leading axis.

    An init that does not read the parameter's values (zeros, constants: every built-in rule but
    MixedPrecision) runs once per (rule, shape, dtype); the group's state is then a read-only host (numpy)
    broadcast of it, which the first `update` moves to the device inside jit's argument handling. Creating
    device arrays costs ~60 us of Python each; this keeps `setup` at about a microsecond per parameter.
    Parameters that are not numpy or single-device arrays (sharded, traced) get a jitted, vmapped init that
    creates the state where the parameters live. `local` says whether all of `xs` are host or default-device
    arrays, when the caller knows (it costs a few microseconds per array to find out).
    """
    try:
        if local if local is not None else all(_local(x) for x in xs):
            proto = _host_init(rule, tuple(xs[0].shape), canonical_dtype(xs[0].dtype), cache)
            if proto is not None:
                return stack_states([proto] * len(xs))
        return _placed_init(rule, xs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"setup: at {show(where())}: {e}") from e


def _host_init(rule: Any, shape: tuple, dtype: np.dtype, cache: dict | None) -> Any:
    """`rule.init` of a parameter of this shape and dtype as read-only numpy arrays, or None when the init
    reads the parameter's values. `cache` (one per `setup` call, keyed by the rule object) saves the tracing."""
    key = (id(rule), shape, dtype)
    if cache is not None and key in cache:
        return cache[key]
    x0 = jnp.zeros(shape, dtype)
    out = None
    if _reads_nothing(rule.init, x0):
        proto, treedef = jax.tree_util.tree_flatten(rule.init(x0))
        host = [np.array(a) for a in proto]
        for h in host:
            h.flags.writeable = False
        out = treedef.unflatten(host)
    if cache is not None:
        cache[key] = out
    return out


def stack_states(states: list) -> Any:
    """Stack per-parameter states (one structure) on a new leading axis. Host arrays stay on the host; the
    same host array repeated (a shared initial state) becomes a read-only broadcast, which costs nothing."""
    leaves0, treedef = jax.tree_util.tree_flatten(states[0])
    if all(isinstance(a, np.ndarray) for a in leaves0) and all(s is states[0] for s in states):
        return treedef.unflatten([np.broadcast_to(a, (len(states),) + a.shape) for a in leaves0])
    columns = zip(*[jax.tree_util.tree_flatten(s)[0] for s in states]) if len(states) > 1 else [[a] for a in leaves0]
    out = []
    for col in columns:
        col = list(col)
        if all(isinstance(a, np.ndarray) for a in col):
            if all(a is col[0] for a in col):
                out.append(np.broadcast_to(col[0], (len(col),) + col[0].shape))
            else:
                out.append(np.stack(col))
        else:
            out.append(stack_arrays(col))
    return treedef.unflatten(out)


def stack_arrays(xs: list) -> jax.Array:
    """Arrays stacked on a new leading axis (a stack of one is a free reshape)."""
    if len(xs) == 1:
        return jnp.expand_dims(jnp.asarray(xs[0]), 0)
    return jnp.stack([jnp.asarray(x) for x in xs])


def _placed_init(rule: Any, xs: list) -> Any:
    """The stacked state of a group placed like `xs[0]` from the vmapped `rule.init`, creating every state
    array where it will be used: arrays with the stacked parameters' shape get their sharding (FSDP / ZeRO:
    each device holds the state of its own shard), the rest (Adam's beta powers) are replicated over the same
    devices. Jitted, so a sharded parameter's state is never materialised whole on one device, and the
    parameters are stacked only for an init that reads them. An init that cannot be traced (it reads concrete
    values) runs per parameter, eagerly."""
    batched = jax.vmap(rule.init)
    x = xs[0]
    sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(None, *sharding.spec)
        stacked = jax.sharding.NamedSharding(sharding.mesh, spec)
        rep = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        stacked = rep = sharding
    else:
        return batched(stack_arrays(xs))
    shape = (len(xs),) + tuple(x.shape)
    abstract = jax.ShapeDtypeStruct(shape, x.dtype)
    try:
        shapes = jax.eval_shape(batched, abstract)
    except Exception:   # e.g. converts x to numpy: not traceable
        return stack_states([rule.init(a) for a in xs])
    place = jax.tree.map(lambda s: stacked if s.shape == shape else rep, shapes)
    if _reads_nothing(batched, abstract):
        return jax.jit(lambda: batched(jnp.zeros(shape, x.dtype)), out_shardings=place)()
    return jax.jit(batched, out_shardings=place)(stack_arrays(xs))


def _local(x: Any) -> bool:
    """A numpy array, or a concrete jax array on the default device."""
    if isinstance(x, np.ndarray):
        return True
    sharding = getattr(x, "sharding", None)
    if sharding is _LAST_LOCAL[0]:          # arrays made alike share their sharding object: skip the comparison
        return True
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding) or isinstance(x, jax.core.Tracer):
        return False
    if sharding == _default_sharding():
        _LAST_LOCAL[0] = sharding
        return True
    return False


_LAST_LOCAL: list = [None]


def canonical_dtype(d: Any) -> np.dtype:
    """The dtype JAX gives an array of dtype `d`: numpy float64 is float32 unless x64 is enabled."""
    return jax.dtypes.canonicalize_dtype(d)


def _placement(x: Any) -> Any:
    """What `Param.place` records: None for numpy and default-device arrays, else the array's sharding."""
    if _local(x) or isinstance(x, jax.core.Tracer):
        return None
    return getattr(x, "sharding", None)


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
    return State(Layout(lay.treedef, lay.params, tuple(frozen)), state.rules, state.stacks, state.step)
