"""`microbatch`: a gradient function run over `n` slices of the batch by `lax.scan`, its outputs averaged."""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._base.tree import describe, flatten, show

__all__ = ["microbatch"]

_FLOAT0 = jax.dtypes.float0


def _count(n: Any) -> int:
    """`n` as a Python int >= 1, else TypeError / ValueError."""
    if isinstance(n, (bool, np.bool_)):
        raise TypeError(f"microbatch: n must be a positive int, got {n!r}")
    try:
        k = operator.index(n)  # int, numpy integer, a concrete 0-d integer array
    except TypeError:
        raise TypeError(f"microbatch: n must be a positive int, got {type(n).__name__} {n!r}") from None
    if k < 1:
        raise ValueError(f"microbatch: n must be a positive int, got {k}")
    return int(k)


def _check_batch(batch: tuple, n: int) -> None:
    """Every leaf of every batch argument is an array with a leading axis divisible by `n`."""
    for k, arg in enumerate(batch, start=1):
        paths, leaves, _ = flatten(arg)
        for path, x in zip(paths, leaves):
            where = f"batch leaf {show(path)} of argument {k}"
            if not isinstance(x, (jax.Array, np.ndarray)):
                raise TypeError(f"microbatch: {where} is {describe(x)}, not an array: every leaf of a batch "
                                "argument is split on its leading axis (pass constants by keyword or in the model)")
            if x.ndim == 0:
                raise TypeError(f"microbatch: {where} is a scalar ({describe(x)}): it has no leading axis to split "
                                "(pass constants by keyword or in the model)")
            size = x.shape[0]
            if size % n:
                raise ValueError(f"microbatch: {where} ({describe(x)}) has a leading axis of size {size}, "
                                 f"not divisible by n={n} ({size} = {n} * {size // n} + {size % n})")


def _kind(path: str, s: Any) -> str:
    """How an output leaf (a ShapeDtypeStruct) is combined across slices: 'mean', 'sum' or 'zero'."""
    dt = s.dtype
    if dt == _FLOAT0:
        return "zero"
    if jnp.issubdtype(dt, jnp.inexact):
        return "mean"
    if jnp.issubdtype(dt, jnp.integer):
        return "sum"
    raise TypeError(f"microbatch: output leaf {show(path)} is {jnp.dtype(dt).name}{list(s.shape)}; only floating "
                    "and complex outputs (averaged), integer outputs (summed) and float0 gradients are combined "
                    "across slices: return a float or an integer count instead")


def _acc_dtype(dt: Any) -> Any:
    """The dtype of the running sum: float32 or wider for floating leaves, the leaf's own dtype for integers."""
    return jnp.promote_types(dt, jnp.float32) if jnp.issubdtype(dt, jnp.inexact) else dt


def microbatch(grad_fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """`grad_fn` run on `n` equal slices of the batch, one after the other by `lax.scan`, its outputs averaged.

    `optim.microbatch(jax.value_and_grad(loss), n)` is a function `f(model, *batch, **kwargs)` that returns
    the mean loss and the mean gradients over the slices. Every leaf of every batch argument (the positional
    arguments after the first) is reshaped from `(B, ...)` to `(n, B / n, ...)` and slice `i` (rows
    `i * B / n` to `(i + 1) * B / n - 1`, contiguous) is passed to `grad_fn(model, *batch_i, **kwargs)`; the
    model (first argument) and the keyword arguments are passed whole to every slice. The outputs are combined
    leaf by leaf, so any output tree works, e.g. `(loss, grads)` or, with `has_aux=True`,
    `((loss, aux), grads)`:

    - floating and complex leaves: the mean over slices, `(1 / n) * sum_i out_i`, accumulated as a running sum
      in the scan carry (in float32 for float16 / bfloat16 leaves, cast back at the end), so no stack of `n`
      outputs exists and memory holds one slice's activations plus one gradient-sized sum;
    - integer leaves (counts in `aux`, e.g. correct predictions): the sum over slices, which is the
      full-batch count when the leaf counts over its slice;
    - float0 leaves (the gradients of integer leaves with `allow_int=True`): float0 zeros, as the full batch
      gives; `None` stays `None`; bool leaves raise TypeError (any or all? return a count instead).

    When the loss is a mean over the batch, the mean of the `n` slice means equals the full-batch mean (the
    slices are equal in size), and so do the gradients, up to rounding. A loss that is a sum over the batch
    gives the mean of the slice sums, which is `1 / n` of the full-batch sum (and of its gradient): multiply by
    `n`, or use a mean. `n == 1` calls `grad_fn` once, as it is, with no scan.

    Unlike `AccumGrad`, which spreads the accumulation over `n` calls of `update` with a persistent buffer in
    the optimiser state, `microbatch` does it within one call and keeps nothing: the result is an ordinary
    gradient to pass to `optim.update`.

    Args:
        grad_fn: a function `(model, *batch, **kwargs) -> outputs`, usually `jax.value_and_grad(loss)`
            (or `jax.grad(loss)`, or anything whose outputs are to be averaged over slices).
        n: the number of slices, a positive int. Every batch leaf's leading axis must be divisible by it
            (different leaves may have different leading sizes).

    Returns:
        `f(model, *batch, **kwargs)`, usable inside `jax.jit` (the split depends on shapes only) and eagerly:
        called outside any transformation, it runs as one jitted program cached per tree structure, shapes,
        dtypes and non-array leaves (Python flags and numbers in the model or keywords are constants of it).
        Calling it raises, before anything is computed, TypeError for a batch leaf that is not an array or is
        a scalar, and ValueError for a leading axis not divisible by `n`, naming the leaf's dotted path (within
        its argument; the model is argument 0) and the sizes. `microbatch` itself raises TypeError or
        ValueError for an `n` that is not a positive int.

    >>> import jax, jax.numpy as jnp, optim
    >>> def loss(w, x, y):
    ...     return jnp.mean((x @ w - y) ** 2)
    >>> w = jnp.array([1.0, -1.0])
    >>> x, y = jnp.arange(16.0).reshape(8, 2), jnp.ones(8)
    >>> # 4 slices of 2 rows
    >>> grad_fn = optim.microbatch(jax.value_and_grad(loss), 4)
    >>> grad_fn(w, x, y)
    (Array(4., dtype=float32), Array([-28., -32.], dtype=float32))
    >>> jax.value_and_grad(loss)(w, x, y)   # the full batch at once: the same
    (Array(4., dtype=float32), Array([-28., -32.], dtype=float32))
    >>> grad_fn(w, x[:6], y[:6])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: microbatch: batch leaf <root> of argument 1 (float32[6, 2]) has ...
    """
    if not callable(grad_fn):
        raise TypeError(f"microbatch: grad_fn must be callable, got {type(grad_fn).__name__}")
    n = _count(n)

    def scanned(model: Any, batch: tuple, kwargs: dict) -> Any:
        sliced = jax.tree.map(lambda x: jnp.reshape(x, (n, x.shape[0] // n) + x.shape[1:]), batch)

        def one(xs):
            return grad_fn(model, *xs, **kwargs)

        # The output structure of one slice, traced once (shapes only); the model and kwargs are closed over so
        # that non-array keyword arguments (flags) stay Python values.
        slice_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), sliced)
        paths, structs, treedef = flatten(jax.eval_shape(one, slice_shapes))
        kinds = [_kind(p, s) for p, s in zip(paths, structs)]
        acc_at = [i for i, kd in enumerate(kinds) if kd != "zero"]
        init = [jnp.zeros(structs[i].shape, _acc_dtype(structs[i].dtype)) for i in acc_at]

        def body(carry, xs):
            out = jax.tree.leaves(one(xs))
            return [c + out[i].astype(c.dtype) for c, i in zip(carry, acc_at)], None

        total, _ = jax.lax.scan(body, init, sliced)
        leaves: list = [np.zeros(s.shape, _FLOAT0) for s in structs]      # float0 leaves stay these zeros
        for c, i in zip(total, acc_at):
            leaves[i] = (c / n).astype(structs[i].dtype) if kinds[i] == "mean" else c
        return jax.tree.unflatten(treedef, leaves)

    # Called eagerly, the scan runs as one jitted program, cached per structure, shapes and non-array leaves
    # (a fresh lax.scan outside jit would be traced and compiled again on every call).
    @functools.partial(jax.jit, static_argnums=0)
    def jitted(spec: tuple, arrays: list) -> Any:
        treedef, static = spec
        leaves = list(arrays)
        for i, v in static:
            leaves.insert(i, v)
        return scanned(*jax.tree.unflatten(treedef, leaves))

    def microbatched(model: Any, *batch: Any, **kwargs: Any) -> Any:
        if not batch:
            raise TypeError("microbatch: nothing to split: call it as f(model, batch, ...) with at least one "
                            "batch argument after the model")
        _check_batch(batch, n)
        if n == 1:
            return grad_fn(model, *batch, **kwargs)
        leaves, treedef = jax.tree.flatten((model, batch, kwargs))
        if not any(isinstance(v, jax.core.Tracer) for v in leaves):
            static = tuple((i, v) for i, v in enumerate(leaves) if not isinstance(v, (jax.Array, np.ndarray)))
            try:
                hash(static)
            except TypeError:  # an unhashable non-array leaf: run the scan as it is
                pass
            else:
                return jitted((treedef, static), [v for v in leaves if isinstance(v, (jax.Array, np.ndarray))])
        return scanned(model, batch, kwargs)

    microbatched.__name__ = f"microbatch({getattr(grad_fn, '__name__', 'grad_fn')}, {n})"
    microbatched.__qualname__ = microbatched.__name__
    microbatched.__doc__ = f"`{getattr(grad_fn, '__name__', 'grad_fn')}` averaged over {n} slices of the batch " \
                           "(see optim.microbatch)."
    return microbatched
