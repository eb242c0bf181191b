"""The plan of an `update` call: what `update` computes once per model and gradient structure, and caches.

A `Program` maps the model's positions and the gradient trees' leaves to the deduplicated parameters of a
`Layout`: which gradient leaves each parameter sums, which stacks step and with which rows, and where each output
goes back in the model. `plan` looks it up by the treedefs of the call (C++ flattening, no per-leaf Python on a
hit) and builds it on a miss (`_make`), raising a `ValueError` that names the path where a gradient tree does not
match the model. `optim._core.update` runs it.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, NamedTuple

import jax

from .._engine.strategies import SWITCHES
from .._base.cache import LRU
from .layout import Layout
from .state import State
from .._base.tree import PyTree, describe, dotted, flatten, show, structure_diff


def take(seq, idx: tuple[int, ...]) -> tuple:
    """`tuple(seq[i] for i in idx)`, at C speed (`operator.itemgetter`)."""
    if len(idx) > 1:
        return operator.itemgetter(*idx)(seq)
    return (seq[idx[0]],) if idx else ()


class GradSlot(NamedTuple):
    """One gradient a graded parameter sums: which of its tree's passed leaves, and the function its position
    is tied through (None for a plain position; the gradient is then pulled back through its VJP)."""

    leaf: int                             # index into the tree's passed leaves (`Program.grad_take`)
    transform: Callable | None


class StackPlan(NamedTuple):
    """A stack with at least one stepping parameter: its rows that step and, per such row, its parameter's
    index into `Program.graded` (the arrays `_core` is given) and into `Program.stepping` (its outputs)."""

    rows: tuple[int, ...]
    graded: tuple[int, ...]
    stepping: tuple[int, ...]


class RuleSteps(NamedTuple):
    """What `_core` asks the engine for one rule: the rule (index into `State.rules`), its stepping stacks
    (indices into `Program.step_stacks` and `Program.stack_plan`) and their stepping members (indices into
    `Layout.params`)."""

    rule: int
    stacks: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True, eq=False)   # hashed by identity: programs are cached and reused
class Program:
    """The plan of one call structure. Indices name what they index: `graded` and `stepping` are indices into
    `layout.params`; an index into `graded` (the arrays `_core` is given) or `stepping` (its outputs) is written
    `a`; a stack's index into `layout.stacks` is `s`, into `step_stacks` (and `stack_plan`) `j`."""

    layout: Layout
    graded: tuple[int, ...]               # parameters with a gradient in the first tree (frozen ones too)
    stepping: tuple[int, ...]             # ... and those parameters' own indices
    param_pos: tuple[int, ...]            # model position read for each graded parameter (its canonical)
    check_pos: tuple[int, ...]            # every other trainable position, only to validate shapes
    grad_take: tuple[tuple[int, ...], ...]   # per gradient tree: which flat gradient leaves to pass
    grad_paths: tuple[tuple[str, ...], ...]  # ... and their dotted paths, for error messages
    grad_slots: tuple[tuple[tuple[GradSlot, ...], ...], ...]   # per tree, per graded parameter: what it sums
    out_src: tuple[int, ...]              # per model position: index into new_params + new_copies + old leaves
    # Traced (inside a caller's jit): per stepping parameter, its other plain tied positions (indices into
    # `check_pos`), which `_core` then returns as outputs of their own (see `optim._engine.xla.mirrors`); and
    # `out_src` for that case, indexing new_params + new_copies + those outputs + old leaves.
    mirror_pos: tuple[tuple[int, ...], ...]
    out_src_traced: tuple[int, ...]
    step_stacks: tuple[int, ...]          # stacks with at least one stepping parameter
    stack_plan: tuple[StackPlan, ...]     # per such stack
    stack_src: tuple[int, ...]            # per stack: index into new_stacks + old stacks
    by_rule: tuple[RuleSteps, ...]        # per rule with stepping stacks
    # its jitted callables (see `optim._core.update._jitted`), made on first use: [core, core donating, sums]
    jitted: list = dataclasses.field(default_factory=lambda: [None, None, None], init=False, repr=False)


# The eager programs, per layout and gradient structures (each `None` pattern is one). 256: a run meets a few
# patterns, and each Program holds compiled executables, freed when it is evicted (see `optim._core.update._jitted`).
_PROGRAMS = LRU(256)


def plan(state: State, model: PyTree, trees: tuple, who: str, check_model: bool = True):
    """`(program, the model's leaves, its treedef, each gradient tree's leaves)` for a call of `who` (`update`,
    `tie_grads`), the program from the cache when the layout and the trees' structures were seen before."""
    if not isinstance(state, State):
        raise TypeError(f"{who}: expected the State from optim.setup as first argument, got {type(state).__name__}")
    lay = state.layout
    leaves, treedef = flatten_like(lay, model, who) if check_model else jax.tree_util.tree_flatten(model)
    flat = [jax.tree_util.tree_flatten(g) for g in trees]
    # The engine's switches (optim._engine.strategies.SWITCHES), read inline: a later call enters no engine module.
    # The mesh too: a matrix rule's step splits its stacks over it (optim._rules.split).
    key = (lay, lay.mesh, *(getattr(o, a) for o, a in SWITCHES), *(d for _, d in flat))
    prog = _PROGRAMS.get(key)
    if prog is None:
        prog = _make(lay, trees, who)
        _PROGRAMS[key] = prog
    return prog, leaves, treedef, [g for g, _ in flat]


def flatten_like(lay: Layout, model: PyTree, who: str) -> tuple[list, Any]:
    """Flatten `model`, which must have the structure `lay` was set up for (else a ValueError naming paths)."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    if treedef != lay.treedef:
        raise ValueError(f"{who}: the model does not have the structure this state was set up for: "
                         + structure_diff(list(lay.paths), flatten(model)[0]))
    return leaves, treedef


def _grad_map(lay: Layout, grads: PyTree, which: str) -> tuple[dict[int, int], list[str]]:
    """Match a gradient tree to model positions by JAX key path: `{position: flat gradient index}`.

    Key paths, not dotted names: a flat `{"a.b": g}` is not a gradient for `{"a": {"b": x}}`, and a model whose
    dotted names collide still trains. `None` may stand for any subtree. Anything else missing or extra is a
    structure error naming the path.
    """
    pairs, _ = jax.tree_util.tree_flatten_with_path(grads, is_leaf=lambda x: x is None)
    nones, found, gpaths = set(), {}, []
    for kp, g in pairs:
        if g is None:
            nones.add(kp)
            continue
        gpaths.append(dotted(kp))
        i = lay.key_index.get(kp)
        if i is None:
            where = ("where the model has a subtree" if kp in lay.key_nodes else
                     f"which is not a path of the model (key path {jax.tree_util.keystr(kp)}: gradients must "
                     f"have the model's structure, whose leaves are at "
                     f"{', '.join(map(jax.tree_util.keystr, lay.keypaths[:3]))}"
                     f"{', ...' if len(lay.keypaths) > 3 else ''})")
            raise ValueError(f"{which} has a leaf ({describe(g)}) at {show(gpaths[-1])}, {where}")
        found[i] = len(gpaths) - 1
    for i, kp in enumerate(lay.keypaths):
        if i not in found and not any(kp[:k] in nones for k in range(len(kp) + 1)):
            raise ValueError(f"{which} has no entry for {show(lay.paths[i])} (use None for 'no gradient'); "
                             f"structure differs from the model: " + structure_diff(list(lay.paths), gpaths))
    return found, gpaths


def _make(lay: Layout, trees: tuple, who: str) -> Program:
    names = [f"{who}: grads"] + [f"{who}: gradient tree {t + 2}" for t in range(len(trees) - 1)]
    maps = [_grad_map(lay, g, n) for g, n in zip(trees, names)]
    positions = [[(i, None) for i in p.members] + [(t.position, t.f) for t in p.transforms] for p in lay.params]
    graded = tuple(u for u in range(len(lay.params)) if any(i in maps[0][0] for i, _ in positions[u]))
    taken, paths, slots = [], [], []
    for found, gpaths in maps:
        order: dict[int, int] = {}
        per_param = []
        for u in graded:
            per_param.append(tuple(GradSlot(leaf=order.setdefault(found[i], len(order)), transform=f)
                                   for i, f in positions[u] if i in found))
        taken.append(tuple(order))
        paths.append(tuple(gpaths[j] for j in order))
        slots.append(tuple(per_param))
    # Outputs of _core: one new array per stepping parameter, then one per transformed member of those.
    stepping = tuple(u for u in graded if not lay.frozen[u])   # graded and not frozen
    n_new = len(stepping) + sum(len(lay.params[u].transforms) for u in stepping)
    out_src = list(range(n_new, n_new + lay.treedef.num_leaves))
    graded_at = {u: a for a, u in enumerate(graded)}
    stepping_at = {u: a for a, u in enumerate(stepping)}
    step_stacks, stack_plan = [], []
    for s, stack in enumerate(lay.stacks):
        rows = tuple(k for k, u in enumerate(stack) if u in stepping_at)
        if rows:
            step_stacks.append(s)
            stack_plan.append(StackPlan(rows=rows, graded=tuple(graded_at[stack[k]] for k in rows),
                                        stepping=tuple(stepping_at[stack[k]] for k in rows)))
    stack_src = [len(step_stacks) + s for s in range(len(lay.stacks))]
    for j, s in enumerate(step_stacks):
        stack_src[s] = j
    extra = len(stepping)
    for a, u in enumerate(stepping):
        for i in lay.params[u].members:
            out_src[i] = a
        for t in lay.params[u].transforms:
            out_src[t.position] = extra
            extra += 1
    canon = {lay.params[u].canonical for u in graded}
    check = tuple(i for p in lay.params for i in p.members + tuple(t.position for t in p.transforms) if i not in canon)
    check_at = {i: k for k, i in enumerate(check)}
    mirror_pos = tuple(tuple(check_at[i] for i in lay.params[u].members if i != lay.params[u].canonical)
                       for u in stepping)
    n_mirrors = sum(map(len, mirror_pos))
    out_traced = [k + n_mirrors if k >= n_new else k for k in out_src]
    for a, u in enumerate(stepping):
        for c, k in enumerate(mirror_pos[a]):
            out_traced[check[k]] = extra + c
        extra += len(mirror_pos[a])
    rule_of: dict[int, list[int]] = {}
    for j, s in enumerate(step_stacks):
        rule_of.setdefault(lay.params[lay.stacks[s][0]].rule, []).append(j)
    by_rule = tuple(RuleSteps(rule=r, stacks=tuple(js),
                              members=tuple(tuple(stepping[a] for a in stack_plan[j].stepping) for j in js))
                    for r, js in rule_of.items())
    return Program(layout=lay, graded=graded, stepping=stepping,
                   param_pos=tuple(lay.params[u].canonical for u in graded), check_pos=check,
                   grad_take=tuple(taken), grad_paths=tuple(paths), grad_slots=tuple(slots),
                   out_src=tuple(out_src), mirror_pos=tuple(mirror_pos), out_src_traced=tuple(out_traced),
                   step_stacks=tuple(step_stacks), stack_plan=tuple(stack_plan), stack_src=tuple(stack_src),
                   by_rule=by_rule)
