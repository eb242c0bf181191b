"""Member-wise steps: in a stack of a rule that XLA's path groups (optim._engine.group: its groups of large
parameters, and its stacks of small ones), the arithmetic that reads the parameter is computed per member, in the
member's own array.

A grouped stack's rule runs vmapped over its members, on the parameters stacked by a concatenation. A rule whose
step reads the parameter (AdamW's decoupled weight decay `η (a + λ x)`) then reads every member through that
concatenation inside the kernel that writes the new parameters, and XLA, which shares a donated buffer with a
fused kernel's output only where the kernel reads it elementwise at the output's own index, copies every new
parameter out instead of writing it in place (compiled for an H100: AdamW on 100 leaves of 400x400, 100 copies).

`evaluate(fn, stacked, members)` traces `fn(stacked)` (the rule's step on its stacks) and replays it with every
elementwise equation that depends on a grouped stack's parameters computed once per member: the member's own
array, the other operands' row of it (a slice of a stacked state, which XLA reads in place). It is the same
arithmetic on the same values, rearranged. Two exceptions keep XLA writing in place:

- an elementwise equation that only a new state needs and that reads a stacked array no step needs (EMA's
  `δ a + (1 - δ) x_new`, with `a` its stacked average) is computed on the stack, reading the members' values
  through their concatenation: the new state is then written elementwise over its own donated buffer, and the
  members' new values are read from the buffers just written;
- a conditional on the platform (`jax.lax.platform_dependent`, `SkipNonFinite`'s skip) is replayed branch by
  branch, so that a step inside it is still computed per member.

A primitive with a member-wise form of its own (`MEMBERWISE`: a group's one-pass kernel) is given the members'
arrays. Where nothing depends on a parameter, `fn`'s program is kept as it is.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from .jaxpr_deps import output_deps
from .pack import is_packed

__all__ = ["evaluate", "needed", "ELEMENTWISE", "CALLS", "MEMBERWISE"]

# Primitives that compute each output element from the same element of each operand (0-d operands broadcast).
ELEMENTWISE = frozenset("""
    abs add and atan2 cbrt ceil clamp convert_element_type copy copy_p cos div eq erf erf_inv exp exp2 expm1
    floor ge gt imag integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow real
    reduce_precision rem round rsqrt select_n sign sin sqrt square sub tan tanh xor
""".split())
CALLS = ("pjit", "jit", "closed_call", "core_call")
# Primitives that have a member-wise form of their own (name -> `fn(ins, **params) -> outs`, `_Value`s in and
# out): a group's one-pass kernel (optim._engine.multitensor) reads each member's arrays where they are.
MEMBERWISE: dict[str, Callable] = {}


def evaluate(fn: Callable[[list], Any], stacked: list, members: list) -> tuple:
    """`fn(stacked)`, with the elementwise arithmetic on `stacked[k]` done per member where `members[k]` is not
    None (`stacked[k]` stacks the arrays `members[k]`). `fn` returns `(per stack (new state, step), new pack
    rows)`, as `optim._engine.hoist.step_stacks`. Returns `fn`'s
    result and, per stack, its members' steps (a list, member `m`'s step `step_row(step, m)` computed from
    parameter `m` alone), or None where the step is `fn`'s."""
    idx = [k for k, m in enumerate(members) if m is not None]
    if not idx:
        return (*fn(stacked), [None] * len(stacked))
    holder: list = []

    def traced(*xs: jax.Array) -> tuple[list, list]:
        args = list(stacked)
        for k, v in zip(idx, xs):
            args[k] = v
        results, written = fn(args)
        step_leaves, step_def = jax.tree_util.tree_flatten([d for _, d in results])
        rest, rest_def = jax.tree_util.tree_flatten(([st for st, _ in results], written), is_leaf=is_packed)
        arrays = [isinstance(a, jax.Array) for a in rest]
        holder[:] = [step_def, rest_def, arrays, [None if a else r for a, r in zip(arrays, rest)]]
        return step_leaves, [r for a, r in zip(arrays, rest) if a]

    closed = jax.make_jaxpr(traced)(*[stacked[k] for k in idx])
    step_def, rest_def, arrays, statics = holder
    n_steps = step_def.num_leaves
    deps = output_deps(closed.jaxpr, [frozenset({k}) for k in range(len(idx))])
    if not any(deps):
        return (*fn(stacked), [None] * len(stacked))
    outs = _eval(closed.jaxpr, closed.consts, [_Value(stacked[k], tuple(members[k])) for k in idx],
                 [k < n_steps for k in range(len(deps))])
    steps = [o.stacked() for o in outs[:n_steps]]
    it = iter(o.stacked() for o in outs[n_steps:])
    states, written = jax.tree_util.tree_unflatten(rest_def, [next(it) if a else s for a, s in zip(arrays, statics)])
    # Each member's step from its own values: a row of the stacked step would read all of them (XLA may fold a
    # slice of a concatenation, but need not).
    where = jax.tree_util.tree_unflatten(step_def, list(range(n_steps)))
    rows = [None if m is None else [jax.tree.map(lambda i: outs[i].member(r), where[k]) for r in range(len(m))]
            for k, m in enumerate(members)]
    return [(st, d) for st, d in zip(states, jax.tree_util.tree_unflatten(step_def, steps))], written, rows


class _Value:
    """A value of the traced step: stacked (its traced shape), per member, or both (each made from the other on
    first use: a stack of the members, or a member's row of the stack)."""

    __slots__ = ("_stacked", "members", "shape")

    def __init__(self, stacked: Any, members: tuple | None = None, shape: tuple | None = None):
        self._stacked, self.members = stacked, members
        self.shape = tuple(shape if shape is not None else jnp.shape(stacked))

    def stacked(self) -> Any:
        if self._stacked is None:
            self._stacked = jnp.stack(self.members)
        return self._stacked

    def member(self, m: int) -> Any:
        """Member `m`'s value for an elementwise equation (a 0-d value as it is)."""
        if self.members is not None:
            return self.members[m]
        a = self.stacked()
        return a if jnp.ndim(a) == 0 else a[m]


def _eval(jaxpr: Any, consts: list, args: list, steps: list) -> list:
    """Evaluate `jaxpr` on `_Value`s, binding each primitive as `jax.core.eval_jaxpr` does; an elementwise
    equation reading a value per member is computed per member (see the module docstring), except one that
    only a new state needs (`steps[i]`: whether output `i` is a step) and that reads a stacked array: that one
    is computed on the stack, reading the members through their concatenation, so that the new state is
    written elementwise into its own (donated) stacked buffer."""
    env: dict = {}
    for_steps = needed(jaxpr, steps)
    platform: dict = {}     # the index of a platform-dependent conditional -> its platforms per branch
    # Broadcasts of one number (a gate `where_leading` spreads over a stack): the same in every row, so not a
    # stacked array that makes an equation state-only.
    uniform: set = set()

    def read(v: Any) -> _Value:
        return _Value(v.val) if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = _Value(c)
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        per = {(len(a.members), a.shape) for a in ins if a.members is not None}
        name = e.primitive.name
        if per and name == "cond" and not isinstance(e.invars[0], Literal) and e.invars[0] in platform:
            shapes = {want: n for n, want in per}
            for v, o in zip(e.outvars, _eval_platform_cond(e, platform[e.invars[0]], ins[1:], shapes,
                                                           [v in for_steps for v in e.outvars])):
                env[v] = o
            continue
        if per and name in MEMBERWISE:
            for v, o in zip(e.outvars, MEMBERWISE[name](ins, **e.params)):
                env[v] = o
            continue
        if len(per) == 1:
            n, want = per.pop()
            state_only = not any(v in for_steps for v in e.outvars) and any(
                a.members is None and a.shape == want and v not in for_steps and v not in uniform
                for a, v in zip(ins, e.invars))
            if name in ELEMENTWISE and not state_only and all(a.shape in ((), want) for a in ins) and all(
                    tuple(o.aval.shape) == want for o in e.outvars):
                rows = []
                for m in range(n):
                    out = e.primitive.bind(*[a.member(m) for a in ins], **e.params)
                    rows.append(out if e.primitive.multiple_results else [out])
                for k, v in enumerate(e.outvars):
                    env[v] = _Value(None, tuple(r[k] for r in rows), want)
                continue
            if name in CALLS and "jaxpr" in e.params:
                inner = e.params["jaxpr"]
                inner_steps = [v in for_steps for v in e.outvars]
                for v, o in zip(e.outvars, _eval(inner.jaxpr, inner.consts, ins, inner_steps)):
                    env[v] = o
                continue
        params = e.primitive.get_bind_params(e.params)     # (older JAX: (subfuns, params))
        subfuns, params = params if isinstance(params, tuple) else ((), params)
        with e.ctx.manager:
            outs = e.primitive.bind(*subfuns, *[a.stacked() for a in ins], **params)
        outs = outs if e.primitive.multiple_results else [outs]
        for v, o in zip(e.outvars, outs):
            env[v] = _Value(o)
        if name == "platform_index":
            platform[e.outvars[0]] = e.params["platforms"]
        if name == "broadcast_in_dim" and math.prod(ins[0].shape) == 1:
            uniform.add(e.outvars[0])
    return [read(v) for v in jaxpr.outvars]


def _eval_platform_cond(e: Any, platforms: tuple, ins: list, shapes: dict, steps: list) -> list:
    """A conditional on the platform (`jax.lax.platform_dependent`: `SkipNonFinite`'s skip, a conditional on
    CPU and selects elsewhere) evaluated branch by branch like the rest (`_eval`), so that a grouped step
    inside it is still computed per member. Each branch returns its steps of a stack's shape (`shapes`: stacked
    shape -> members) per member and everything else stacked; the conditional is made again, and lowering keeps
    the one branch of the target."""
    def per_member(v: Any, step: bool) -> int:
        return shapes.get(tuple(v.aval.shape), 0) if step else 0

    def branch(b: Any) -> Callable[[], list]:
        def run() -> list:
            flat = []
            for o, v, s in zip(_eval(b.jaxpr, b.consts, ins, steps), e.outvars, steps):
                n = per_member(v, s)
                flat.extend([o.member(m) for m in range(n)] if n else [o.stacked()])
            return flat
        return run

    kinds: dict = {}
    for b, names in zip(e.params["branches"], platforms):
        for p in names or ("default",):
            kinds[p] = branch(b)
    flat = jax.lax.platform_dependent(**kinds)
    out, i = [], 0
    for v, s in zip(e.outvars, steps):
        n = per_member(v, s)
        if n:
            out.append(_Value(None, tuple(flat[i:i + n]), tuple(v.aval.shape)))
            i += n
        else:
            out.append(_Value(flat[i]))
            i += 1
    return out


def needed(jaxpr: Any, wanted: list) -> set:
    """The variables of `jaxpr` that the outputs marked in `wanted` are computed from."""
    need = {v for v, w in zip(jaxpr.outvars, wanted) if w and not isinstance(v, Literal)}
    for e in reversed(jaxpr.eqns):
        if any(v in need for v in e.outvars):
            need.update(v for v in e.invars if not isinstance(v, Literal))
    return need
