"""State surgery: reset a parameter's state, take the state of a submodel, graft one back.

`setup(rule, new_model, like=old_state)` (in `_state`) covers a model that grew or shrank; these cover the
rest of gradual unfreezing and head replacement (Optimisers.jl #163 and its tied-weights discussion).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .adjust import select
from .program import flatten_like
from .._engine.stack import init_stack, reads_nothing
from .._rules.schedules import at_start
from .layout import Layout, PathError
from .state import State, unwrap
from .._base.tree import PyTree, key_name, show


def reset(state: State, *patterns: str, model: PyTree | None = None) -> State:
    """Re-initialise the optimiser state of the matching parameters (all with no pattern): zero momenta, restart
    bias corrections. Rules whose state depends on the parameter's value (`MixedPrecision`) need `model`.

    >>> import jax.numpy as jnp, optim
    >>> m = {"a": jnp.ones(2), "b": jnp.ones(2)}
    >>> s = optim.setup(optim.Momentum(0.1), m)
    >>> s, m = optim.update(s, m, {"a": jnp.ones(2), "b": jnp.ones(2)})
    >>> optim.reset(s, "a")["a"].state, optim.reset(s, "a")["b"].state
    (Array([0., 0.], dtype=float32), Array([0.1, 0.1], dtype=float32))
    """
    chosen = select(state, patterns, "reset")
    lay = state.layout
    leaves = lay.treedef.flatten_up_to(model) if model is not None else None
    new = {}
    for u in sorted(set(chosen)):
        p = lay.params[u]
        rule = unwrap(state.rules[p.rule])
        if leaves is None and not reads_nothing(at_start(rule).init, jax.ShapeDtypeStruct(p.shape, p.dtype)):
            raise ValueError(f"reset: the state of {show(lay.paths[p.canonical])} depends on the parameter's "
                             "value; pass model=")
        x = leaves[p.canonical] if leaves is not None else np.zeros(p.shape, p.dtype)
        stacked = init_stack(rule, [x], lambda p=p: lay.paths[p.canonical])
        new[u] = jax.tree.map(lambda a: a[0], stacked)
    return state.with_param_states(new)


def _node_at(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split(".") if path else []:
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x, n=node: x is not n)[0]
        for kp, child in children:
            if kp and key_name(kp[0]) == part:
                node = child
                break
        else:
            raise PathError(f"{show(path)} is not a node of the model")
    return node


def subtree(state: State, path: str) -> State:
    """The state of the submodel at dotted `path`, as `setup` would give for that submodel (its parameters'
    states are copied out of the stacks).

    A tie group reaching outside the submodel keeps its members inside it; a position tied through a function
    whose canonical lies outside is an error.

    >>> import jax.numpy as jnp, optim
    >>> model = {"encoder": {"w": jnp.ones(2)}, "head": jnp.ones(3)}
    >>> state = optim.setup(optim.Adam(), model)
    >>> optim.subtree(state, "encoder").paths()
    ['w']
    """
    lay = state.layout
    full = lay.treedef.unflatten(list(range(lay.treedef.num_leaves)))
    inner, sub_treedef = jax.tree_util.tree_flatten(_node_at(full, path))
    where = {pos: k for k, pos in enumerate(inner)}
    params, leaves, frozen = [], [], []
    for u, p in enumerate(lay.params):
        members = tuple(where[i] for i in p.members if i in where)
        transforms = tuple(t._replace(position=where[t.position]) for t in p.transforms if t.position in where)
        if not members:
            if transforms:
                raise ValueError(f"subtree: {show(lay.paths[p.transforms[0].position])} is tied through a function to "
                                 f"{show(lay.paths[p.canonical])}, outside {show(path)}")
            continue
        params.append(dataclasses.replace(p, canonical=members[0], members=members, transforms=transforms))
        leaves.append(state.param_state(u))
        frozen.append(lay.frozen[u])
    return State.of_params(Layout(sub_treedef, tuple(params), tuple(frozen), lay.wide), state.rules, leaves,
                           state.step)


def graft(state: State, path: str, sub: State) -> State:
    """Put the per-parameter states of `sub` (a state for the submodel at `path`) into `state`.

    >>> import jax.numpy as jnp, optim
    >>> model = {"encoder": {"w": jnp.ones(2)}, "head": jnp.ones(3)}
    >>> state = optim.setup(optim.Momentum(0.1), model)
    >>> sub = optim.subtree(state, "encoder")
    >>> sub, _ = optim.update(sub, model["encoder"], {"w": jnp.ones(2)})
    >>> optim.graft(state, "encoder", sub)["encoder.w"].state
    Array([0.1, 0.1], dtype=float32)
    """
    lay = state.layout
    new = {}
    for rel, leaf in sub.items():
        full = f"{path}.{rel}" if path and rel else (path or rel)
        u = lay.param(full)
        old = state.param_state(u)
        if jax.tree.structure(old) != jax.tree.structure(leaf.state) or any(
                np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(leaf.state))):
            raise ValueError(f"graft: the state for {show(full)} does not have the shape of the existing one "
                             "(another rule or parameter shape?)")
        new[u] = leaf.state
    return state.with_param_states(new)


def retie(state: State, model: PyTree) -> PyTree:
    """`model` with every tie group's positions holding the canonical position's array object again.

    A jitted step returns tied positions as separate (equal) buffers: the state still knows the tie, but
    identity-based tools (`trainables`, `destructure`, a fresh `setup`) do not. Call `retie` eagerly before
    them. A position tied through a function gets `f(canonical)`.

    >>> import jax, jax.numpy as jnp, optim
    >>> w = jnp.ones(2)
    >>> state = optim.setup(optim.Descent(0.1), {"a": w, "b": w})
    >>> state, m = jax.jit(optim.update)(state, {"a": w, "b": w}, {"a": w, "b": w})
    >>> m["a"] is m["b"], len(optim.trainables(optim.retie(state, m)))
    (False, 1)
    """
    lay = state.layout
    leaves, treedef = flatten_like(lay, model, "retie")
    out = list(leaves)
    for p in lay.params:
        x = leaves[p.canonical]
        for i in p.members:
            out[i] = x
        for t in p.transforms:
            out[t.position] = t.f(x)
    return treedef.unflatten(out)


def donatable(state: State, model: PyTree) -> PyTree:
    """A copy of `model` with a separate buffer at every tied position, so that `jax.jit(step, donate_argnums=...)`
    can donate it (the input model stays usable): JAX refuses to donate one buffer twice ("Attempt to donate the
    same buffer twice"). The state's tie map keeps the positions tied through the jitted steps; `retie` makes
    them one object again.

    >>> import jax, jax.numpy as jnp, optim
    >>> w = jnp.ones(2)
    >>> state = optim.setup(optim.Descent(0.1), {"a": w, "b": w})
    >>> m = optim.donatable(state, {"a": w, "b": w})
    >>> m["a"] is m["b"], bool((m["a"] == m["b"]).all())
    (False, True)
    """
    lay = state.layout
    leaves, treedef = flatten_like(lay, model, "donatable")
    # Every position of a shared buffer gets its own copy, so donating the result leaves `model` usable.
    counts: dict[int, int] = {}
    for x in leaves:
        counts[id(x)] = counts.get(id(x), 0) + 1
    out = [jnp.array(x, copy=True) if lay.param_of[i] >= 0 and counts[id(x)] > 1 else x
           for i, x in enumerate(leaves)]
    return treedef.unflatten(out)
