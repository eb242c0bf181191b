"""`update`: one jitted computation over the deduplicated parameters of a model.

Reading order: `update` (what runs per call) -> `_core` (the traced computation: `_check` the arrays, sum each
tie's gradients once in `_tie_sums`, step each rule's stacks, `_write_back` the new values). How a rule's stacks
step is the engine's, through its one interface, `optim._engine.strategies.run(Request) -> Result`: a
registered strategy where one applies (on CPU the fused kernel, `optim._engine.fused`), else XLA's path
(`optim._engine.xla`, the fallback). The static plan that maps the model's positions and gradient leaves to
parameters, built once per structure and cached, is `optim._core.program`; the norms of `return_stats=True` are
`optim._core.stats`.

Inside `_core`, each stack of parameters (`Layout.stacks`: same rule, shape, dtype, placement) runs its rule
once, vmapped over the stack's state, so the program has a handful of kernels per stack plus one small kernel per
parameter that writes its new value (on CPU, one kernel call per 64 parameters of the kernel's rules). Per call,
`update` flattens the model and each gradient tree (C++), looks the plan up by treedefs, gathers the arrays it
needs with `operator.itemgetter` (C speed, no per-leaf Python), calls the jitted `_core`, and puts the results
back the same way. Everything shape- or dtype-dependent is checked while `_core` traces, which happens exactly
when `jit`'s cache misses, so a valid call pays for no checks and an invalid one fails before anything runs.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import stats as stats
from .._engine import strategies as engine
from .._engine.pack import PackRows, assemble
from .program import Program, plan, take
from .._rules.schedules import resolve
from .._engine.stack import constrain, stack_arrays
from .layout import Layout
from .state import State, unwrap
from .._base.tree import PyTree, describe, show
from .._rules.wrappers import joint_norm


class Wants(NamedTuple):
    """What a call asks of `_core`, static (a jit's static argument: hashable, compared by value)."""

    grads: bool          # return the tie-summed gradients
    stats: bool          # return the norms (`return_stats`)
    in_place: bool       # the buffers are donated (or traced): the new values may overwrite them
    traced: bool         # inside a caller's trace: tied positions are outputs of their own (`Program.mirror_pos`)


class Steps(NamedTuple):
    """One rule's part of a traced step: its stepping stacks (indices into `Program.step_stacks`), what the
    engine was asked and what it returned."""

    stacks: tuple[int, ...]
    request: engine.Request
    result: engine.Result


def update(state: State, model: PyTree, grads: PyTree, *more_grads: PyTree, donate: bool = False,
           return_grads: bool = False, return_stats: bool = False) -> tuple:
    """Take one optimisation step: returns `(new_state, new_model)`; the inputs are not modified.

    For every parameter (tie group), the gradients of all its positions are summed, the rule runs once, and
    the new value is written to every position (eagerly, as one array object). Called eagerly it compiles
    itself once per structure; inside `jax.jit`, `pmap` or `vmap` it traces like any pure function.

    Args:
        state: the optimiser state, from `setup` or an earlier `update`.
        model: the model `state` was set up for (the same structure; the parameters' current values).
        grads: the gradients, in the model's structure. `None` in place of a leaf or subtree means no step
            and an unchanged state for those parameters; so does a frozen parameter.
        *more_grads: extra gradient trees, summed over ties the same way and passed to the rule as
            `apply(state, x, dx, dx2, ...)`.
        donate: let the eager call reuse the old state's and parameters' buffers (the caller must not use
            them afterwards).
        return_grads: also return the tie-summed gradients (as `tie_grads` gives them).
        return_stats: also return a dict of norms, computed in the same compiled program from the arrays
            the step already reads, each parameter (tie group) counted once: `"grad_norm"` of the tie-summed
            gradients applied (what `ClipGlobalNorm` sees), `"update_norm"` of `old - new` parameters,
            `"param_norm"` of the new parameters (all of them, stepping or not), and `"per_param"`,
            `{canonical path: {"grad_norm", "update_norm", "param_norm"}}` for every parameter (one that
            took no step has gradient and update norms 0). Norms are accumulated in float32 or wider.
            Eagerly, the global norms are device scalars and the per-parameter ones numpy scalars (one
            transfer, which waits for the step); inside a jit, return the per-parameter norms only when you
            log them: each returned scalar is an output XLA compiles on its own.

    Returns:
        `(state, model)`; with `return_grads`, `(state, model, grads)`; with `return_stats`,
        `(state, model, stats)`; with both, `(state, model, grads, stats)`.

    >>> import jax, jax.numpy as jnp, optim
    >>> w = jnp.array([1.0, 2.0])
    >>> # emb and head: one parameter; None: no step for b
    >>> model = {"emb": w, "head": w, "b": jnp.zeros(2)}
    >>> state = optim.setup(optim.Descent(0.25), model)
    >>> grads = {"emb": jnp.ones(2), "head": jnp.ones(2), "b": None}
    >>> state, model = optim.update(state, model, grads)
    >>> # the tie's gradients are summed
    >>> model["emb"], model["emb"] is model["head"], model["b"]
    (Array([0.5, 1.5], dtype=float32), True, Array([0., 0.], dtype=float32))
    >>> state, model = jax.jit(optim.update)(state, model, grads)   # the same
    >>> model["head"]
    Array([0., 1.], dtype=float32)
    >>> state, model, stats = optim.update(state, model, grads, return_stats=True)
    >>> names = ("grad_norm", "update_norm", "param_norm")
    >>> [round(float(stats[k]), 4) for k in names]
    [2.8284, 0.7071, 0.7071]
    >>> # the tie counts once
    >>> {k: round(float(v), 4) for k, v in stats["per_param"]["emb"].items()}
    {'grad_norm': 2.8284, 'update_norm': 0.7071, 'param_norm': 0.7071}
    """
    prog, leaves, treedef, flat = plan(state, model, (grads, *more_grads), "update")
    gs = tuple(take(g, t) for g, t in zip(flat, prog.grad_take))
    k = 1 if donate else 0
    run = prog.jitted[k] or _jitted(prog, k)
    # The fused kernel (optim._engine.fused) updates in place where the buffers are donated: eagerly with donate=True,
    # and inside a caller's jit (a train step usually donates; one that does not costs XLA a copy). An eager call
    # that keeps its inputs has the kernel write beside them instead.
    traced = isinstance(state.step, jax.core.Tracer)
    try:
        new_stacks, new_packs, new_params, step, summed, norms = run(
            Wants(grads=bool(return_grads), stats=bool(return_stats), in_place=bool(donate) or traced,
                  traced=traced), state.rules,
            take(state.stored, prog.step_stacks), state.packs, take(leaves, prog.param_pos),
            take(leaves, prog.check_pos), gs, state.step)
    except TypeError:
        _check_arrays(prog, leaves, gs, "update")   # jit names a bad argument `grads[0][0]`: name its path
        raise
    except jax.errors.JaxRuntimeError:              # refused before it ran: nothing was donated or computed
        if donate:
            _check_donation(prog, leaves, gs)
        raise
    new_leaves = take(new_params + tuple(leaves), prog.out_src_traced if traced else prog.out_src)
    # The pack groups the step wrote replace the old ones (the packs are not donated; see `_jitted`).
    packs = tuple(new_packs.get(k, group) for k, group in enumerate(state.packs))
    out = (State(state.layout, state.rules, take(new_stacks + state.stored, prog.stack_src), step, packs),
           treedef.unflatten(new_leaves))
    if return_grads:
        out += (_grad_tree(prog, summed, treedef),)
    if return_stats:
        out += (stats.as_dict(state.layout, norms),)
    return out


def tie_grads(state: State, grads: PyTree, model: PyTree | None = None) -> PyTree:
    """The gradient of each parameter, summed over its tie group, in the model's structure: the summed
    gradient at each canonical path and `None` at other tied positions, non-trainable leaves and parameters
    without a gradient (Optimisers.jl #211). Feed it to `optax.global_norm` to log a norm that counts each
    parameter once, or back to `update` as an already-summed gradient.

    Args:
        state: the optimiser state, from `setup`.
        grads: the gradients, in the model's structure (`None` for no gradient).
        model: the model; needed only for ties through a function (the pull-back is evaluated at the
            canonical value).

    Returns:
        A tree of the model's structure: the tie-summed gradient at each canonical path, `None` elsewhere.

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.zeros(2)
    >>> state = optim.setup(optim.Adam(), {"a": w, "b": w, "n": 1})
    >>> grads = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, 4.0]), "n": None}
    >>> optim.tie_grads(state, grads)
    {'a': Array([4., 6.], dtype=float32), 'b': None, 'n': None}
    """
    if model is None:
        if any(p.transforms for p in state.layout.params):
            raise ValueError("tie_grads: this state has ties through a function; pass model= to pull them back")
        model = state.layout.treedef.unflatten([0] * state.layout.treedef.num_leaves)
        params_needed = False
    else:
        params_needed = True
    prog, leaves, treedef, flat = plan(state, model, (grads,), "tie_grads", check_model=params_needed)
    xs = take(leaves, prog.param_pos) if params_needed else tuple(
        jax.ShapeDtypeStruct(state.layout.params[u].shape, state.layout.params[u].dtype) for u in prog.graded)
    gs = (take(flat[0], prog.grad_take[0]),)
    try:
        summed = (prog.jitted[2] or _jitted(prog, 2))(xs, gs)
    except TypeError:
        _check_arrays(prog, leaves if params_needed else None, gs, "tie_grads")
        raise
    return _grad_tree(prog, summed, treedef)


def global_norm(grads: PyTree, state: State | None = None) -> jax.Array:
    """The 2-norm of a whole gradient tree. With `state`, each parameter counts once, with the gradient summed
    over its tie group (`optax.global_norm` counts a tied weight once per position, with its partial gradient).

    Args:
        grads: a gradient tree (`None` leaves do not count).
        state: the optimiser state, from `setup`, whose tie map to use; without it every position counts.

    Returns:
        The norm, a scalar array.

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.zeros(2)
    >>> state = optim.setup(optim.Adam(), {"enc": w, "dec": w})
    >>> g = {"enc": jnp.array([3.0, 4.0]), "dec": jnp.array([3.0, 4.0])}
    >>> float(optim.global_norm(g, state)), round(float(optim.global_norm(g)), 4)
    (10.0, 7.0711)
    """
    leaves = jax.tree.leaves(tie_grads(state, grads) if state is not None else grads)
    return joint_norm([jnp.asarray(g) for g in leaves])


def _check_arrays(prog: Program, leaves: list | None, grads: tuple, who: str) -> None:
    """After jit refused an argument: raise a TypeError naming the model path of a gradient (or parameter) that
    is not an array. Checked only on failure, so a valid call pays nothing for it."""
    def ok(v: Any) -> bool:
        return isinstance(v, (jax.Array, np.ndarray, np.generic, int, float, complex))

    for t, tree in enumerate(grads):
        for k, g in enumerate(tree):
            if not ok(g):
                tree_name = "grads" if t == 0 else f"gradient tree {t + 1}"
                raise TypeError(f"{who}: {tree_name} has {type(g).__name__} {_short(g)} at "
                                f"{show(prog.grad_paths[t][k])}, where the model has a parameter; a gradient is an "
                                "array (or None for no step)")
    lay = prog.layout
    for i in (prog.param_pos + prog.check_pos) if leaves is not None else ():
        if not ok(leaves[i]):
            raise TypeError(f"{who}: model leaf {show(lay.paths[i])} is {type(leaves[i]).__name__} "
                            f"{_short(leaves[i])}, but the state was set up with an array there")


def _check_donation(prog: Program, leaves: list, grads: tuple) -> None:
    """After XLA refused a donated call: raise a ValueError naming a gradient that is the very array of a
    parameter `donate=True` gives away (XLA cannot read a buffer it was given to overwrite)."""
    donated = {id(leaves[i]): i for i in prog.param_pos}
    for t, tree in enumerate(grads):
        for k, g in enumerate(tree):
            if id(g) in donated:
                raise ValueError(f"update: the gradient at {show(prog.grad_paths[t][k])} is the array of the "
                                 f"parameter at {show(prog.layout.paths[donated[id(g)]])}, which donate=True gives "
                                 "away to be overwritten; pass a copy (jnp.array(x)) or donate=False")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _grad_tree(prog: Program, summed: tuple, treedef) -> PyTree:
    out: list = [None] * treedef.num_leaves
    for g, u in zip(summed, prog.graded):
        out[prog.layout.params[u].canonical] = g
    return treedef.unflatten(out)
def _check_param(x: Any, lay: Layout, i: int) -> None:
    p = lay.params[lay.param_of[i]]
    shape, dtype = p.shape, p.dtype
    for t in p.transforms:
        if t.position == i:
            shape, dtype = t.shape, t.dtype
    # Compared as JAX will store it: a numpy float64 model under 32-bit JAX was set up as float32.
    if not hasattr(x, "shape") or tuple(x.shape) != shape or jax.dtypes.canonicalize_dtype(x.dtype) != dtype:
        raise ValueError(f"update: model leaf {show(lay.paths[i])} is {describe(x)} but the state was set up for "
                         f"{jnp.dtype(dtype).name}{list(shape)} (a state set up for a different model?)")


def _prep_grad(g: Any, x: Any, path: str, f: Any) -> jax.Array:
    """Validate one gradient leaf against its position and cast it to the parameter's dtype."""
    g = jnp.asarray(g)
    want = jax.eval_shape(f, x) if f is not None else x
    if g.dtype == jax.dtypes.float0 or not jnp.issubdtype(g.dtype, jnp.inexact):
        raise TypeError(f"gradient at {show(path)} has dtype {g.dtype}, expected a floating dtype "
                        f"for the {describe(want)} parameter")
    if jnp.iscomplexobj(g) and not jnp.issubdtype(want.dtype, jnp.complexfloating):
        raise TypeError(f"gradient at {show(path)} is complex but the parameter is real ({describe(want)})")
    if g.shape != want.shape:
        raise ValueError(f"gradient at {show(path)} has shape {tuple(g.shape)}, "
                         f"expected {tuple(want.shape)} like the parameter")
    return g.astype(want.dtype)


def _tie_sums(prog: Program, xs: tuple, grads: tuple) -> tuple[list[tuple], list[tuple]]:
    """The one place tied gradients are summed. Per graded parameter: its summed gradient in each tree (its
    positions' gradients, a position tied through a function pulled back through that function's VJP at the
    canonical value), and its first tree's gradient as *parts*: the positions' gradients themselves where there
    are at most two and none is tied through a function (a strategy may add them in its own pass over the
    parameter; XLA then drops the unread sum), else the sum alone."""
    summed, parts = [], []
    for a, x in enumerate(xs):
        per_tree = []
        for t, tree in enumerate(grads):
            gs = []
            for slot in prog.grad_slots[t][a]:
                f = slot.transform
                g = _prep_grad(tree[slot.leaf], x, prog.grad_paths[t][slot.leaf], f)
                gs.append(g if f is None else jax.vjp(f, x)[1](g)[0])
            per_tree.append(functools.reduce(operator.add, gs).astype(x.dtype) if gs else jnp.zeros(x.shape, x.dtype))
            if t == 0:
                plain = 0 < len(gs) <= 2 and all(slot.transform is None for slot in prog.grad_slots[0][a])
                parts.append(tuple(gs) if plain else (per_tree[0],))
        summed.append(tuple(per_tree))
    return summed, parts


def _core(prog: Program, wants: Wants, rules: tuple, stored: tuple, packs: tuple,
          params: tuple, checks: tuple, grads: tuple, step: Any):
    """The traced step, as Optimisers.jl's `update!(Tied)`: check the arrays, sum each tie's gradients, step each
    rule's stacks (the engine, `optim._engine.strategies.run`), write the new values back."""
    _check(prog, params, checks)
    summed, parts = _tie_sums(prog, params, grads)
    for a, u in enumerate(prog.graded):
        # A requested state sharding (setup's state_sharding=): the summed gradients are pinned to the parameter's
        # own sharding (replicated, for ZeRO-1), so that the sharded state does not propagate back into the
        # caller's forward and backward passes (with Auto mesh axes XLA would otherwise repartition them).
        if prog.layout.params[u].state_place is not None:
            summed[a] = tuple(constrain(g, prog.layout.params[u].place) for g in summed[a])
    rules = resolve(tuple(unwrap(r) for r in rules), step)
    # Traced, a tied parameter's other positions are outputs of the caller's program too: per stepping
    # parameter, the arrays at those positions (see `optim._engine.xla.mirrors`), else nothing.
    mirrors = [tuple(checks[k] for k in ks) if wants.traced else () for ks in prog.mirror_pos]
    steps = []
    for by in prog.by_rule:
        plans = [prog.stack_plan[j] for j in by.stacks]
        request = engine.Request(
            layout=prog.layout, rule=rules[by.rule], stacks=tuple(prog.step_stacks[j] for j in by.stacks),
            rows=tuple(p.rows for p in plans), members=by.members, stored=tuple(stored[j] for j in by.stacks),
            packs=packs,
            params=tuple(tuple(params[a] for a in p.graded) for p in plans),
            grads=tuple(tuple(summed[a] for a in p.graded) for p in plans),
            parts=tuple(tuple(parts[a] for a in p.graded) for p in plans),
            mirrors=tuple(tuple(mirrors[a] for a in p.stepping) for p in plans), in_place=wants.in_place)
        steps.append(Steps(stacks=by.stacks, request=request, result=engine.run(request)))
    new_stored, new_params, new_mirrors, new_packs = _write_back(prog, packs, steps)
    copies = [t.f(new_params[a]) for a, u in enumerate(prog.stepping) for t in prog.layout.params[u].transforms]
    grads_out = tuple(s[0] for s in summed) if wants.grads else ()
    norms = stats.norms(prog, _squares(prog, steps, new_params), params, checks) if wants.stats else ()
    # A strong int32, whatever `step` came in as, so the next call's signature is the same (no retrace).
    return (new_stored, new_packs, tuple(new_params) + tuple(copies) + tuple(y for m in new_mirrors for y in m),
            jnp.asarray(step, jnp.int32) + jnp.int32(1), grads_out, norms)


def _check(prog: Program, params: tuple, checks: tuple) -> None:
    """Every model array the call reads against the layout (while tracing: a valid call pays nothing)."""
    lay = prog.layout
    for i, x in zip(prog.check_pos, checks):
        _check_param(x, lay, i)
    for u, x in zip(prog.graded, params):
        _check_param(x, lay, lay.params[u].canonical)


def _write_back(prog: Program, packs: tuple, steps: list[Steps]) -> tuple[tuple, list, list, dict]:
    """The engine's results in `_core`'s output order: the new stored stacks (per stepping stack); per stepping
    parameter its new value and its tied positions' values (`optim._engine.xla.mirrors`); the pack groups
    written (`{group: arrays}`)."""
    new_stored: list = [None] * len(prog.step_stacks)
    new_params: list = [None] * len(prog.stepping)
    new_mirrors: list = [()] * len(prog.stepping)
    pack_rows: list = []
    for part in steps:
        result = part.result
        for j, st, new, ms in zip(part.stacks, result.stored, result.params, result.mirrors):
            new_stored[j] = st
            for a, x, m in zip(prog.stack_plan[j].stepping, new, ms):
                new_params[a] = x
                new_mirrors[a] = m
        # Whole pack groups, each from one array (see `optim._engine.xla.rule_step`).
        pack_rows += [PackRows(group=k, leaf=t, rows=tuple(range(np.shape(a)[0])), values=a)
                      for k, group in result.packs.items() for t, a in enumerate(group)]
    return tuple(new_stored), new_params, new_mirrors, assemble(packs, pack_rows)


def _squares(prog: Program, steps: list[Steps], new_params: list) -> list:
    """For `return_stats`: per stepping stack, its rows' squared norms of the gradient, the old and the new value
    (the new ones as written, so the step is not recomputed): a few kernels per stack, not per parameter."""
    squares: list = [None] * len(prog.step_stacks)
    for part in steps:
        for j, x, g in zip(part.stacks, part.request.params, part.request.grads):
            squares[j] = stats.row_squares(stack_arrays([d[0] for d in g]), stack_arrays(list(x)),
                                           stack_arrays([new_params[a] for a in prog.stack_plan[j].stepping]))
    return squares


def _sums_core(prog: Program, xs: tuple, grads: tuple) -> tuple:
    return tuple(s[0] for s in _tie_sums(prog, xs, grads)[0])


def _jitted(prog: Program, k: int) -> Any:
    """Make `prog.jitted[k]`: 0 runs `_core`, 1 runs it donating the state stacks and parameters, 2 `_sums_core`.
    The packs are not donated: a call returns only the pack groups it writes, and they are a few numbers each.

    Each Program owns its jitted functions, and JAX keeps a function's traces and executables only while the
    function lives (its caches hold functions weakly), so evicting a Program from `_PROGRAMS` frees what was
    compiled for it. (A global `jax.jit(_core, static_argnums=0)` would keep every Program it has seen, with its
    executables, alive as a static argument in JAX's caches.) The functions reach the Program through a weak
    reference, so there is no reference cycle: the memory goes at eviction, not at some later `gc` pass.
    """
    ref = weakref.ref(prog)
    if k == 2:
        f = jax.jit(functools.partial(_sums_of, ref))
    else:
        f = jax.jit(functools.partial(_core_of, ref), static_argnums=0, donate_argnums=(2, 4) if k else ())
    prog.jitted[k] = f
    return f


def _core_of(ref: weakref.ref, wants: Wants, rules: tuple, stacks: tuple, packs: tuple,
             params: tuple, checks: tuple, grads: tuple, step: Any):
    return _core(ref(), wants, rules, stacks, packs, params, checks, grads, step)


def _sums_of(ref: weakref.ref, xs: tuple, grads: tuple) -> tuple:
    return _sums_core(ref(), xs, grads)
