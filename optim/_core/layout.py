"""The static part of an optimiser state: the `Layout` (the model's treedef, its parameters, their tie groups,
stacks and frozen flags) that `update` compiles against, and the records it is made of (`Param`, `TiedCopy`,
`Slot`). `setup` builds it (optim/_core/setup.py); the `State` (optim/_core/state.py) carries it as its static
data. It is hashable and compares by value, so a fresh `setup` of an equal structure never makes a jitted
function retrace; comparing a layout with itself is an identity check, so the per-call cost is nil.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from .._base.tree import flatten, match_positions, show, suggest, unique_index
from .._engine.stack import make_stacks
from .._rules.split import mesh_of


class TiedCopy(NamedTuple):
    """A model position tied to a parameter through a function: it holds `f(canonical)`, of `shape` and `dtype`
    (`setup(..., ties={path: (canonical_path, f)})`)."""

    position: int
    f: Callable
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class Param:
    """One real parameter: its canonical position, all tied positions, shape, dtype and rule index."""

    canonical: int
    members: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    rule: int = 0
    # Positions that hold f(canonical) rather than the canonical array itself
    transforms: tuple[TiedCopy, ...] = ()
    # Where the parameter lives when it is not an ordinary single-device array (its sharding): only parameters
    # placed alike are stacked together. Not part of equality: the layout compares its stacks instead.
    place: Any = dataclasses.field(default=None, compare=False)
    # The sharding requested for this parameter's optimiser-state arrays (`setup(..., state_sharding=fn)`), or
    # None: like the parameter. Part of equality: `update` constrains the new state to it
    # (`optim._core.update._core`), so states that differ here must not share a compiled program. Parameters are
    # stacked only with equal ones.
    state_place: Any = None

    def __post_init__(self):
        if self.transforms:      # given as plain 4-tuples (e.g. by a checkpoint): named
            object.__setattr__(self, "transforms", tuple(TiedCopy(*t) for t in self.transforms))


class Slot(NamedTuple):
    """Where a parameter's state is stored: row `row` of stack `stack` (an index into `Layout.stacks`)."""

    stack: int
    row: int


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Static description of a model as seen by a `State` (hashable, compares by value).

    Dotted paths are derived from the treedef the first time something needs a name (errors, `freeze`,
    `state[path]`, repr), so `setup` needs only JAX's C++ flatten.
    """

    treedef: Any
    params: tuple[Param, ...]
    frozen: tuple[bool, ...]
    # Rules (indices) whose large parameters are stacked too (`optim._engine.stack.make_stacks`): those that optim's
    # fused CPU kernel runs, decided by `setup` and `adjust` (`optim._engine.strategies.wide_rules`).
    wide: frozenset = frozenset()

    def __post_init__(self):
        param_of = [-1] * self.treedef.num_leaves
        for u, p in enumerate(self.params):
            for i in p.members + tuple(t.position for t in p.transforms):
                param_of[i] = u
        object.__setattr__(self, "param_of", tuple(param_of))
        # The stacks: tuples of parameter indices whose states are stored stacked, in this order.
        object.__setattr__(self, "stacks", make_stacks(self.params, self.wide))
        # Not the Params: hashing them all is slow on a large model (`bench/NOTES.md`); equal layouts already
        # agree on everything below, and `__eq__` compares the params themselves.
        object.__setattr__(self, "_hash", hash((self.treedef, len(self.params), self.frozen, self.stacks)))

    @functools.cached_property
    def slot(self) -> tuple[Slot, ...]:
        """Per parameter: where its state is stored (`Slot`)."""
        out: list = [None] * len(self.params)
        for s, stack in enumerate(self.stacks):
            for k, u in enumerate(stack):
                out[u] = Slot(stack=s, row=k)
        return tuple(out)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        if self is other:
            return True
        return (isinstance(other, Layout) and self._hash == other._hash and self.treedef == other.treedef
                and self.params == other.params and self.frozen == other.frozen and self.stacks == other.stacks)

    @functools.cached_property
    def mesh(self) -> Any:
        """The mesh of several devices the parameters or their state live on (the first met), or None: the matrix
        rules split their per-matrix work over it (optim._rules.split). Not part of equality; `update`'s
        programs are kept by it too."""
        return mesh_of(s for p in self.params for s in (p.place, p.state_place))

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
            raise PathError(f"{show(path)} is not a leaf path of the model{suggest(path, self.paths)}")
        u = self.param_of[i]
        if u < 0:
            raise PathError(f"{show(path)} is not a trainable leaf (only floating or complex arrays have state)")
        return u

    def match(self, pattern: str) -> list[int]:
        """Parameters with a member that `pattern` selects (`optim._base.tree.match_positions`: the exact path, else
        a dotted-path prefix, else an fnmatch pattern)."""
        trainable = [i for i, u in enumerate(self.param_of) if u >= 0]
        hits = {self.param_of[i] for i in match_positions(self.paths, pattern, trainable)}
        clash = sorted({self.paths[i] for i, p in enumerate(self.param_of) if p in hits} & self.ambiguous)
        if clash:
            raise PathError(f"{show(pattern)} selects {show(clash[0])}, a dotted name that several leaves of this "
                            "model share (e.g. a key 'a.b' beside a subtree 'a' with key 'b'); rename a key")
        return sorted(hits)


class PathError(ValueError, KeyError):
    """A dotted path that does not name what it should. A `ValueError` (and a `KeyError` for `state[...]`)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


def leaf_paths(treedef) -> list[str]:
    """Dotted paths of every leaf of `treedef` (two leaves may share one: see `Layout.ambiguous`)."""
    return flatten(treedef.unflatten([0] * treedef.num_leaves))[0]
