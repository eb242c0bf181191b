"""The fused CPU step: Adam, AdamW, Lion, Momentum and Descent in one pass over each parameter.

XLA:CPU compiles Adam's update into three loops over each parameter (the first moment, the second, then the
step, which re-reads both), and cannot fuse them into one (there is no multi-output loop fusion on CPU). The step
is memory-bound, so three passes cost about twice what one does. `optim/_engine/fused.cc` is that one pass, an XLA FFI
custom call: per element it reads the parameter, its gradient and its state and writes the new ones in place
(every state and parameter input is aliased to its output; with `donate=True`, or buffers XLA owns inside a
jit, nothing is copied), split into chunks on XLA's intra-op thread pool.

It is one of the engine's strategies (`Kernel`, registered with optim._engine.strategies): `update` uses it for a rule
whose own class declares one of those five formulas (`Rule._formula`), alone or after a `ClipGlobalNorm` in a
two-stage chain (the clip factor scales the gradient inside the kernel), on parameters of float32 or bfloat16
(states float32 or bfloat16), one gradient tree, scalar hyperparameters, and parameters that are not sharded
over several devices (a sharded array would be gathered to run a custom call: XLA's own path is kept). It
groups the stepping members of a rule's stacks by shape, at most `MAX_MEMBERS` per call. The rule's
hyperparameters and Adam's bias corrections are computed by XLA and passed as one small `(members, 8)` array.

CPU only, chosen at lowering (optim._engine.kernel_choice): a program lowered for GPU or TPU, or exported, runs XLA's
path (which fuses there) and only a CPU lowering runs the kernel.

The kernel is compiled at install (`setup.py`) and optional: without it (no compiler at install), or with the
environment variable `OPTIM_FUSED=0` (read at import; `optim._engine.fused.ENABLED` can also be set), `update` runs
the rules' JAX code, the reference the tests compare the kernel with.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import xla as xla
from .kernel_choice import kernel_or_xla
from .pack import assemble, is_packed
from .stack import KERNEL_FLOATS, row_index, traced_sharded
from .._rules.protocol import as_compute, eps_of, formula_of
from .strategies import Strategy, register
from .._rules.wrappers import OptimiserChain

__all__ = ["ENABLED", "AVAILABLE", "KERNEL", "Kernel", "only_cpu", "kernel_calls"]

ENABLED = os.environ.get("OPTIM_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")
MAX_MEMBERS = 64          # members per call (the prototype: XLA's compile time grows beyond)
_TARGET = "optim_fused"
_log = logging.getLogger("optim")

# Kernel kinds (optim/_engine/fused.cc) and state arrays per member.
_ADAM, _ADAMW_COUPLED, _ADAMW, _LION, _MOMENTUM, _DESCENT = range(6)


_KERNEL = "_fused_kernel.so"       # built by setup.py: a plain shared library, one file for every Python version
_RECORD = "_fused_kernel.json"     # beside it (setup.py): the jaxlib and XLA FFI API version it was compiled against


def _ffi_api(include: str) -> tuple[int, int] | None:
    """`(major, minor)`: the XLA FFI API version declared by the headers in `include` (a jaxlib's include folder)."""
    import re

    try:
        with open(os.path.join(include, "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
    except OSError:
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
    return (int(found[0].group(1)), int(found[1].group(1))) if all(found) else None


def _refusal(built: dict, jaxlib: str, ffi: tuple[int, int] | None) -> str | None:
    """Why a kernel whose build record is `built` must not be registered with jaxlib `jaxlib`, whose headers declare
    XLA FFI API version `ffi` (None: it may be).

    XLA compares a handler's FFI API version with its own only when the CPU backend starts, and a mismatch then
    stops the backend (`Unable to initialize backend 'cpu'`: no JAX program runs), so the versions are compared
    here, before registering. The major versions must agree and the kernel's minor version be at most this
    jaxlib's: XLA runs handlers built against older minor versions (xla/ffi/api/c_api.h), so a kernel compiled
    against one jaxlib runs under a newer one of the same FFI API. Without an FFI version on either side, the
    jaxlib versions must be equal.
    """
    api, was = built.get("ffi_api"), built.get("jaxlib")
    if api and ffi:
        if api[0] == ffi[0] and api[1] <= ffi[1]:
            return None
        return (f"it was built against jaxlib {was} (XLA FFI API {api[0]}.{api[1]}), which jaxlib {jaxlib} "
                f"(FFI API {ffi[0]}.{ffi[1]}) cannot run")
    if was == jaxlib:
        return None
    return f"it was built against jaxlib {was}, this is jaxlib {jaxlib}, and the XLA FFI API version is unknown"


def _load(folder: str = os.path.dirname(__file__)) -> tuple[bool, str]:
    """`(available, why)`: register the kernel in `folder` with XLA, unless its build record says this jaxlib
    cannot run it (see `_refusal`)."""
    import importlib.metadata
    import json

    path = os.path.join(folder, _KERNEL)
    if not os.path.exists(path):
        stale = glob.glob(os.path.join(folder, "_fused_kernel.*.so"))
        return False, ("optim's fused CPU kernel was not built at install (no C++ compiler?)" if not stale else
                       f"optim's fused CPU kernel was installed by an older optim ({stale[0]}): reinstall optim")
    try:
        with open(os.path.join(folder, _RECORD)) as f:
            built = json.load(f)
        jaxlib = importlib.metadata.version("jaxlib")
    except (OSError, ValueError, importlib.metadata.PackageNotFoundError) as e:
        return False, f"optim's fused CPU kernel {path} was not loaded: no build record or jaxlib version ({e!r})"
    was = built.get("jaxlib")
    why = _refusal(built, jaxlib, _ffi_api(jax.ffi.include_dir()))
    if why:
        return False, (f"optim's fused CPU kernel {path} was not loaded: {why}; rebuild it against this jaxlib "
                       "(pip install --force-reinstall --no-deps --no-build-isolation --no-binary optim-jax optim-jax, "
                       f"with setuptools and a C++ compiler) or install jaxlib {was}")
    try:
        lib = ctypes.CDLL(path)
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.optim_fused), platform="cpu")
    except Exception as e:      # a broken file: the JAX path still works
        return False, f"optim's fused CPU kernel {path} could not be loaded: {e!r}"
    also = "" if was == jaxlib else f" (built against jaxlib {was}, runs under jaxlib {jaxlib})"
    return True, f"optim's fused CPU kernel: {path}{also}"


AVAILABLE, WHY = _load()
_log.debug("%s%s", WHY, "" if AVAILABLE else "; update runs the pure-JAX path")


def only_cpu() -> bool:
    """Whether this process has no backend but the CPU (then the kernel is used without a platform switch)."""
    global _ONLY_CPU
    if _ONLY_CPU is None:
        _ONLY_CPU = jax.default_backend() == "cpu" and {d.platform for d in jax.devices()} == {"cpu"}
        for other in ("gpu", "tpu"):
            try:
                jax.devices(other)
                _ONLY_CPU = False
            except RuntimeError:
                pass
    return _ONLY_CPU


_ONLY_CPU: bool | None = None


def _split(rule: Any) -> tuple[Any, Any]:
    """`(clip, rule)`: a two-stage `chain(ClipGlobalNorm, rule)` as its clip and its rule; else `(None, rule)`."""
    if type(rule) is OptimiserChain and len(rule.rules) == 2 and formula_of(rule.rules[0]) == "clip":
        return rule.rules
    return None, rule


def _kind(rule: Any) -> int | None:
    """The kernel's kind for `rule`'s formula (see `Rule._formula`), or None where the kernel has none."""
    formula = formula_of(rule)
    if formula == "adamw":
        return _ADAMW_COUPLED if rule.couple else _ADAMW
    return _KINDS.get(formula)


_KINDS = {"adam": _ADAM, "lion": _LION, "momentum": _MOMENTUM, "descent": _DESCENT}


def _single_device(place: Any) -> bool:
    return place is None or len(getattr(place, "device_set", ())) == 1


class Kernel(Strategy):
    """The fused CPU kernel as one of the engine's strategies (optim._engine.strategies)."""

    name = "optim's fused CPU kernel"

    def enabled(self) -> bool:
        return ENABLED and AVAILABLE

    def wide(self, rule: Any) -> bool:
        # Only where it will run: a process with another backend keeps XLA's stacking (one parameter a stack).
        return only_cpu() and _kind(_split(rule)[1]) is not None

    def refuse(self, rule: Any, firsts: list, stored: list, sizes: list, n_trees: int) -> str | None:
        """Why the kernel cannot run `rule` on these stacks (None: it can). `firsts[i]`: the `Param` of stack
        `i`'s first member (all members share shape, dtype and placement), `stored[i]` its stored state tree,
        `sizes[i]` its number of members; `n_trees`: the number of gradient trees."""
        if not self.enabled():
            return "turned off (OPTIM_FUSED=0)" if AVAILABLE else WHY
        if n_trees != 1:
            return f"{n_trees} gradient trees"
        kind = _kind(_split(rule)[1])
        if kind is None:
            return "it has no kernel for this rule (a kernel formula, alone or after ClipGlobalNorm)"
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
            leaves = jax.tree_util.tree_flatten(tree, is_leaf=is_packed)[0]
            wide = [a for a in leaves if not is_packed(a)]
            if kind in (_ADAM, _ADAMW_COUPLED, _ADAMW):
                if len(leaves) != 3 or not is_packed(leaves[2]) or len(wide) != 2:
                    return "a state of another structure"
            elif len(wide) != (0 if kind == _DESCENT else 1) or len(leaves) != len(wide):
                return "a state of another structure"
            for a in wide:
                if tuple(np.shape(a)) != (n, *p.shape) or jnp.dtype(a.dtype) not in KERNEL_FLOATS:
                    return "a state array of another shape or dtype"
                if traced_sharded(a):
                    return "a sharded state array"
        return None

    def run(self, prog: Any, rule: Any, js: list, in_place: bool, stacks: list, packs: tuple, xs: list, gs: list,
            parts: list, mirrors: list) -> tuple:
        """The kernel's step of `rule`'s stepping stacks `js` where the program is lowered for CPU, XLA's path
        elsewhere (optim._engine.kernel_choice), both as `xla.rule_step` returns it plus the tied positions' new values
        (`xla.mirrors`). The kernel reads each parameter's gradient parts (`parts`: it sums a tie's two parts in
        its own pass), XLA's path the sums (`gs`). The hyperparameters are operands, as they may be what is
        differentiated (a meta-gradient through `update` differentiates XLA's path)."""
        hypers, treedef = jax.tree_util.tree_flatten(rule)
        lay, ref = prog.layout, weakref.ref(prog)

        # Kept by the traced program, as XLA's code to lower for other platforms: it reaches the Program through
        # a weak reference (the Program keeps the traced program; see `optim._core.update._jitted`).
        def on_xla(hypers, stacks, packs, xs, gs, parts, ms):
            new_stacks, new_params, written = xla.rule_step(ref(), treedef.unflatten(hypers), js, stacks, packs, xs,
                                                            gs)
            return new_stacks, new_params, written, xla.mirrors(new_params, ms)

        def on_kernel(hypers, stacks, packs, xs, gs, parts, ms):
            new_stacks, new_params, written, new_ms = kernel_calls(
                treedef.unflatten(hypers), stacks, [prog.stack_plan[j][0] for j in js],
                [len(lay.stacks[prog.step_stacks[j]]) for j in js], xs, parts, packs, in_place, ms)
            return new_stacks, new_params, assemble(packs, written), new_ms

        return kernel_or_xla(on_kernel, on_xla, hypers, stacks, packs, xs, gs, parts, mirrors)


KERNEL = register(Kernel())


def kernel_calls(rule: Any, stored: list, rows: list, sizes: list, xs: list, gs: list, packs: tuple,
                 in_place: bool, mirrors: list):
    """`rule`'s step of these stacks as kernel calls, at most `MAX_MEMBERS` members each (see `Kernel.refuse`).
    Per stack `i`: `stored[i]` its stored state tree, `rows[i]` its stepping rows, `sizes[i]` its size, `xs[i]`
    / `gs[i]` the stepping rows' parameters and gradients (per member a tuple of 1 or 2 arrays that the kernel
    sums: a tied parameter's gradient parts), and `mirrors[i]` per member a tuple of arrays like it (the model's
    other positions of a tie) that get its new value. `in_place`: alias the new state, parameters and mirrors to
    the old (updated in place when the caller donates them; else XLA copies them first), or write them beside
    the old (for a call that keeps its inputs). Returns `(new stored trees, new parameters per stack, new pack
    rows [(group, leaf, rows of the pack, values)], new mirrors per stack)`, as XLA's path does."""
    clip, rule = _split(rule)
    kind = _kind(rule)
    scale = jnp.ones((), jnp.float32)
    if clip is not None:     # ClipGlobalNorm's factor over all these members, in float32 (see its `factor`)
        scale = clip.factor([sum(g[1:], g[0]) for member in gs for g in member]).astype(jnp.float32)
    flat = [jax.tree_util.tree_flatten(t, is_leaf=is_packed) for t in stored]
    wides = [[a for a in leaves if not is_packed(a)] for leaves, _ in flat]
    # Members grouped by parameter shape, dtype and state dtypes: one call per group of at most MAX_MEMBERS.
    groups: dict = {}
    for i in range(len(stored)):
        x0 = xs[i][0]
        key = (tuple(x0.shape), jnp.dtype(x0.dtype), tuple(jnp.dtype(a.dtype) for a in wides[i]))
        for m, r in enumerate(rows[i]):
            groups.setdefault(key, []).append((i, m, r))
    new_wides = [list(w) for w in wides]
    new_xs = [list(x) for x in xs]
    new_mirrors = [list(m) for m in mirrors]
    pack_rows: list = []
    for members in groups.values():
        for lo in range(0, len(members), MAX_MEMBERS):
            call = members[lo:lo + MAX_MEMBERS]
            stacks = list(dict.fromkeys(i for i, _, _ in call))        # the calls' sets of state stacks, in order
            x0 = xs[call[0][0]][0]
            scalars, writes = _scalars(kind, rule, x0, call, flat, packs, scale)
            pack_rows += writes
            state_in = [a for i in stacks for a in new_wides[i]]
            outs = _call(kind, scalars, state_in, [xs[i][m] for i, m, _ in call], [gs[i][m] for i, m, _ in call],
                         [mirrors[i][m] for i, m, _ in call], [stacks.index(i) for i, _, _ in call],
                         [r for _, _, r in call], in_place)
            ns = len(wides[stacks[0]])
            for s, i in enumerate(stacks):
                new_wides[i] = list(outs[s * ns:(s + 1) * ns])
            at = len(state_in) + len(call)
            for (i, m, _), x in zip(call, outs[len(state_in):at]):
                new_xs[i][m] = x
                new_mirrors[i][m] = tuple(outs[at:at + len(mirrors[i][m])])
                at += len(mirrors[i][m])
    new_stored = []
    for (leaves, treedef), w in zip(flat, new_wides):
        it = iter(w)
        new_stored.append(treedef.unflatten([a if is_packed(a) else next(it) for a in leaves]))
    return new_stored, [tuple(x) for x in new_xs], pack_rows, [tuple(m) for m in new_mirrors]


def _scalars(kind: int, rule: Any, x: jax.Array, call: list, flat: list, packs: tuple, scale: jax.Array):
    """The `(members, 8)` float32 scalars of one call (see optim/_engine/fused.cc), and for Adam the new bias-correction
    powers as pack rows: `[(group, leaf, rows of the pack, values)]`."""
    k = len(call)
    zero = jnp.zeros((), jnp.float32)
    lr = as_compute(rule.lr, x)
    if kind == _DESCENT:
        row = [lr]
    elif kind == _MOMENTUM:
        row = [lr, as_compute(rule.rho, x)]
    elif kind == _LION:
        row = [lr, as_compute(rule.beta[0], x), as_compute(rule.beta[1], x)]
    else:
        b1, b2 = as_compute(rule.beta[0], x), as_compute(rule.beta[1], x)
        wd = as_compute(rule.weight_decay, x) if kind != _ADAM else zero
        # This call's members' powers (β₁ᵗ, β₂ᵗ): their rows of the packs, read per pack group, in call order.
        bts, runs, writes = [], [], []
        for i, _, r in call:
            p = flat[i][0][2]
            key = (p.group, p.leaf)
            if runs and runs[-1][0] == key:
                runs[-1][1].append(p.start + r)
            else:
                runs.append((key, [p.start + r]))
        for (g, leaf), at in runs:
            bt = packs[g][leaf][row_index(tuple(at))]
            bts.append(bt)
            writes.append((g, leaf, tuple(at), bt * jnp.stack([b1, b2]).astype(bt.dtype)))
        bt = (bts[0] if len(bts) == 1 else jnp.concatenate(bts)).astype(jnp.float32)
        c = 1 / (1 - bt)
        head = jnp.broadcast_to(jnp.stack([lr, b1, b2, eps_of(rule.eps, x)]).astype(jnp.float32), (k, 4))
        tail = jnp.broadcast_to(jnp.stack([wd.astype(jnp.float32), scale]), (k, 2))
        return jnp.concatenate([head, c, tail], axis=1), writes
    row = jnp.stack([jnp.asarray(v, jnp.float32) for v in row] + [zero] * (7 - len(row)) + [scale])
    return jnp.broadcast_to(row, (k, 8)), []


def _call(kind: int, scalars: jax.Array, state: list, xs: list, gs: list, ms: list, sets: list, rows: list,
          in_place: bool) -> list:
    """The kernel on one call's operands (`gs`: per member a tuple of 1 or 2 gradient arrays; `ms`: per member a
    tuple of mirrors): returns the new state stacks, then the new parameters, then the new mirrors."""
    ys = [y for m in ms for y in m]
    outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state + xs + ys]
    n_grads = sum(len(p) for p in gs)
    # Operand 0 is `scalars`; the mirrors' operands come after the gradients.
    alias = {1 + j: j for j in range(len(state) + len(xs))} if in_place else {}
    alias.update({1 + len(state) + len(xs) + n_grads + c: len(state) + len(xs) + c for c in range(len(ys))}
                 if in_place else {})
    f = jax.ffi.ffi_call(_TARGET, outs, input_output_aliases=alias, vmap_method="sequential")
    return f(scalars, *state, *xs, *[g for parts in gs for g in parts], *ys, kind=np.int64(kind),
             sets=np.asarray(sets, np.int64), rows=np.asarray(rows, np.int64),
             parts=np.asarray([len(p) for p in gs], np.int64), mirrors=np.asarray([len(m) for m in ms], np.int64))
