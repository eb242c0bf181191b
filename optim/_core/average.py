"""`averaged`: the model with each averaged parameter (`optim.EMA`) replaced by its average."""

from __future__ import annotations

from typing import Any

import jax

from .._base.cache import memoize
from .._base.tree import PyTree
from .._engine.stack import stack_arrays
from .._rules.protocol import average_of
from .program import flatten_like
from .layout import Layout
from .state import State, unwrap

__all__ = ["averaged"]


def averaged(state: State, model: PyTree) -> PyTree:
    """The model to evaluate: each parameter whose rule keeps an average (`EMA`, possibly inside chains and
    other wrappers) replaced by that average, every other leaf as in `model`. Ties are kept: a tie group's
    average is written to each member (eagerly, as one array object; a position tied through a function gets
    `f(average)`). Works eagerly (compiled once per structure) and inside `jit`.

    Args:
        state: the optimiser state, from `setup`.
        model: the current model, of the structure `state` was set up for.

    Returns:
        A model of the same structure: the averages in place of the averaged parameters.

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.array([1.0, 2.0])
    >>> model = {"emb": w, "head": w, "n": 3}
    >>> state = optim.setup(optim.EMA(optim.Descent(0.1), decay=0.9), model)
    >>> grads = {"emb": jnp.ones(2), "head": jnp.ones(2), "n": None}
    >>> state, model = optim.update(state, model, grads)
    >>> avg = optim.averaged(state, model)
    >>> avg["emb"], avg["emb"] is avg["head"], avg["n"]     # 0.9 · 1 + 0.1 · 0.8
    (Array([0.98, 1.98], dtype=float32), True, 3)
    """
    if not isinstance(state, State):
        raise TypeError(f"averaged: expected the State from optim.setup, got {type(state).__name__}")
    lay = state.layout
    leaves, treedef = flatten_like(lay, model, "averaged")
    new = _averager(lay)(state.rules, state.stacks, tuple(leaves[p.canonical] for p in lay.params))
    if all(a is None for a in new):
        raise ValueError("averaged: no rule in this state keeps an average of the parameters; wrap the rule: "
                         "optim.setup(optim.EMA(rule, decay=0.999), model)")
    out = list(leaves)
    for p, a in zip(lay.params, new):
        if a is None:
            continue
        for i in p.members:
            out[i] = a
        for t in p.transforms:
            out[t.position] = t.f(a)
    return treedef.unflatten(out)


# 32 layouts: a run averages one or two models; each entry holds a compiled program.
@memoize(32)
def _averager(lay: Layout) -> Any:
    """The jitted computation of every parameter's average for this layout (cached; evicting one frees its
    compiled program)."""
    return jax.jit(lambda rules, stacks, xs: _averages(lay, rules, stacks, xs))


def _averages(lay: Layout, rules: tuple, stacks: tuple, xs: tuple) -> tuple:
    """Per parameter, its average or None; each stack's rows at once (vmapped over the stack)."""
    out: list = [None] * len(lay.params)
    for stack, st in zip(lay.stacks, stacks):
        rule = unwrap(rules[lay.params[stack[0]].rule])
        avg = jax.vmap(lambda s, x, rule=rule: average_of(rule, s, x))(st, stack_arrays([xs[u] for u in stack]))
        if avg is not None:
            for k, u in enumerate(stack):
                out[u] = avg[k]
    return tuple(out)
