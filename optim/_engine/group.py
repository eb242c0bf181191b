"""Multi-tensor groups on XLA's path: large parameters that share a rule, shape, dtype and placement are stacked,
so that a step's kernels do not grow with the number of parameters.

XLA's path keeps a large parameter alone in its stack (`optim._engine.stack.make_stacks`): on XLA:CPU stacking
costs a pass over memory. On a GPU or TPU the cost that grows with a model's leaves is the kernel launch: one
fused kernel per parameter for Adam's moments and another for its new value (optax has the same), where a
stack's rule runs as one. Compiled for an H100 without a GPU (`python -m bench.kernels`), Adam on 100 leaves of
400x400 is 93 kernels one parameter a stack and 10 grouped, with no copy and no temporary buffer: XLA reads the
gradients of a stack through their concatenation inside the moments' kernel and writes every new parameter
from one multi-output kernel.

Grouped are the rules that read the parameter, if at all, through elementwise arithmetic (`reads_parameter`):
AdamW's decoupled weight decay, EMA's average of the new parameter, either inside `SkipNonFinite`'s
platform-dependent skip. That arithmetic is computed per member, in the member's own array
(optim._engine.members): read through the stack's concatenation, XLA copied every new parameter out of the
multi-output kernel instead of writing it into its donated buffer (`bench/NOTES.md`). A rule whose new state
reads the parameter otherwise (a norm, a reshape: `OPAQUE_READ`) or is read by its step (Adam's moments after
`WeightDecay`), or that reads it inside a conditional of its own, keeps one parameter a stack. Groups hold at
most `GROUP_MAX_ELEMENTS` elements and `STACK_MAX_MEMBERS` parameters (`optim._engine.stack`), which bounds what
XLA may materialise for one.

`OPTIM_GROUP` (read at import; `MODE` can also be set) says where: unset or `1`, in a process with a GPU or TPU
backend (the CPU has optim's fused kernel, which stacks its own rules, `optim._engine.fused`); `0`, nowhere;
`all`, also on the CPU (the tests, and the deviceless kernel count, which sets up on the CPU).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from jax.extend.core import Literal

from .._base.cache import LRU
from .backend import only_cpu
from .members import CALLS, ELEMENTWISE, needed

__all__ = ["MODE", "enabled", "groups", "reads_parameter"]

MODE = os.environ.get("OPTIM_GROUP", "1").strip().lower()
_READS: LRU = LRU(256)


def enabled() -> bool:
    """Whether XLA's path groups large parameters in this process (see the module docstring)."""
    if MODE in ("0", "false", "no", "off"):
        return False
    if MODE == "all":
        return True
    return not only_cpu()


def groups(rule: Any) -> bool:
    """Whether `rule`'s large parameters are stacked on XLA's path: grouping is on, and its new state reads the
    parameter, if at all, through elementwise arithmetic (its step may read it in any way:
    optim._engine.members)."""
    return enabled() and not reads_parameter(rule)


def reads_parameter(rule: Any) -> bool:
    """Whether `rule`'s new state depends on the parameter's value other than elementwise or is read by its step,
    or its step reads the parameter inside a conditional that is not the platform's. Traced on a stack of two
    small float32 parameters (a rule that cannot be traced so counts as reading it); cached by the rule's
    structure: hyperparameters' values do not change what the step reads."""
    treedef = jax.tree_util.tree_structure(rule)
    found = _READS.get(treedef)
    if found is None:
        found = _READS[treedef] = _traced_reads(rule)
    return found


def _traced_reads(rule: Any) -> bool:
    from .._rules.protocol import apply_all   # noqa: PLC0415 (the rules layer runs the rule; the engine asks)
    from .._rules.schedules import resolve    # noqa: PLC0415

    rule = resolve(rule, jnp.zeros((), jnp.int32))     # as update runs it: its schedules' values at a step
    x = jnp.zeros((2, 4, 6), jnp.float32)     # two 4x6 matrices: rules of matrices (Muon) trace too
    try:
        state = jax.eval_shape(lambda a: jax.vmap(rule.init)(a), x)
        closed, out = jax.make_jaxpr(lambda s, a, g: apply_all(rule, [s], [a], [(g,)]), return_shape=True)(
            state, x, x)
    except Exception:     # noqa: BLE001 (a rule that needs other shapes: not grouped, as before)
        return True
    n_state = len(jax.tree.leaves(state))
    try:
        reads = _reads(closed.jaxpr, [0] * n_state + [ELEMENTWISE_READ, 0])
    except _InCond:
        return True
    n_new = len(jax.tree.leaves(out[0]))     # the new states' leaves come first; the steps may read x
    # A new state that reads x elementwise is computed per member where the step reads it too (Adam's moments
    # after `WeightDecay`): stacked again for the state, a temporary and copies; such rules stay alone.
    outs = closed.jaxpr.outvars
    stepped = needed(closed.jaxpr, [False] * n_new + [True] * (len(outs) - n_new))
    return any(r == OPAQUE_READ or (r and not isinstance(v, Literal) and v in stepped)
               for r, v in zip(reads[:n_new], outs))


# How a value of the traced step depends on the parameter: not, through elementwise arithmetic only (which
# optim._engine.members computes per member), or through anything else (a reduction, a reshape, ...).
ELEMENTWISE_READ, OPAQUE_READ = 1, 2


class _InCond(Exception):
    """The parameter is read inside a conditional that is not the platform's (`jax.lax.platform_dependent`)."""


def _reads(jaxpr: Any, ins: list) -> list:
    """For each output of `jaxpr`, how it depends on the parameter (`ins`: how each input does), following
    calls and platform-dependent conditionals; raises `_InCond` where another conditional reads it."""

    env: dict = dict(zip(jaxpr.invars, ins))
    platform: dict = {}
    for e in jaxpr.eqns:
        got = [0 if isinstance(v, Literal) else env.get(v, 0) for v in e.invars]
        name = e.primitive.name
        if name == "platform_index":
            platform[e.outvars[0]] = e.params["platforms"]
        if not any(got):
            continue
        if name == "cond":
            if isinstance(e.invars[0], Literal) or e.invars[0] not in platform:
                raise _InCond
            # Groups are formed where there is a GPU or TPU: the CPU's branch does not count.
            outs = [max(rs) for rs in zip(*[_reads(b.jaxpr, got[1:]) for b, on in zip(
                e.params["branches"], platform[e.invars[0]]) if on != ("cpu",)])]
        elif name in CALLS and "jaxpr" in e.params:
            outs = _reads(e.params["jaxpr"].jaxpr, got)
        elif name in ELEMENTWISE:
            outs = [max(got)] * len(e.outvars)
        else:
            outs = [OPAQUE_READ] * len(e.outvars)
        env.update(zip(e.outvars, outs))
    return [0 if isinstance(v, Literal) else env.get(v, 0) for v in jaxpr.outvars]
