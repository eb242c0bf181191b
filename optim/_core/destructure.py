"""`trainables` and `destructure`: the model's parameters as a list or one flat vector, each tie counted once."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .state import State
from .ties import identity_groups
from .._base.tree import PyTree, flatten, is_trainable
from .program import flatten_like


def _unique(model: PyTree, state: Any, who: str):
    """Paths, leaves, treedef, and per position its parameter's index (-1: not trainable) with, for a position
    tied through a function, that function; plus the position of each parameter's canonical leaf.

    Ties come from `state`'s tie map when given, else from object identity, which tracing does not keep.
    """
    if state is not None:
        if not isinstance(state, State):
            raise TypeError(f"{who}: the second argument is the State from optim.setup, got {type(state).__name__}")
        lay = state.layout
        leaves, treedef = flatten_like(lay, model, who)
        owner: list = [(-1, None)] * len(leaves)
        for u, p in enumerate(lay.params):
            for i in p.members:
                owner[i] = (u, None)
            for t in p.transforms:
                owner[t.position] = (u, t.f)
        return list(lay.paths), leaves, treedef, owner, [p.canonical for p in lay.params]
    paths, leaves, treedef = flatten(model)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        warnings.warn(f"optim.{who} was called on a traced model (inside jit or grad) without the state: ties are "
                      f"found by object identity, which tracing does not keep, so a tied array counts once per "
                      f"position. Pass the state's tie map: optim.{who}(model, state).", stacklevel=3)
    groups = identity_groups(leaves, [is_trainable(x) for x in leaves])
    owner = [(-1, None)] * len(leaves)      # per position: (index of its unique parameter, None), or (-1, None)
    for j, members in enumerate(groups.values()):
        for i in members:
            owner[i] = (j, None)
    return paths, leaves, treedef, owner, list(groups)     # groups are keyed by their first position


def trainables(model: PyTree, state: State | None = None, path: bool = False) -> list:
    """The unique trainable arrays of `model` in flatten order (a tied array appears once);
    with `path=True`, `(dotted_path, array)` pairs naming each array's canonical position.

    Ties are found by object identity; pass `state` (from `optim.setup`) to use its tie map instead, as needed
    inside `jax.jit` or `jax.grad`, where every position holds its own tracer.

    Args:
        model: a pytree.
        state: the optimiser state of `model`, whose tie map to use.
        path: return `(dotted_path, array)` pairs rather than the arrays.

    Returns:
        A list of arrays, or of `(dotted_path, array)` pairs.

    >>> import jax, jax.numpy as jnp, optim
    >>> w = jnp.ones(2)
    >>> model = {"a": w, "b": [w, jnp.zeros(3)], "n": 1}
    >>> [p for p, _ in optim.trainables(model, path=True)]
    ['a', 'b.1']
    >>> state = optim.setup(optim.Adam(), model)
    >>> count = lambda m: sum(a.size for a in optim.trainables(m, state))
    >>> int(jax.jit(count)(model))
    5
    """
    if isinstance(state, bool):   # trainables(model, True): the old positional form of path=True
        state, path = None, state
    paths, leaves, _, _, uniques = _unique(model, state, "trainables")
    return [(paths[i], leaves[i]) if path else leaves[i] for i in uniques]


def destructure(model: PyTree, state: State | None = None) -> tuple[jax.Array, Callable[[jax.Array], PyTree]]:
    """Flatten the trainable arrays into one vector (each tied array once) and return `rebuild`.

    `rebuild(flat)` puts a vector of the same length back into the model's structure, restoring each leaf's
    dtype and every tie (tied positions get one array object), and carrying non-trainable leaves through.
    It is differentiable: the gradient through `rebuild` sums the tied copies.

    Ties are found by object identity; pass `state` (from `optim.setup`) to use its tie map instead, as needed
    on a traced model (inside `jax.jit` or `jax.grad`). With a state, a position tied through a function
    (`ties={path: (canonical, f)}`) is not in the vector: `rebuild` writes `f(canonical)` there.

    Args:
        model: a pytree.
        state: the optimiser state of `model`, whose tie map to use.

    Returns:
        `(flat, rebuild)`: the vector, and the function that puts a vector back into the model.

    >>> import jax, jax.numpy as jnp, optim
    >>> w = jnp.ones(2)
    >>> model = {"emb": w, "head": w, "b": jnp.zeros(2)}
    >>> optim.destructure(model)[0].shape
    (4,)
    >>> state = optim.setup(optim.Adam(), model)
    >>> jax.jit(lambda m: optim.destructure(m, state)[0])(model).shape
    (4,)
    """
    paths, leaves, treedef, owner, uniques = _unique(model, state, "destructure")
    arrays = [jnp.asarray(leaves[i]) for i in uniques]
    dtype = jnp.result_type(*arrays) if arrays else jnp.float32
    sizes = [a.size for a in arrays]
    # No trainable leaf: an empty weakly-typed vector, which promotes nothing it is concatenated with
    # (Optimisers.jl #67: a float16 model's vector stays float16).
    flat = jnp.concatenate([a.ravel().astype(dtype) for a in arrays]) if arrays else jnp.full((0,), 0.0)
    total = int(sum(sizes))
    specs = [(a.shape, a.dtype) for a in arrays]

    def rebuild(v: jax.Array) -> PyTree:
        v = jnp.asarray(v)
        if v.shape != (total,):
            raise ValueError(f"rebuild: expected a vector of length {total}, got shape {tuple(v.shape)}")
        parts, start = [], 0
        for (shape, dt), n in zip(specs, sizes):
            part = v[start:start + n].reshape(shape)
            if jnp.iscomplexobj(part) and not jnp.issubdtype(dt, jnp.complexfloating):
                part = jnp.real(part)   # a real leaf in a vector promoted to complex by another leaf
            parts.append(part.astype(dt))
            start += n
        out = [x if j < 0 else parts[j] if f is None else f(parts[j]) for (j, f), x in zip(owner, leaves)]
        return treedef.unflatten(out)

    return flat, rebuild
