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
from ._ties import tie_groups


@dataclasses.dataclass(frozen=True)
class Param:
    """One real parameter: its canonical position, all tied positions, shape, dtype and rule index."""

    canonical: int
    members: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    rule: int = 0


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
            for i in p.members:
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

    __slots__ = ("layout", "rules", "leaves")

    def __init__(self, layout: Layout, rules: tuple, leaves: tuple):
        self.layout = layout
        self.rules = rules      # one entry per distinct rule; Param.rule indexes into it
        self.leaves = leaves    # one optimiser state per parameter, in Layout.params order

    def tree_flatten_with_keys(self):
        k = jax.tree_util.GetAttrKey
        return ((k("rules"), self.rules), (k("leaves"), self.leaves)), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(layout, *children)

    @property
    def rule(self) -> Any:
        """The rule, when the whole model uses one."""
        if len(self.rules) != 1:
            raise ValueError("this state uses several rules; look one up with state[path].rule")
        return self.rules[0]

    def __getitem__(self, path: str) -> Leaf:
        if not isinstance(path, str):
            raise TypeError(f"state[...] takes a dotted path string, got {type(path).__name__}")
        u = self.layout.param(path)
        p = self.layout.params[u]
        return Leaf(self.rules[p.rule], self.leaves[u], self.layout.frozen[u])

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
        return {paths[p.canonical]: tuple(paths[i] for i in p.members[1:])
                for p in self.layout.params if len(p.members) > 1}

    def __len__(self) -> int:
        return len(self.layout.params)

    def __repr__(self) -> str:
        lay = self.layout
        lines = [f"State({len(lay.params)} parameters, {sum(len(p.members) for p in lay.params)} positions)"]
        for u, p in enumerate(lay.params):
            shapes = jax.tree.map(lambda a: describe(a), self.leaves[u])
            flags = " frozen" if lay.frozen[u] else ""
            tied = ""
            if len(p.members) > 1:
                tied = "  tied: " + ", ".join(lay.paths[i] for i in p.members[1:])
            lines.append(f"  {lay.paths[p.canonical] or '<root>'}: {jnp.dtype(p.dtype).name}{list(p.shape)} "
                         f"{self.rules[p.rule]!r} state={shapes}{flags}{tied}")
        return "\n".join(lines)


def _canonical_hyper(rule: Any) -> Any:
    """Hyperparameters as strong-typed device scalars, so every later value (from `adjust`) has the same
    abstract type and a jitted step never retraces."""

    def conv(v):
        if isinstance(v, (bool, np.bool_)):
            return v
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return jnp.asarray(v, jnp.int32)
        if isinstance(v, (float, np.floating)) or (isinstance(v, np.ndarray) and v.ndim == 0):
            return jnp.asarray(v, jax.dtypes.canonicalize_dtype(jnp.float64))
        return v

    return jax.tree.map(conv, rule)


def _check_rule(rule: Any) -> None:
    if not (callable(getattr(rule, "init", None)) and callable(getattr(rule, "apply", None))):
        raise TypeError(f"setup: {rule!r} is not a rule; a rule has init(x) and apply(state, x, dx, *dxs)")


def setup(rule: Any, model: PyTree, *, ties: Mapping[str, str] | None = None) -> State:
    """Initialise optimiser state for every trainable leaf of `model`.

    Runs once, outside `jit`. Leaves that are the same array object are one parameter (a tie group); `ties`
    adds explicit ones, `{path: canonical_path}`. Trainable leaves are jax / numpy arrays of a floating or
    complex dtype; everything else is carried through `update` untouched.

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.ones(3)
    >>> state = optim.setup(optim.Adam(0.1), {"emb": w, "head": w, "step": 0})
    >>> state.ties()
    {'emb': ('head',)}
    """
    _check_rule(rule)
    leaves, treedef = jax.tree_util.tree_flatten(model)
    paths = _LazyPaths(treedef)
    trainable = [is_trainable(x) for x in leaves]
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        warnings.warn("optim.setup was called inside a traced function: ties are found by object identity, "
                      "which jit does not preserve. Call setup outside jit.", stacklevel=2)
    groups = tie_groups(paths, leaves, trainable, ties)
    if not groups:
        warnings.warn("optim.setup found no trainable leaves (floating or complex arrays) in the model",
                      stacklevel=2)
    params = tuple(Param(c, members, tuple(leaves[c].shape), jnp.dtype(leaves[c].dtype))
                   for c, members in groups.items())
    layout = Layout(treedef, params, (False,) * len(params))
    if paths.computed is not None:
        layout.__dict__["paths"] = paths.computed
    rule = _canonical_hyper(rule)
    states = _init_states(rule, [leaves[p.canonical] for p in params], [p.canonical for p in params], paths)
    return State(layout, (rule,), tuple(states))


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
                for i in idx:
                    out[i] = rule.init(jnp.asarray(xs[i]))
        except (TypeError, ValueError) as e:
            raise type(e)(f"setup: at {show(paths[where[idx[0]]])}: {e}") from e
    return out


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
    return State(Layout(lay.treedef, lay.params, tuple(frozen)), state.rules, state.leaves)
