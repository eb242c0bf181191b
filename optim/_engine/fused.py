"""The fused CPU step: Adam, AdamW, NAdam, RAdam, AdaBelief, AMSGrad, ADOPT, RMSProp, Lion, Momentum and
Descent in one pass over each parameter, also wrapped in SkipNonFinite, SkipLargeUpdates and EMA, or chained
after ClipGlobalNorm and before a Scale (the kinds: optim._engine.fused_kinds).

XLA:CPU compiles Adam's update into three loops over each parameter (the first moment, the second, then the
step, which re-reads both), and cannot fuse them into one (there is no multi-output loop fusion on CPU). The step
is memory-bound, so three passes cost about twice what one does. `optim/_engine/fused.cc` is that one pass, an XLA FFI
custom call: per element it reads the parameter, its gradient and its state and writes the new ones in place
(every state and parameter input is aliased to its output; with `donate=True`, or buffers XLA owns inside a
jit, nothing is copied), split into chunks on XLA's intra-op thread pool. Its element loops are compiled for
the baseline x86-64, for AVX2 and for AVX-512 (the best the CPU has; without AVX2 bfloat16 moments are
compute-bound, and AVX-512 narrows float32 to bfloat16 in one instruction).

It is one of the engine's strategies (`Kernel`, registered with optim._engine.strategies): `update` uses it for a rule
whose own class declares one of those formulas (`Rule._formula`), alone or as a chain `[ClipGlobalNorm,] rule
[, Scale]` (the clip factor scales the gradient, the Scale the step, inside the kernel), inside any nesting of
`SkipNonFinite`, `SkipLargeUpdates` and at most one `EMA` (`_Plan`), on parameters of float32 or bfloat16
(states float32 or bfloat16; an EMA's average float32), one gradient tree, scalar hyperparameters, and
parameters that are not sharded over several devices (a sharded array would be gathered to run a custom call:
XLA's own path is kept). It groups the stepping members of a rule's stacks by shape, at most `MAX_MEMBERS` per
call. The rule's hyperparameters and Adam's bias corrections are computed by XLA and passed as one small
`(members, 16)` array, with the clip factor, the Scale's factor, the EMA's decay and the gate's flag.

The gating wrappers run their own code (`apply_tree`) around a stand-in rule without state (`_gates`): that
gives their flag and their own states (counters, norm statistics) exactly as XLA's path computes them. A member
whose flag is false is not touched by the kernel (in place nothing is written; beside, its old values are
copied) and its packed bias-correction powers keep their values. SkipNonFinite's question, whether all the
rule's gradients are finite, is the clip's norm where a chain has one and it is finite, else a second custom call
of the same library (`optim_finite`: XLA:CPU writes a bool per element before reducing them, several times the
time of reading the gradients: `bench/NOTES.md`). An EMA's average is one more stream in the same pass. bfloat16
moments: the step is computed from the new float32 moments before they are rounded for storage, as XLA's path does.

CPU only, chosen at lowering (optim._engine.kernel_choice): a program lowered for GPU or TPU, or exported, runs
XLA's path (which fuses there) and only a CPU lowering runs the kernel.

The kernel is compiled at install (`setup.py`) and optional: without it (no compiler at install), or with the
environment variable `OPTIM_FUSED=0` (read at import; `optim._engine.fused.ENABLED` can also be set), `update` runs
the rules' JAX code, the reference the tests compare the kernel with.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import fused_kinds as kinds, fused_load, strategies, xla as xla
from .kernel_choice import kernel_or_xla
from .pack import PackRows, assemble, is_packed
from .stack import KERNEL_FLOATS, row_index, traced_sharded
from .._rules.average import EMA
from .._rules.protocol import Gated, apply_all, formula_of
from .._rules.quantized import Quantized
from .._rules.transforms import Scale
from .backend import only_cpu
from .strategies import Request, Result, Strategy, register, switch
from .._rules.wrappers import (OptimiserChain, SkipLargeUpdates, SkipLargeUpdatesState, SkipNonFinite,
                               SkipNonFiniteState, joint_norm)

__all__ = ["ENABLED", "AVAILABLE", "KERNEL", "Kernel", "only_cpu", "kernel_calls"]

ENABLED = os.environ.get("OPTIM_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")
MAX_MEMBERS = 64          # members per call (the prototype: XLA's compile time grows beyond)
_log = logging.getLogger("optim")

AVAILABLE, WHY = fused_load.load()
_log.debug("%s%s", WHY, "" if AVAILABLE else "; update runs the pure-JAX path")




# The wrappers that gate the whole step on a flag computed across the parameters, and their states' types.
_GATES = {SkipNonFinite: SkipNonFiniteState, SkipLargeUpdates: SkipLargeUpdatesState}


class _Plan(NamedTuple):
    """A rule as the kernel runs it: gating wrappers (`SkipNonFinite`, `SkipLargeUpdates`) and at most one `EMA`
    around (in any order) a kernel rule, alone or as a chain `[ClipGlobalNorm,] rule [, Scale]`."""

    gates: tuple          # the gating wrappers, outermost first
    ema: Any              # the EMA, or None
    clip: Any             # the chain's ClipGlobalNorm, or None
    core: Any             # the rule with a kernel formula
    scale: Any            # the chain's last stage, a Scale, or None
    walk: tuple           # the wrappers' kinds from the outside in: "gate" or "ema" (each state is (inner, own))
    at: int | None        # the core's stage in the chain (None: no chain)


def _peel(rule: Any) -> _Plan | None:
    """`rule` as the kernel runs it (see `_Plan`), or None where it cannot. Wrappers are matched by their exact
    class (a subclass may change what they compute), as formulas are (`formula_of`)."""
    gates, ema, walk = [], None, []
    while True:
        if type(rule) in _GATES:
            gates.append(rule)
            walk.append("gate")
        elif type(rule) is EMA and ema is None:
            ema = rule
            walk.append("ema")
        else:
            break
        rule = rule.rule
    clip = scale = at = None
    if type(rule) is OptimiserChain:
        stages = rule.rules
        first = 1 if stages and formula_of(stages[0]) == "clip" else 0
        last = len(stages) - 1 if len(stages) > first + 1 and type(stages[-1]) is Scale else len(stages)
        if last - first != 1:
            return None
        clip, scale, at = stages[0] if first else None, stages[-1] if last < len(stages) else None, first
        rule = stages[first]
    if kinds.kind_of(rule) is None:
        return None
    return _Plan(tuple(gates), ema, clip, rule, scale, tuple(walk), at)


def _open(plan: _Plan, tree: Any) -> tuple[Any, Any, list]:
    """A stack's state tree (stored form) as `(the core rule's state, the EMA's average or None, [each gate's own
    state])`."""
    avg, extras = None, []
    for w in plan.walk:
        if w == "gate":
            extras.append(tree[1])
        else:
            avg = tree[1]
        tree = tree[0]
    return (tree if plan.at is None else tree[plan.at]), avg, extras


def _close(plan: _Plan, tree: Any, core: Any, avg: Any, extras: list) -> Any:
    """`tree` (a stack's state, as `_open` read it) with its parts replaced."""
    def go(k: int, t: Any, e: int) -> Any:
        if k == len(plan.walk):
            return core if plan.at is None else tuple(core if s == plan.at else v for s, v in enumerate(t))
        if plan.walk[k] == "gate":
            return type(t)(go(k + 1, t[0], e + 1), extras[e])
        return type(t)(go(k + 1, t[0], e), avg)
    return go(0, tree, 0)


class _Inside:
    """What the gating wrappers wrap, as the kernel sees them: no state and a placeholder step. Run by the
    wrappers' own code (`apply_tree`) for their flags and their states' new values (`_gates`); the step itself is
    the kernel's."""

    def init(self, x):
        return None

    def apply(self, state, x, dx, *dxs):
        return None, jnp.zeros((), jnp.float32)

    def apply_tree(self, states, xs, dxs):
        return [None] * len(xs), [jnp.zeros((), jnp.float32)] * len(xs)


def _gates(plan: _Plan, extras: list, rows: list, members: list, xs: list, sums: list, packs: tuple,
           norm: jax.Array | None = None):
    """The gating wrappers' own code on the stepping members (`members`: `(stack, member, row)`) around a rule
    that has no state (`_Inside`): per member its flag (a bool array: the wrappers' flags together), and their
    new states, written as pack rows (`PackRows`) and, for a state leaf that is not packed, in the new `extras`
    (per stack each gate's own state, stored form).

    The wrappers see each stack's stepping rows as one entry when they only ask whether the gradients are finite
    (`SkipNonFinite`: a few operations per stack), else each member as an entry, a stack of one (a norm over
    stacked gradients would copy them). `norm`: the joint norm of the same gradients where the chain clips them
    (computed for its factor anyway)."""
    rule: Any = _Inside()
    for g in reversed(plan.gates):
        g = copy.copy(g)
        object.__setattr__(g, "rule", rule)
        rule = g

    def take(a: Any, i: int, rs: tuple) -> Any:
        if is_packed(a):
            return packs[a.group][a.leaf][row_index(tuple(a.start + r for r in rs))]
        return a[row_index(rs)]

    if all(type(g) is SkipNonFinite for g in plan.gates):
        # SkipNonFinite reads only whether the gradients are all finite: one pass of the kernel's over them all
        # (XLA:CPU writes a bool per element first: several times the time of reading them), none where a clip's
        # norm over them is finite (then so is every gradient; an Inf or NaN norm, from a gradient that is not
        # finite or a finite one whose square overflows, asks the check: the flag is exactly SkipNonFinite's).
        # Each stack's gradients are given to the wrappers as a number that is finite where they all are.
        finite = jax.ffi.ffi_call(fused_load.FINITE, jax.ShapeDtypeStruct((), jnp.float32), vmap_method="sequential")
        grads = [d for i, m, _ in members for d in sums[i][m]]
        flag = (finite(*grads) if norm is None else
                jax.lax.cond(jnp.isfinite(norm), lambda: jnp.float32(1), lambda: finite(*grads)))
        proxy = jnp.where(flag > 0, jnp.float32(0), jnp.float32(jnp.nan)).reshape(1)
        entries = [(i, [(m, r) for m, r in enumerate(rows[i])]) for i in range(len(rows)) if rows[i]]
        dxs = [tuple(proxy for _ in sums[i][0]) for i, _ in entries]
    else:
        entries = [(i, [(m, r)]) for i, m, r in members]
        dxs = [tuple(d[None] for d in sums[i][ms[0][0]]) for i, ms in entries]
    states = []
    for i, ms in entries:
        st, rs = None, tuple(r for _, r in ms)
        for g, e in zip(reversed(plan.gates), reversed(extras[i])):
            st = _GATES[type(g)](st, jax.tree.map(lambda a: take(a, i, rs), e, is_leaf=is_packed))
        states.append(st)
    new, steps = apply_all(rule, states, [xs[i][ms[0][0]][None] for i, ms in entries], dxs)
    oks = []
    for (_, ms), step in zip(entries, steps):
        ok = None
        while isinstance(step, Gated):
            ok = step.ok if ok is None else ok & step.ok
            step = step.step
        ok = jnp.broadcast_to(jnp.reshape(ok, (-1,)), (len(ms),))
        oks += [ok[k] for k in range(len(ms))]
    # Each stack's new rows, per gate, per leaf (entries are in stack order, and rows in order within a stack).
    by_stack: dict = {}
    for (i, _), st in zip(entries, new):
        for k in range(len(plan.gates)):
            by_stack.setdefault((i, k), []).append(st[1])
            st = st[0]
    pack_rows, new_extras = [], [list(e) for e in extras]
    for (i, k), got in by_stack.items():
        leaves, treedef = jax.tree_util.tree_flatten(extras[i][k], is_leaf=is_packed)
        cols = zip(*[jax.tree.leaves(t) for t in got])
        out = []
        for a, col in zip(leaves, cols):
            value = jnp.concatenate(col) if len(col) > 1 else col[0]
            value = value.astype(jnp.dtype(packs[a.group][a.leaf].dtype if is_packed(a) else a.dtype))
            if is_packed(a):
                pack_rows.append(PackRows(group=a.group, leaf=a.leaf, rows=tuple(a.start + r for r in rows[i]),
                                          values=value))
                out.append(a)
            else:
                out.append(jnp.asarray(a).at[row_index(tuple(rows[i]))].set(value))
        new_extras[i][k] = treedef.unflatten(out)
    return oks, pack_rows, new_extras


def _shape_of(a: Any) -> str:
    return f"{jnp.dtype(a.dtype).name}{list(np.shape(a))}" if hasattr(a, "shape") else type(a).__name__


def _at(path: tuple) -> str:
    return f" {jax.tree_util.keystr(path)}" if path else ""


def _core_state(plan: _Plan, kind: int, tree: Any) -> str | None:
    """Why a stack's stored state tree is not what the kernel reads for `plan` (None: it is): the nesting of the
    plan's wrappers and chain, then the core rule's `ARRAYS[kind]` arrays followed by its `PACKED[kind]` packed
    small leaves (optim._engine.fused_kinds). A small leaf is packed where the state declares it
    (optim._engine.pack); one stored as it is (a stack with batch axes, an init that does not trace abstractly)
    sends the rule to XLA's path."""
    try:
        core = _open(plan, tree)[0]
    except (TypeError, IndexError, KeyError):
        return ("a state tree that is not the nesting of the rule's wrappers and chain (its structure is not "
                "the rule's init's)")
    got = jax.tree_util.tree_flatten_with_path(core, is_leaf=is_packed)[0]
    arrays, packed = kinds.ARRAYS[kind], kinds.PACKED[kind]
    name = type(plan.core).__name__
    if len(got) != arrays + packed:
        return (f"{name}'s state has {len(got)} leaves where the kernel reads {arrays} arrays and {packed} packed "
                "small leaves")
    for j, (path, a) in enumerate(got):
        if j < arrays and is_packed(a):
            return f"{name}'s state leaf{_at(path)} is packed where the kernel reads an array"
        if j >= arrays and not is_packed(a):
            return (f"{name}'s small state leaf{_at(path)} is not packed (it is {_shape_of(a)}; a "
                    "stack stored as it is: batch axes, or a state whose small leaves are not declared)")
    return None


def _single_device(place: Any) -> bool:
    return place is None or len(getattr(place, "device_set", ())) == 1


class Kernel(Strategy):
    """The fused CPU kernel as one of the engine's strategies (optim._engine.strategies)."""

    name = "optim's fused CPU kernel"

    def enabled(self) -> bool:
        return ENABLED and AVAILABLE

    def wide(self, rule: Any) -> bool:
        # Only where it will run: a process with another backend keeps XLA's stacking (one parameter a stack).
        # Nor with quantised moments, which it refuses: XLA:CPU steps a stack of them several times slower than its
        # members one by one, and OnePass (optim._engine.onepass) takes a parameter only alone in its stack.
        plan = _peel(rule)
        return only_cpu() and plan is not None and not any(isinstance(v, Quantized) for v in vars(plan.core).values())

    def refuse(self, request: Request) -> str | None:
        """Why the kernel cannot run `request` (None: it can): its rule, stacks, dtypes and placements."""
        rule, firsts, stored, sizes, n_trees = (request.rule, request.firsts, request.stored, request.sizes,
                                                request.n_trees)
        if not self.enabled():
            return "turned off (OPTIM_FUSED=0)" if AVAILABLE else WHY
        if n_trees != 1:
            return f"{n_trees} gradient trees"
        plan = _peel(rule)
        if plan is None:
            return ("it has no kernel for this rule (a kernel formula, alone or in a chain [ClipGlobalNorm,] rule "
                    "[, Scale], inside SkipNonFinite, SkipLargeUpdates or one EMA)")
        kind = kinds.kind_of(plan.core)
        try:
            hypers = jax.tree.leaves(rule)
            if any(jnp.ndim(h) != 0 or isinstance(h, jax.core.Tracer) and traced_sharded(h) for h in hypers):
                return "a hyperparameter is not a scalar (or is sharded)"
        except TypeError:
            return "a hyperparameter is not a number"
        for p, tree, n in zip(firsts, stored, sizes):
            if jnp.dtype(p.dtype) not in KERNEL_FLOATS:
                return f"a parameter of dtype {jnp.dtype(p.dtype).name}"
            if p.state_place is not None or not _single_device(p.place):
                return "a sharded parameter or state (a custom call would gather it)"
            why = _core_state(plan, kind, tree)
            if why is not None:
                return why
            core, avg, extras = _open(plan, tree)
            leaves = jax.tree_util.tree_flatten(core, is_leaf=is_packed)[0]
            wide = [a for a in leaves if not is_packed(a)]
            if plan.ema is not None:
                if is_packed(avg) or not hasattr(avg, "dtype") or jnp.dtype(avg.dtype) != jnp.float32:
                    return "an EMA average that is not a float32 array"
                wide = wide + [avg]
            if kind == kinds.CENTRED_RMSPROP and any(jnp.dtype(a.dtype) != jnp.float32 for a in wide[:2]):
                # stored in bfloat16, centred RMSProp's `quad` holds the variance (optim._rules.adaptive)
                return "centred RMSProp with a moment stored in bfloat16 (its state is the variance)"
            # The loops are compiled for two state dtypes: a rule's third array (AMSGrad's) has its second's.
            for j, a in enumerate(wide):
                if tuple(np.shape(a)) != (n, *p.shape) or jnp.dtype(a.dtype) not in KERNEL_FLOATS or (
                        2 <= j < kinds.ARRAYS[kind] and a.dtype != wide[1].dtype):
                    return "a state array of another shape or dtype"
                if traced_sharded(a):
                    return "a sharded state array"
            for gate, e in zip(plan.gates, extras):   # their own states: numbers per parameter (packed, or a stack)
                for path, a in jax.tree_util.tree_flatten_with_path(e, is_leaf=is_packed)[0]:
                    if not is_packed(a) and (not hasattr(a, "shape") or np.shape(a)[:1] != (n,)
                                             or np.size(a) > 8 * n or traced_sharded(a)):
                        return (f"{type(gate).__name__}'s own state leaf{_at(path)} is not a few numbers per "
                                f"parameter (it is {_shape_of(a)} for a stack of {n})")
        return None

    def run(self, request: Request) -> Result:
        """The kernel's step of `request` where the program is lowered for CPU, XLA's path elsewhere
        (optim._engine.kernel_choice). The kernel reads each member's gradient parts (it sums a tie's two parts in
        its own pass), XLA's path the sums. The hyperparameters are operands, as they may be what is
        differentiated (a meta-gradient through `update` differentiates XLA's path)."""
        hypers, treedef = jax.tree_util.tree_flatten(request.rule)
        # XLA's code, kept by the traced program to lower for other platforms: it closes over the request's static
        # fields only (its arrays are operands), so the traced program keeps no tracer or array alive.
        static = request._replace(rule=None, stored=None, packs=None, params=None, grads=None, parts=None,
                                  mirrors=None)

        def on_xla(hypers, stored, packs, xs, gs, parts, ms):
            # Elsewhere the strategies after this one (a GPU's one-pass group kernel, optim._engine.multitensor),
            # else XLA's path.
            return tuple(strategies.run(static._replace(rule=treedef.unflatten(hypers), stored=stored, packs=packs,
                                                     params=xs, grads=gs, parts=parts, mirrors=ms), after=KERNEL))

        def on_kernel(hypers, stored, packs, xs, gs, parts, ms):
            new_stored, new_params, written, new_ms = kernel_calls(
                treedef.unflatten(hypers), stored, static.rows, static.sizes, xs, parts, packs, static.in_place, ms,
                gs)
            return new_stored, new_params, assemble(packs, written), new_ms

        return Result(*kernel_or_xla(on_kernel, on_xla, hypers, request.stored, request.packs, request.params,
                                     request.grads, request.parts, request.mirrors))


KERNEL = register(Kernel())
switch(sys.modules[__name__], "ENABLED")


def kernel_calls(rule: Any, stored: list, rows: list, sizes: list, xs: list, gs: list, packs: tuple,
                 in_place: bool, mirrors: list, sums: list | None = None):
    """`rule`'s step of these stacks as kernel calls, at most `MAX_MEMBERS` members each (see `Kernel.refuse`).
    Per stack `i`: `stored[i]` its stored state tree, `rows[i]` its stepping rows, `sizes[i]` its size, `xs[i]`
    / `gs[i]` the stepping rows' parameters and gradients (per member a tuple of 1 or 2 arrays that the kernel
    sums: a tied parameter's gradient parts), `sums[i]` per member its summed gradient per tree (what the gating
    wrappers' own code reads; default: the parts summed), and `mirrors[i]` per member a tuple of arrays like it
    (the model's other positions of a tie) that get its new value. `in_place`: alias the new state, parameters
    and mirrors to the old (updated in place when the caller donates them; else XLA copies them first), or write
    them beside the old (for a call that keeps its inputs). Returns `(new stored trees, new parameters per stack,
    new pack rows [(group, leaf, rows of the pack, values)], new mirrors per stack)`, as XLA's path does."""
    plan = _peel(rule)
    kind = kinds.kind_of(plan.core)
    if sums is None:
        sums = [tuple((sum(g[1:], g[0]),) for g in member) for member in gs]
    members = [(i, m, r) for i in range(len(stored)) for m, r in enumerate(rows[i])]
    scale, norm = jnp.ones((), jnp.float32), None
    if plan.clip is not None:     # ClipGlobalNorm's factor over all these members, in float32 (see its `factor`)
        summed = [sum(g[1:], g[0]) for member in gs for g in member]
        norm = joint_norm(summed)      # also SkipNonFinite's answer where it is finite (see `_gates`)
        scale = plan.clip.factor(summed, norm).astype(jnp.float32)
    opened = [_open(plan, t) for t in stored]
    extras = [o[2] for o in opened]
    oks, pack_rows = {}, []
    if plan.gates:      # the wrappers' flags and new states, by their own code (see `_gates`)
        flags, pack_rows, extras = _gates(plan, extras, rows, members, xs, sums, packs, norm)
        oks = {(i, m): ok for (i, m, _), ok in zip(members, flags)}
    flat = [jax.tree_util.tree_flatten(o[0], is_leaf=is_packed) for o in opened]
    wides = [[a for a in leaves if not is_packed(a)] + ([o[1]] if plan.ema is not None else [])
             for (leaves, _), o in zip(flat, opened)]
    # Members grouped by parameter shape, dtype and state dtypes: one call per group of at most MAX_MEMBERS.
    groups: dict = {}
    for i, m, r in members:
        x0 = xs[i][0]
        key = (tuple(x0.shape), jnp.dtype(x0.dtype), tuple(jnp.dtype(a.dtype) for a in wides[i]))
        groups.setdefault(key, []).append((i, m, r))
    new_wides = [list(w) for w in wides]
    new_xs = [list(x) for x in xs]
    new_mirrors = [list(m) for m in mirrors]
    for group in groups.values():
        for lo in range(0, len(group), MAX_MEMBERS):
            call = group[lo:lo + MAX_MEMBERS]
            stacks = list(dict.fromkeys(i for i, _, _ in call))        # the calls' sets of state stacks, in order
            x0 = xs[call[0][0]][0]
            ok = jnp.stack([oks[(i, m)] for i, m, _ in call]) if oks else None
            scalars, writes = kinds.scalars(kind, plan, x0, call, flat, packs, scale, ok)
            pack_rows += writes
            state_in = [a for i in stacks for a in new_wides[i]]
            outs = _call(kind, plan.ema is not None, scalars, state_in, [xs[i][m] for i, m, _ in call],
                         [gs[i][m] for i, m, _ in call], [mirrors[i][m] for i, m, _ in call],
                         [stacks.index(i) for i, _, _ in call], [r for _, _, r in call], in_place)
            ns = len(wides[stacks[0]])
            for s, i in enumerate(stacks):
                new_wides[i] = list(outs[s * ns:(s + 1) * ns])
            at = len(state_in) + len(call)
            for (i, m, _), x in zip(call, outs[len(state_in):at]):
                new_xs[i][m] = x
                new_mirrors[i][m] = tuple(outs[at:at + len(mirrors[i][m])])
                at += len(mirrors[i][m])
    new_stored = []
    for t, (leaves, treedef), w, (_, avg, _), e in zip(stored, flat, new_wides, opened, extras):
        it = iter(w)
        core = treedef.unflatten([a if is_packed(a) else next(it) for a in leaves])
        new_stored.append(_close(plan, t, core, next(it) if plan.ema is not None else avg, e))
    return new_stored, [tuple(x) for x in new_xs], pack_rows, [tuple(m) for m in new_mirrors]


def _call(kind: int, ema: bool, scalars: jax.Array, state: list, xs: list, gs: list, ms: list, sets: list,
          rows: list, in_place: bool) -> list:
    """The kernel on one call's operands (`gs`: per member a tuple of 1 or 2 gradient arrays; `ms`: per member a
    tuple of mirrors; `ema`: each set of state stacks ends with an EMA's average): returns the new state
    stacks, then the new parameters, then the new mirrors."""
    ys = [y for m in ms for y in m]
    outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state + xs + ys]
    n_grads = sum(len(p) for p in gs)
    # Operand 0 is `scalars`; the mirrors' operands come after the gradients.
    alias = {1 + j: j for j in range(len(state) + len(xs))} if in_place else {}
    alias.update({1 + len(state) + len(xs) + n_grads + c: len(state) + len(xs) + c for c in range(len(ys))}
                 if in_place else {})
    f = jax.ffi.ffi_call(fused_load.TARGET, outs, input_output_aliases=alias, vmap_method="sequential")
    return f(scalars, *state, *xs, *[g for parts in gs for g in parts], *ys, kind=np.int64(kind),
             ema=np.int64(ema), sets=np.asarray(sets, np.int64), rows=np.asarray(rows, np.int64),
             parts=np.asarray([len(p) for p in gs], np.int64), mirrors=np.asarray([len(m) for m in ms], np.int64))
