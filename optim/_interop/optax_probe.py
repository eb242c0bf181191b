"""The two probes `from_optax` runs on an optax transformation when its rule is set up (`check` in
`optax_checks.py` calls them, after its list of known whole-tree transformations).

`from_optax` runs `tx` on each parameter separately, with one array as the whole tree. That is right only for a
transformation that acts on each array independently, and only if its updates are meant to be added.

- `cross_leaf`, the dependency probe: three steps of `tx` on a tree of two arrays are traced (not run) and the
  jaxpr is walked (`optim/_engine/jaxpr_deps.py`: through jit, cond, while, scan and custom-derivative calls) to see
  whether either array's update depends on the other array's value, gradient or state. A *whole-tree*
  transformation does: it computes something over all arrays together (a global norm, an inner product, an
  all-finite test, a line search over the loss). The probe is conservative: a transformation that concatenates
  the arrays and splits them again (`optax.flatten`) counts as one too.
- `update_orientation`: one small compiled update, to see which way `tx`'s output points. An optimiser's
  updates point against the gradient (they are added); a gradient transformation without its learning-rate
  stage (`optax.scale_by_adam()`, `optax.clip(1.0)`) keeps the gradient's orientation and, used as an
  optimiser, would climb the loss.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine.jaxpr_deps import output_deps

__all__ = ["cross_leaf", "update_orientation"]


def _probe_array(rng: np.random.Generator, shape: tuple, dtype: Any, scale: float, offset: float = 0.0):
    v = rng.standard_normal(shape) * scale + offset
    if jnp.issubdtype(dtype, jnp.complexfloating):
        v = v + 1j * rng.standard_normal(shape) * scale
    return jnp.asarray(v, dtype)


_A, _B = "optim_probe_a", "optim_probe_b"    # dict keys that mark the two probe arrays in a traced tree


def _labelled(tree: Any) -> list:
    """For each leaf of `tree`, the probe arrays (`_A`, `_B`) its path goes through."""
    out = []
    for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = {getattr(k, "key", None) for k in kp}
        out.append(frozenset(n for n in (_A, _B) if n in keys))
    return out


def cross_leaf(tx: Any, shape: tuple, dtype: Any, extra: dict, tree_args: tuple, steps: int = 3) -> bool:
    """Whether `tx`, run for a few steps on a tree of two arrays, makes either array's update depend on the
    other array (its value, gradient or state). Only traces: nothing is compiled or run."""
    spec = jax.ShapeDtypeStruct(shape, dtype)

    def run(params, grads, trees):
        state = tx.init(params)
        outs = []
        for t in range(steps):
            kw = {n: tr[t] for n, tr in zip(tree_args, trees)}
            u, state = tx.update(grads[t], state, params, **extra, **kw)
            params = jax.tree.map(lambda p, d: (p + d).astype(p.dtype), params, u)
            outs.append(u)
        return outs

    two = {_A: spec, _B: spec}
    args = (two, [two] * steps, [[two] * steps for _ in tree_args])
    closed, out_shape = jax.make_jaxpr(run, return_shape=True)(*args)
    labels = output_deps(closed.jaxpr, _labelled(args))
    for lab, want in zip(labels, _labelled(out_shape)):
        if not lab <= want:
            return True
    return False


def update_orientation(tx: Any, shape: tuple, dtype: Any, extra: dict, tree_args: tuple) -> int:
    """The sign of <gradient, update> on a first step: -1 an optimiser (updates are added), +1 a gradient
    transformation (updates point like the gradient), 0 unknown (e.g. no update on the first step)."""
    rng = np.random.default_rng(0)
    x = _probe_array(rng, shape, dtype, 1.0, 1.0)
    g = _probe_array(rng, shape, dtype, 1.0)
    more = {n: jnp.abs(_probe_array(rng, shape, dtype, 1.0)) + 0.5 for n in tree_args}

    def first(x, g, more):
        return tx.update(g, tx.init(x), x, **extra, **more)[0]

    u = np.asarray(jax.jit(first)(x, g, more), np.complex128)
    dot = float(np.real(np.vdot(np.asarray(g, np.complex128), u)))
    return int(np.sign(dot)) if np.isfinite(dot) else 0
