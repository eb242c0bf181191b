"""The optimiser state's data model: `State` and `Leaf` (`setup` builds them: `optim/_core/setup.py`; the static
`Layout` they carry is in `optim/_core/layout.py`; stacks are made and sliced in `optim/_engine/stack.py`).

A `State` is a pytree. Its leaves are the rules' hyperparameters and the optimiser state, stored *stacked*:
parameters with the same rule, shape, dtype and placement form stacks (`Layout.stacks`), and each stack holds
one array per state field with a leading axis over its parameters. `update` then runs a rule once per stack
(vmapped), so the compiled program does not grow with the number of small leaves; `state[path]` slices a
parameter's own state out. The stacks' small leaves (Adam's `bt`, counts) are stored packed, the rows of several
stacks in one array (`State.packs`, see `optim._engine.pack`); `state.stacks` reads them back. The static part, the
`Layout`, is the pytree's static data: equal layouts never make a jitted function retrace.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._base.cache import LRU
from .._base.export import register_for_export
from .._engine.pack import fill, pack
from .._rules.schedules import at_start
from .._engine.stack import place_stack, row_index, stack_states
from .._base.tree import describe
# Layout, Param and TiedCopy are named here too: an exported step pickles its State's layout, and those exported
# before the layout had a module of its own name them here.
from .layout import Layout, Param, TiedCopy  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Leaf:
    """The optimiser state of one parameter: its rule, the rule's state and whether it is frozen."""

    rule: Any
    state: Any
    frozen: bool = False


@register_for_export
@jax.tree_util.register_pytree_with_keys_class
class State:
    """Optimiser state for a whole model; build it with `optim.setup`.

    `state[path]` returns the `Leaf` of the parameter at a dotted path (any member of a tie group gives the
    canonical parameter's leaf). The state is a pytree: pass it through `jax.jit`, `pmap`, `vmap` as usual.

    `a == b` compares by value and gives a Python bool: True when the layouts (model structure, ties, rules'
    structure, frozen flags) are equal and every leaf (hyperparameters, optimiser state, step counter) has the
    same shape, dtype and values, NaN equal to NaN (two runs that diverged alike are equal states), wherever the
    arrays live (host or device). It reads the values, so it is for concrete states (tests, checks), not traced
    ones: inside `jit` it is a `TypeError`, as `bool` of a traced array is. Like other containers of arrays
    (dicts, optax states), a `State` is not hashable; its static part, `state.layout`, is.
    """

    __slots__ = ("layout", "rules", "stored", "packs", "step", "_stacks")

    def __init__(self, layout: Layout, rules: tuple, stacks: tuple, step: Any, packs: tuple | None = None):
        self.layout = layout
        self.rules = rules      # one entry per distinct rule; Param.rule indexes into it
        self.step = step        # number of update calls so far: what schedules are evaluated at
        if packs is None:       # per-stack trees, as `stacks` returns them: the small leaves get packed
            self._stacks = stacks
            self.stored, self.packs = pack(layout, stacks, _member_shapes(layout, rules, stacks))
        else:                   # the stored form: stacks with `Packed` placeholders, and the packs
            self._stacks = None
            self.stored, self.packs = stacks, packs

    @property
    def stacks(self) -> tuple:
        """Per stack (`Layout.stacks`): its parameters' states, stacked on axis 0 (the packed small leaves read
        back from `packs`; see `optim._engine.pack`)."""
        if self._stacks is None:
            self._stacks = tuple(fill(s, self.packs) for s in self.stored)
        return self._stacks

    def stack(self, s: int) -> Any:
        """`self.stacks[s]`, reading back only that stack's packed rows."""
        return self._stacks[s] if self._stacks is not None else fill(self.stored[s], self.packs)

    def replace(self, layout: Layout | None = None, rules: tuple | None = None, step: Any = None) -> "State":
        """This state with another layout (same stacks), rules or step; the arrays are shared, not copied."""
        lay = layout if layout is not None else self.layout
        out = State(lay, self.rules if rules is None else rules, self.stored, self.step if step is None else step,
                    self.packs)
        out._stacks = self._stacks
        return out

    @classmethod
    def of_params(cls, layout: Layout, rules: tuple, states: list, step: Any) -> "State":
        """A state from one optimiser state per parameter (in `layout.params` order), stacked per stack."""
        self = cls(layout, rules, (), step, ())
        stacks = tuple(self._placed(s, stack_states([states[u] for u in members]))
                       for s, members in enumerate(layout.stacks))
        return cls(layout, rules, stacks, step)

    def param_state(self, u: int) -> Any:
        """The optimiser state of parameter `u`: its row of its stack (numpy stays numpy). A state
        that went through `vmap` / `pmap` (`jax.tree.map(lambda a: jnp.stack([a, a]), state)`) has extra
        leading axes; they are kept, and the row is taken on the stack's axis after them."""
        slot = self.layout.slot[u]
        leaves, treedef = jax.tree_util.tree_flatten(self.stack(slot.stack))
        extra = [np.ndim(a) - d for a, d in zip(leaves, member_ndims(self, u, treedef))]
        return treedef.unflatten([a[(slice(None),) * (e - 1) + (slot.row,)] for a, e in zip(leaves, extra)])

    def param_states(self) -> list:
        """One optimiser state per parameter, in `layout.params` order."""
        return [self.param_state(u) for u in range(len(self.layout.params))]

    def with_param_states(self, new: Mapping[int, Any]) -> "State":
        """This state with the states of some parameters (`{index: state}`) replaced; untouched stacks keep
        their arrays."""
        stacks = list(self.stacks)
        for s in sorted({self.layout.slot[u].stack for u in new}):
            stack = self.layout.stacks[s]
            stacks[s] = self._placed(s, stack_states([new[u] if u in new else self.param_state(u) for u in stack]))
        return State(self.layout, self.rules, tuple(stacks), self.step)

    def _placed(self, s: int, stack: Any, layout: Layout | None = None) -> Any:
        """Stack `s` (of `layout`, by default this state's) put on its requested state sharding, if it has one
        (`setup(..., state_sharding=fn)`): a restacked state keeps the placement `setup` gave it."""
        lay = layout or self.layout
        p = lay.params[lay.stacks[s][0]]
        return place_stack(stack, p.state_place, p.shape) if p.state_place is not None else stack

    def regroup(self, layout: Layout, rules: tuple) -> "State":
        """This state with `rules` under `layout`, which has the same parameters in the same order but may
        stack them differently (after `adjust` gave some parameters a rule of their own). A stack that is
        unchanged keeps its arrays; another gathers its rows from the old stacks, one gather per run of rows
        taken from one old stack (not one slice per parameter)."""
        old = self.layout
        where = {members: s for s, members in enumerate(old.stacks)}
        stacks = []
        for stack in layout.stacks:
            if stack in where:
                stacks.append(self.stacks[where[stack]])
                continue
            runs: list = []      # [(old stack, [rows])]
            for u in stack:
                slot = old.slot[u]
                if runs and runs[-1][0] == slot.stack:
                    runs[-1][1].append(slot.row)
                else:
                    runs.append((slot.stack, [slot.row]))
            treedef = jax.tree.structure(self.stacks[runs[0][0]])
            nd = member_ndims(self, stack[0], treedef)
            columns = zip(*[jax.tree.leaves(self.stacks[s]) for s, _ in runs])
            stacks.append(self._placed(len(stacks), treedef.unflatten(
                [_gather(col, [rows for _, rows in runs], nd[c]) for c, col in enumerate(columns)]), layout))
        return State(layout, rules, tuple(stacks), self.step)

    def tree_flatten_with_keys(self):
        k = jax.tree_util.GetAttrKey
        return ((k("rules"), self.rules), (k("stacks"), self.stored), (k("step"), self.step),
                (k("packs"), self.packs)), self.layout

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
        """`{canonical_path: (other tied paths, ...)}` for every tie group of more than one position."""
        paths = self.layout.paths
        return {paths[p.canonical]: tuple(paths[i] for i in p.members[1:])
                + tuple(paths[t.position] for t in p.transforms)
                for p in self.layout.params if len(p.members) + len(p.transforms) > 1}

    def __len__(self) -> int:
        return len(self.layout.params)

    __hash__ = None     # compares by value (`__eq__`), and its arrays are data: unhashable, as a dict of arrays

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, State):
            return NotImplemented
        if self is other:
            return True
        (a, ta), (b, tb) = jax.tree_util.tree_flatten(self), jax.tree_util.tree_flatten(other)
        if ta != tb:        # the layout, and the rules' and state's structure
            return False
        if any(isinstance(v, jax.core.Tracer) for v in a + b):
            raise TypeError("State == State compares values, which a traced state does not have (inside jit, "
                            "vmap, grad); compare outside, or compare leaves with jnp.array_equal")
        return all(_same_leaf(u, v) for u, v in zip(a, b))

    def __repr__(self) -> str:
        lay = self.layout
        positions = sum(len(p.members) + len(p.transforms) for p in lay.params)
        lines = [f"State({len(lay.params)} parameters, {positions} positions)"]
        for u, p in enumerate(lay.params):
            shapes = self._describe_state(u)
            flags = " frozen" if lay.frozen[u] else ""
            tied = ""
            if len(p.members) + len(p.transforms) > 1:
                copies = [f"{lay.paths[t.position]} = {func_name(t.f)}(·)" for t in p.transforms]
                tied = "  tied: " + ", ".join([lay.paths[i] for i in p.members[1:]] + copies)
            lines.append(f"  {lay.paths[p.canonical] or '<root>'}: {jnp.dtype(p.dtype).name}{list(p.shape)} "
                         f"{unwrap(self.rules[p.rule])!r} state={shapes}{flags}{tied}")
        return "\n".join(lines)

    def _describe_state(self, u: int) -> Any:
        """Parameter `u`'s state as the repr shows it (shapes and dtypes). A state whose leaves are no longer
        its stacked arrays (`jax.tree.map(lambda a: a.shape, state)`, a tree of shardings) has no rows to take:
        then the leaves of `u`'s stack are shown as they are."""
        try:
            return jax.tree.map(describe, self.param_state(u))
        except Exception:  # noqa: BLE001 (any leaves at all: a repr must not fail)
            s = self.layout.slot[u].stack
            return "<not arrays: its stack holds " + ", ".join(map(_short, jax.tree.leaves(self.stored[s]))) + ">"


def _short(a: Any) -> str:
    text = describe(a) if hasattr(a, "shape") and hasattr(a, "dtype") else repr(a)
    return text if len(text) <= 40 else text[:37] + "..."


def _same_leaf(a: Any, b: Any) -> bool:
    """Two leaves of equal states: arrays of one shape and dtype with equal values (NaN equal to NaN); anything
    else (a state mapped to other leaves) by `==`."""
    if hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(b, "shape") and hasattr(b, "dtype"):
        if tuple(a.shape) != tuple(b.shape) or jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
            return False
        x, y = np.asarray(a), np.asarray(b)
        nan = jnp.issubdtype(x.dtype, jnp.inexact)
        return bool(np.array_equal(x, y, equal_nan=nan))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 (leaves that do not compare are not equal)
        return False


def member_ndims(state: State, u: int, treedef: Any) -> tuple[int, ...]:
    """The ndim of each of one parameter's state arrays, without stacking (from the rule's init, see
    `_init_shapes`): how `param_state` finds the stack axis behind any batch axes."""
    p = state.layout.params[u]
    got, shapes = _init_shapes(unwrap(state.rules[p.rule]), p.shape, p.dtype)
    if got is not None and got == treedef:
        return tuple(len(s) for s in shapes)
    # an init that cannot be traced, or another structure: assume no batch axes
    return tuple(np.ndim(a) - 1 for a in jax.tree.leaves(state.stack(state.layout.slot[u][0])))


def _gather(arrays: tuple, rows: list, ndim: int) -> Any:
    """Rows `rows[i]` of each `arrays[i]` (stacks whose member arrays have `ndim` axes, behind any batch axes),
    concatenated along the stack axis. Host arrays stay on the host."""
    axis = np.ndim(arrays[0]) - ndim - 1
    host = all(isinstance(a, np.ndarray) for a in arrays)
    parts = []
    for a, r in zip(arrays, rows):
        parts.append(a[(slice(None),) * axis + (row_index(r),)])
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts, axis) if host else jnp.concatenate([jnp.asarray(p) for p in parts], axis)


def func_name(f: Callable) -> str:
    return getattr(f, "__name__", type(f).__name__)


@register_for_export
@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class StaticRule:
    """A user rule that is not a pytree, carried as static data (compared by identity)."""

    rule: Any


def unwrap(rule: Any) -> Any:
    return rule.rule if isinstance(rule, StaticRule) else rule


def with_frozen(state: State, params: list[int], value: bool) -> State:
    frozen = list(state.layout.frozen)
    for u in params:
        frozen[u] = value
    lay = state.layout
    return state.replace(layout=Layout(lay.treedef, lay.params, tuple(frozen), lay.wide))


# 4096 (rule structure, shape, dtype): a large model has hundreds of distinct parameter kinds.
_SHAPES = LRU(4096)


def _init_shapes(rule: Any, shape: tuple, dtype: Any) -> tuple[Any, tuple | None]:
    """`(treedef, per-leaf shapes)` of `rule.init` for one parameter, traced abstractly and cached per rule
    structure, shape and dtype; `(None, None)` for an init that cannot be traced so."""
    key = (jax.tree.structure(rule), shape, dtype)
    got = _SHAPES.get(key)
    if got is None:
        try:
            init = at_start(rule).init
            leaves, treedef = jax.tree_util.tree_flatten(jax.eval_shape(init, jax.ShapeDtypeStruct(shape, dtype)))
            got = (treedef, tuple(tuple(a.shape) for a in leaves))
        except Exception:
            got = (None, None)
        _SHAPES[key] = got
    return got


def _member_shapes(layout: Layout, rules: tuple, stacks: tuple) -> list:
    """Per stack: one parameter's shape of each state leaf (flatten order), from the rule's init
    (`_init_shapes`); None where that is unknown or the stack's structure differs (it is then stored as it is)."""
    out = []
    for members, stack in zip(layout.stacks, stacks):
        p = layout.params[members[0]]
        treedef, shapes = _init_shapes(unwrap(rules[p.rule]), p.shape, p.dtype)
        out.append(shapes if treedef is not None and jax.tree.structure(stack) == treedef else None)
    return out

