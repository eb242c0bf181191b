"""XLA's path: a rule's own JAX code run on its stepping stacks, which XLA compiles (the engine's fallback).

Each stack runs the rule once, vmapped over its stepping rows (`apply_all`), with the rule's small arithmetic
hoisted to once per pack where the rule allows (optim._engine.hoist); the step is then applied to each parameter's own
array, so XLA writes every new parameter in one fused loop. Always correct, for every rule, platform and
sharding: the reference the engine's strategies (optim._engine.strategies) are tested against, and what they fall back
to where they do not apply (a program lowered for another platform, a derivative through the step).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from . import hoist as hoist
from . import members as members
from .pack import assemble, pinned
from .stack import (GROUPED, STACK_MAX_SIZE, constrain, constrain_stack, put_rows, stack_arrays, take_rows,
                    traced_sharded)
from .strategies import Request, Result, Strategy, register, switch
from .._rules import split as split
from .._rules.protocol import apply_step, step_row

__all__ = ["XLAPath", "XLA", "rule_step", "mirrors"]


class XLAPath(Strategy):
    """XLA's path as the engine's fallback strategy (optim._engine.strategies): it runs every request."""

    name = "XLA's path"

    def enabled(self) -> bool:
        return True

    def wide(self, rule: Any) -> bool:
        return False

    def refuse(self, request: Request) -> str | None:
        return None

    def run(self, request: Request) -> Result:
        new_stored, new_params, written = rule_step(request)
        return Result(new_stored, new_params, written, mirrors(new_params, request.mirrors))


XLA = register(XLAPath(), fallback=True)
switch(hoist, "ENABLED")
switch(split, "ENABLED")


def rule_step(request: Request) -> tuple[list, list, dict]:
    """XLA's path for one rule's stepping stacks: per stack, the rule runs once on its stepping rows. Returns
    `(new stored stacks, new parameters per stack, {pack group: new arrays})`: the pack groups whole, so that this
    and a strategy's code return the same structure (optim._engine.kernel_choice needs it)."""
    lay, rule, stacks, packs, xs, gs = (request.layout, request.rule, request.stored, request.packs, request.params,
                                        request.grads)
    sizes, places = request.sizes, request.firsts
    xx = [stack_arrays(list(x)) for x in xs]
    # JAX's gradient w.r.t. a complex parameter is the conjugate of the descent direction (see _rules).
    dxs = [tuple(stack_arrays([_conj(d[t]) for d in g]) for t in range(len(g[0]))) for g in gs]
    # The rule's step per stack, in the state's stored form (packed small leaves: optim._engine.pack), its small
    # arithmetic run once per pack where the rule allows (optim._engine.hoist); in every stack of a rule that
    # XLA's path groups (optim._engine.group), the arithmetic that reads a parameter is done in its own array
    # (optim._engine.members): in its groups of large parameters, and in its stacks of small ones too (read
    # through their concatenation, AdamW's 34 stacked biases and norms of a GPT-2 were copied out of the kernel
    # that computes them, compiled for an H100). A large parameter alone in its stack too: read through its
    # stack of one (a reshape), XLA:CPU copied its new value out of the kernel that computes it instead of
    # writing it into its donated buffer.
    grouped = [((GROUPED, p.rule) in lay.wide or math.prod(p.shape) > STACK_MAX_SIZE and len(x) == 1)
               and all(isinstance(a, jax.core.Tracer) for a in x) and not traced_sharded(x[0])
               for p, x in zip(places, xs)]
    results, written, member_steps = members.evaluate(
        lambda xx: hoist.step_stacks(rule, stacks, request.rows, sizes, xx, dxs, packs), xx,
        [tuple(x) if g else None for g, x in zip(grouped, xs)])
    written = pinned(written, stacks, [p.state_place for p in places])
    new_stacks, new_params = [], []
    for stack, rows, us, n, x, (st, d), own, first in zip(stacks, request.rows, request.members, sizes, xs, results,
                                                          member_steps, places):
        new = put_rows(stack, rows, _same_dtypes(st, take_rows(stack, rows, n)), n)
        # A requested state sharding: XLA would propagate the new state's and the new parameters' shardings
        # from the arithmetic (replicated x - sharded step = sharded), so both are pinned, the state to its
        # requested sharding and the parameters to the sharding they had at setup (an all-gather per
        # parameter for ZeRO-1).
        if first.state_place is not None:
            new = constrain_stack(new, first.state_place, first.shape)
        new_stacks.append(new)
        # The step is applied to the parameter's own array (not a slice of the stack), so XLA fuses the
        # update into one kernel per leaf that writes the new parameter directly.
        new_x = [apply_step(xm, step_row(d, m) if own is None else own[m]) for m, xm in enumerate(x)]
        if first.state_place is not None:
            new_x = [constrain(v, lay.params[u].place) for v, u in zip(new_x, us)]
        new_params.append(tuple(new_x))
    return new_stacks, new_params, assemble(packs, written)


def mirrors(new_params: list, ms: list) -> list:
    """XLA's path's values for the tied positions `_core` returns when traced: per stack, per stepping member
    (its new value `new_params[i][m]`, the arrays at its tied positions `ms[i][m]`), the new value once per such
    position (XLA copies it into a buffer of its own). The kernel writes them itself, into those positions'
    donated buffers (optim/_engine/fused.cc): no copy after the step, and no fresh buffer whose pages are faulted in on
    every step."""
    return [tuple((x,) * len(m) for x, m in zip(new, mj)) for new, mj in zip(new_params, ms)]


def _same_dtypes(new: Any, old: Any) -> Any:
    """Keep each state leaf's dtype (a rule computing in float32 must not turn a bfloat16 state into float32,
    which would also retrace every step)."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        return new
    return jax.tree.map(lambda n, o: n.astype(o.dtype) if hasattr(o, "dtype") and n.dtype != o.dtype else n,
                        new, old)


def _conj(g: jax.Array) -> jax.Array:
    return jnp.conj(g) if jnp.iscomplexobj(g) else g
