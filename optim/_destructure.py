"""`trainables` and `destructure`: the model's parameters as a list or one flat vector, each tie counted once."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ._tree import PyTree, flatten, is_trainable


def _unique(model: PyTree):
    paths, leaves, treedef = flatten(model)
    first: dict[int, int] = {}
    owner = []       # per position: index of its unique parameter, or -1
    uniques = []     # positions of the first occurrence of each parameter
    for i, x in enumerate(leaves):
        if not is_trainable(x):
            owner.append(-1)
            continue
        j = first.setdefault(id(x), len(uniques))
        if j == len(uniques):
            uniques.append(i)
        owner.append(j)
    return paths, leaves, treedef, owner, uniques


def trainables(model: PyTree, path: bool = False) -> list:
    """The unique trainable arrays of `model` in flatten order (a tied array appears once);
    with `path=True`, `(dotted_path, array)` pairs naming each array's first position.

    >>> import jax.numpy as jnp, optim
    >>> w = jnp.ones(2)
    >>> [p for p, _ in optim.trainables({"a": w, "b": [w, jnp.zeros(3)], "n": 1}, path=True)]
    ['a', 'b.1']
    """
    paths, leaves, _, _, uniques = _unique(model)
    return [(paths[i], leaves[i]) if path else leaves[i] for i in uniques]


def destructure(model: PyTree) -> tuple[jax.Array, Callable[[jax.Array], PyTree]]:
    """Flatten the trainable arrays into one vector (each tied array once) and return `rebuild`.

    `rebuild(flat)` puts a vector of the same length back into the model's structure, restoring each leaf's
    dtype and every tie (tied positions get one array object), and carrying non-trainable leaves through.
    It is differentiable: the gradient through `rebuild` sums the tied copies.
    """
    paths, leaves, treedef, owner, uniques = _unique(model)
    arrays = [jnp.asarray(leaves[i]) for i in uniques]
    dtype = jnp.result_type(*arrays) if arrays else jnp.float32
    sizes = [a.size for a in arrays]
    flat = jnp.concatenate([a.ravel().astype(dtype) for a in arrays]) if arrays else jnp.zeros(0, dtype)
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
        out = [parts[j] if j >= 0 else x for j, x in zip(owner, leaves)]
        return treedef.unflatten(out)

    return flat, rebuild
