"""`update(..., return_stats=True)`: gradient, update and parameter norms from the arrays the step already holds.

`row_squares` reduces each stepping stack (a few kernels per stack, not per parameter), `norms` gathers them into
a global and a per-parameter array inside the compiled step, and `as_dict` makes the returned dict.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .program import Program
from .layout import Layout
from .._rules.protocol import sum_squares, widened


def row_squares(g: jax.Array, x: jax.Array, new: jax.Array) -> jax.Array:
    """Per row (leading axis) of a stack: [Σ|g|², Σ|x - new|², Σ|new|²], accumulated in float32 (or wider),
    shape (rows, 3). Three plain reductions, not one variadic reduction (faster on XLA:CPU: `bench/NOTES.md`). `new` is
    read as stored (`widened`): a bfloat16 step below the parameter's resolution is no update."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    dims = tuple(range(1, x.ndim))
    return jnp.stack([sum_squares(a, dims).astype(jnp.float32)
                      for a in (g, x.astype(wide) - widened(new, wide), new)], axis=1)


def norms(prog: Program, squares: list, params: tuple, checks: tuple) -> tuple[jax.Array, jax.Array]:
    """The (grad, update, param) norms: globally (shape (3,)) and per parameter (shape (parameters, 3), in
    `layout.params` order), from the squared norms of the stepping stacks and the current values of the
    parameters that took no step. One array each, not three scalars per parameter: the program stays small."""
    lay = prog.layout
    graded = {u: a for a, u in enumerate(prog.graded)}
    checked = {i: k for k, i in enumerate(prog.check_pos)}
    stepping = set(prog.stepping)
    rows, order = list(squares), [u for j in range(len(prog.step_stacks)) for u in
                                  (prog.stepping[a] for a in prog.stack_plan[j].stepping)]
    idle = [u for u in range(len(lay.params)) if u not in stepping]
    if idle:
        xs = [params[graded[u]] if u in graded else checks[checked[lay.params[u].canonical]] for u in idle]
        norms = jnp.stack([sum_squares(x).astype(jnp.float32) for x in xs])
        rows.append(jnp.stack([jnp.zeros_like(norms), jnp.zeros_like(norms), norms], axis=1))
        order += idle
    per = jnp.concatenate(rows) if len(rows) > 1 else rows[0]
    where = np.argsort(np.asarray(order))
    if not (where == np.arange(len(where))).all():
        per = per[where]
    return jnp.sqrt(per.sum(0)), jnp.sqrt(per)


_STATS = ("grad_norm", "update_norm", "param_norm")


def as_dict(lay: Layout, norms: tuple) -> dict:
    """The stats dict from the program's norms (global, shape (3,); per parameter, shape (parameters, 3)).
    Eagerly, the per-parameter norms come to the host in one transfer (3 device scalars per parameter would
    cost XLA a compiled slice each, and compiling grows with the parameters: `bench/NOTES.md`); traced, they are
    slices that XLA drops unless the caller returns them."""
    totals, per = norms
    out: dict = {name: totals[k] for k, name in enumerate(_STATS)}
    rows = per if isinstance(per, jax.core.Tracer) else np.asarray(per)
    out["per_param"] = {lay.paths[p.canonical]: {name: rows[u, k] for k, name in enumerate(_STATS)}
                        for u, p in enumerate(lay.params)}
    return out
