"""`update`: one jitted computation over the deduplicated parameters of a model.

Reading order: `update` (what runs per call) -> `_program` (the static plan, built once per structure) ->
`_core` (the traced computation). Per call, `update` flattens the model and each gradient tree (C++), looks the
plan up by treedefs, gathers the arrays it needs with `operator.itemgetter` (C speed, no per-leaf Python), calls
the jitted `_core`, and puts the results back the same way. Everything shape- or dtype-dependent is checked
while `_core` traces, which happens exactly when `jit`'s cache misses, so a valid call pays for no checks and an
invalid one fails before anything runs.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Any

import jax
import jax.numpy as jnp

from ._rules import apply_step
from ._state import Layout, State
from ._tree import PyTree, describe, dotted, prefixes, show, structure_diff


def _take(seq, idx: tuple[int, ...]) -> tuple:
    if len(idx) > 1:
        return operator.itemgetter(*idx)(seq)
    return (seq[idx[0]],) if idx else ()


@dataclasses.dataclass(frozen=True, eq=False)   # hashed by identity: programs are cached and reused
class Program:
    layout: Layout
    active: tuple[int, ...]               # parameters that step this call
    param_pos: tuple[int, ...]            # model position read for each active parameter (its canonical)
    check_pos: tuple[int, ...]            # every other trainable position, only to validate shapes
    grad_take: tuple[tuple[int, ...], ...]            # per gradient tree: which flat gradient leaves to pass
    grad_paths: tuple[tuple[str, ...], ...]           # ... and their dotted paths, for error messages
    grad_slots: tuple[tuple[tuple[int, ...], ...], ...]  # per tree, per active parameter: indices into the above
    out_src: tuple[int, ...]              # per model position: index into new_params + old leaves
    state_src: tuple[int, ...]            # per parameter: index into new_states + old states


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_MAX_PROGRAMS = 256


def update(state: State, model: PyTree, grads: PyTree, *more_grads: PyTree,
           donate: bool = False) -> tuple[State, PyTree]:
    """Take one optimisation step: returns `(new_state, new_model)`; the inputs are not modified.

    For every parameter (tie group), the gradients of all its positions are summed, the rule runs once, and
    the new value is written to every position (eagerly, as one array object). `None` in place of a gradient
    leaf or subtree means no step and an unchanged state; so does a frozen parameter. Extra gradient trees
    (`more_grads`) are summed the same way and passed to the rule as `apply(state, x, dx, dx2, ...)`.

    Called eagerly it compiles itself once per structure; inside `jax.jit`, `pmap` or `vmap` it traces like
    any pure function. `donate=True` lets the eager call reuse the old state's and parameters' buffers (the
    caller must not use them afterwards).
    """
    if not isinstance(state, State):
        raise TypeError(f"update: expected the State from optim.setup as first argument, got {type(state).__name__}")
    lay = state.layout
    leaves, treedef = jax.tree_util.tree_flatten(model)
    if treedef != lay.treedef:
        raise ValueError("update: the model does not have the structure this state was set up for: "
                         + structure_diff(list(lay.paths), _paths(model)))
    flat = [jax.tree_util.tree_flatten(g) for g in (grads, *more_grads)]
    key = (lay, *(d for _, d in flat))
    prog = _PROGRAMS.get(key)
    if prog is None:
        prog = _program(lay, (grads, *more_grads))
        _PROGRAMS[key] = prog
        if len(_PROGRAMS) > _MAX_PROGRAMS:
            _PROGRAMS.popitem(last=False)
    gs = tuple(_take(g, t) for (g, _), t in zip(flat, prog.grad_take))
    run = _core_donated if donate else _core_jit
    new_states, new_params = run(prog, state.rules, _take(state.leaves, prog.active),
                                 _take(leaves, prog.param_pos), _take(leaves, prog.check_pos), gs)
    new_leaves = _take(new_params + tuple(leaves), prog.out_src)
    new_state = State(lay, state.rules, _take(new_states + state.leaves, prog.state_src))
    return new_state, treedef.unflatten(new_leaves)


def _paths(tree: PyTree) -> list[str]:
    return [dotted(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _grad_map(lay: Layout, grads: PyTree, which: str) -> tuple[dict[int, int], list[str]]:
    """Match a gradient tree to model positions by dotted path: `{position: flat gradient index}`.

    `None` may stand for any subtree. Anything else missing or extra is a structure error naming the path.
    """
    pairs, _ = jax.tree_util.tree_flatten_with_path(grads, is_leaf=lambda x: x is None)
    nodes = {q for p in lay.paths for q in prefixes(p)}
    nones, found, gpaths = set(), {}, []
    for kp, g in pairs:
        p = dotted(kp)
        if g is None:
            nones.add(p)
            continue
        gpaths.append(p)
        i = lay.index.get(p)
        if i is None:
            where = "where the model has a subtree" if p in nodes else "which is not a path of the model"
            raise ValueError(f"update: {which} has a leaf ({describe(g)}) at {show(p)}, {where}")
        found[i] = len(gpaths) - 1
    for i, p in enumerate(lay.paths):
        if i not in found and not any(q in nones for q in prefixes(p)):
            raise ValueError(f"update: {which} has no entry for {show(p)} (use None for 'no gradient'); "
                             f"structure differs from the model: " + structure_diff(list(lay.paths), gpaths))
    return found, gpaths


def _program(lay: Layout, trees: tuple) -> Program:
    maps = [_grad_map(lay, g, "grads" if t == 0 else f"gradient tree {t + 1}") for t, g in enumerate(trees)]
    members = [[i for i in p.members if i in maps[0][0]] for p in lay.params]
    active = tuple(u for u, p in enumerate(lay.params) if members[u] and not lay.frozen[u])
    take, paths, slots = [], [], []
    for found, gpaths in maps:
        order: dict[int, int] = {}
        per_param = []
        for u in active:
            idx = []
            for i in lay.params[u].members:
                if i in found:
                    idx.append(order.setdefault(found[i], len(order)))
            per_param.append(tuple(idx))
        take.append(tuple(order))
        paths.append(tuple(gpaths[j] for j in order))
        slots.append(tuple(per_param))
    n_new, n_leaves = len(active), lay.treedef.num_leaves
    out_src = list(range(n_new, n_new + n_leaves))
    state_src = [n_new + u for u in range(len(lay.params))]
    for a, u in enumerate(active):
        state_src[u] = a
        for i in lay.params[u].members:
            out_src[i] = a
    canon = {lay.params[u].canonical for u in active}
    check = tuple(i for p in lay.params for i in p.members if i not in canon)
    return Program(lay, active, tuple(lay.params[u].canonical for u in active), check, tuple(take),
                   tuple(paths), tuple(slots), tuple(out_src), tuple(state_src))


def _check_param(x: Any, lay: Layout, i: int) -> None:
    p = lay.params[lay.param_of[i]]
    if not hasattr(x, "shape") or tuple(x.shape) != p.shape or jnp.dtype(x.dtype) != p.dtype:
        raise ValueError(f"update: model leaf {show(lay.paths[i])} is {describe(x)} but the state was set up for "
                         f"{jnp.dtype(p.dtype).name}{list(p.shape)} (a state set up for a different model?)")


def _prep_grad(g: Any, x: jax.Array, path: str) -> jax.Array:
    """Validate one gradient leaf against its parameter; conjugate for complex parameters (see `_rules`)."""
    g = jnp.asarray(g)
    if g.dtype == jax.dtypes.float0 or not jnp.issubdtype(g.dtype, jnp.inexact):
        raise TypeError(f"update: gradient at {show(path)} has dtype {g.dtype}, expected a floating dtype "
                        f"for the {describe(x)} parameter")
    if jnp.iscomplexobj(g) and not jnp.iscomplexobj(x):
        raise TypeError(f"update: gradient at {show(path)} is complex but the parameter is real ({describe(x)})")
    if g.shape != x.shape:
        raise ValueError(f"update: gradient at {show(path)} has shape {tuple(g.shape)}, "
                         f"expected {tuple(x.shape)} like the parameter")
    if jnp.iscomplexobj(x):
        g = jnp.conj(g)
    return g.astype(x.dtype)


def _core(prog: Program, rules: tuple, states: tuple, params: tuple, checks: tuple, grads: tuple):
    lay = prog.layout
    for i, x in zip(prog.check_pos, checks):
        _check_param(x, lay, i)
    new_states, new_params = [], []
    for a, u in enumerate(prog.active):
        p, x = lay.params[u], params[a]
        _check_param(x, lay, p.canonical)
        dxs = []
        for t, tree in enumerate(grads):
            parts = [_prep_grad(tree[k], x, prog.grad_paths[t][k]) for k in prog.grad_slots[t][a]]
            # Tied positions' gradients are summed on device: one parameter, one gradient.
            dxs.append(sum(parts[1:], parts[0]) if parts else jnp.zeros_like(x))
        st, step = rules[p.rule].apply(states[a], x, *dxs)
        new_states.append(st)
        new_params.append(apply_step(x, step))
    return tuple(new_states), tuple(new_params)


_core_jit = jax.jit(_core, static_argnums=0)
_core_donated = jax.jit(_core, static_argnums=0, donate_argnums=(2, 3))
