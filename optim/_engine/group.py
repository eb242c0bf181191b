"""Multi-tensor groups on XLA's path: large parameters that share a rule, shape, dtype and placement are stacked,
so that a step's kernels do not grow with the number of parameters.

XLA's path keeps a large parameter alone in its stack (`optim._engine.stack.make_stacks`): on XLA:CPU stacking
costs a pass over memory. On a GPU or TPU the cost that grows with a model's leaves is the kernel launch: one
fused kernel per parameter for Adam's moments and another for its new value (optax has the same), where a
stack's rule runs as one. Compiled for an H100 without a GPU (`python -m bench.kernels`), Adam on 100 leaves of
400x400 is 93 kernels one parameter a stack and 10 grouped, with no copy and no temporary buffer: XLA reads the
gradients of a stack through their concatenation inside the moments' kernel and writes every new parameter
from one multi-output kernel.

Grouped are the rules whose new state does not read the parameter (`reads_parameter`: EMA's average of the new
parameter does), nor their step inside a conditional (`SkipNonFinite(AdamW)`). A step that reads it (AdamW's
decoupled weight decay) is computed per member where it does (optim._engine.members): read through the stack's
concatenation, XLA copied every new parameter out of the multi-output kernel instead of writing it into its
donated buffer (AdamW on 100 leaves of 400x400: 111 kernels, 100 of them copies, against 98 one parameter a
stack). Groups hold at most `GROUP_MAX_ELEMENTS` elements (and `STACK_MAX_MEMBERS` parameters), which bounds what
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

from .._core.cache import LRU
from .jaxpr_deps import output_deps

__all__ = ["MODE", "GROUP_MAX_ELEMENTS", "enabled", "groups", "reads_parameter"]

MODE = os.environ.get("OPTIM_GROUP", "1").strip().lower()
# 16M elements (64 MB of float32) a group: a GPT-2 layer's matrices, or 100 of 400x400, are one group.
GROUP_MAX_ELEMENTS = 1 << 24
_READS: LRU = LRU(256)


def enabled() -> bool:
    """Whether XLA's path groups large parameters in this process (see the module docstring)."""
    if MODE in ("0", "false", "no", "off"):
        return False
    if MODE == "all":
        return True
    from .fused import only_cpu     # noqa: PLC0415 (the backend question is asked once, where the kernel asks it)

    return not only_cpu()


def groups(rule: Any) -> bool:
    """Whether `rule`'s large parameters are stacked on XLA's path: grouping is on, and its new state does not
    read the parameter (its step may: optim._engine.members)."""
    return enabled() and not reads_parameter(rule)


def reads_parameter(rule: Any) -> bool:
    """Whether `rule`'s new state depends on the parameter's value, traced on a stack of two small float32
    parameters (a rule that cannot be traced so counts as reading it). Cached by the rule's structure:
    hyperparameters' values do not change what the step reads."""
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
    labels = [frozenset()] * n_state + [frozenset({"x"}), frozenset()]
    deps = output_deps(closed.jaxpr, labels)
    n_new = len(jax.tree.leaves(out[0]))     # the new states' leaves come first; the steps may read x
    # ... except inside a conditional (SkipNonFinite's), whose branches optim._engine.members cannot split
    return any("x" in d for d in deps[:n_new]) or (any("x" in d for d in deps[n_new:]) and _has_cond(closed.jaxpr))


def _has_cond(jaxpr: Any) -> bool:
    from jax.extend.core import jaxprs_in_params    # noqa: PLC0415

    return any(e.primitive.name == "cond" or any(_has_cond(j) for j in jaxprs_in_params(e.params))
               for e in jaxpr.eqns)
