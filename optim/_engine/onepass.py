"""The one-pass step of Adam and AdamW with quantised moments: a Pallas kernel on the GPU, a call of the fused
kernel on the CPU; one of the engine's strategies.

XLA cannot store a moment blockwise in one pass: a block's codes need its new maximum, a reduction over the new
moments, and XLA:GPU computes that reduction in one kernel and the codes in a second, which reads the gradient
and the old codes again to recompute the moments (or reads them back from memory). This kernel reads each block
once: its parameter, gradient, codes and scales; dequantises, steps, finds the new maxima and writes the
parameter, the codes and the scales; one launch per parameter, at the floor of bytes a step can move
(`bench/NOTES.md`, "The one-pass quantised kernel"). With 4-bit codes (two a byte) the even and the odd numbers
of a block step as two strided parts.

It is a strategy (`OnePass`, optim._engine.strategies) for `Adam` and `AdamW` (exactly those classes, alone or
after `ClipGlobalNorm` in a chain, whose clipped gradient XLA computes) whose `mu_dtype` and `nu_dtype` are one
`Quantized` format (`q8`, `q4`, or another block size), with one gradient tree. It runs XLA's path with the rule's
`apply` replaced, for each parameter whose moments are quantised (at least `Quantized.min_size` numbers), float32,
a whole number of blocks (of a power of 2 numbers: Triton's shapes) and alone in its stack (large parameters are:
optim._engine.group), by a call of the primitive `onepass_p`, which returns the new parameter (a `Replace` step)
and its codes; every other parameter takes the rule's own step. The bias corrections and every small value are
computed as XLA's path computes them (optim._engine.hoist).

The choice of code is made when the program is lowered, as the fused CPU kernel's (optim._engine.kernel_choice):
lowered for CUDA on one device, the Pallas kernel (Triton); for one CPU device, where the fused CPU kernel is
loaded and on (optim._engine.fused; its blocks of at most 4096 numbers), its custom call `optim_adam_quantized`
(fused_quantized.cc: the same one pass over each block, the fused kernel's arithmetic, which XLA's contracted
multiply-adds may round differently by an ulp or so); anywhere else (TPU, a program over several devices,
`jax.export`, the kernel off), the same arithmetic in XLA's operations (`reference`), which is XLA's path's, so
such a process computes what it computed without this strategy. Whether the CPU kernel may run is decided when
traced (a switch traced off lowers without it), whether it does when lowered. Vmapped over more than one parameter
(a grouped stack), the primitive is replaced by `reference` when traced, which XLA's path then evaluates member by
member (optim._engine.members). `INTERPRET = True` runs the Pallas kernel in interpret mode on the CPU instead of
the reference (the tests compare the two).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from . import fused, fused_load, multitensor, xla
from .backend import own_kernel_may_run
from .stack import STACK_MAX_SIZE
from .strategies import Request, Result, Strategy, register, switch
from .._rules.adam import Adam, AdamState, AdamW
from .._rules.moments import bt_next, debias
from .._rules.protocol import Replace, abs2, apply_all, as_compute, compute_dtype, eps_of, formula_of, pair_of
from .._rules.quantized import MANTISSA, Quantized, QuantizedArray, _decode, _encode
from .._rules.wrappers import OptimiserChain

__all__ = ["ENABLED", "INTERPRET", "OnePass", "ONE_PASS", "onepass_p", "reference"]

ENABLED = os.environ.get("OPTIM_ONEPASS", "1").strip().lower() not in ("0", "false", "no", "off")
INTERPRET = False       # lowered for CPU: the Pallas kernel in interpret mode, not `reference` (tests)
ROWS = 16               # blocks a program of the kernel steps at most (a power of 2, as Triton's blocks must be)
CPU_MAX_BLOCK = 4096    # numbers a block holds at most in the CPU kernel (fused.h's kMaxQBlock)


# ------------------------------------------------------------------------------------------------ arithmetic
def _step(adamw: bool, couple: bool, x, g, m, v, s):
    """The new parameter and moments from float32 `x`, `g` and the old moments `m`, `v`, with `s` the scalars
    (β₁, β₂, c₁, c₂, ε, η, λ): Adam's and AdamW's `apply` (optim._rules.adam), operation by operation."""
    b1, b2, c1, c2, eps, lr, wd = s
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * abs2(g)
    if not adamw:
        step = m * c1 / (jnp.sqrt(v * c2) + eps) * lr
    else:
        a = m * c1 / (jnp.sqrt(v * c2) + eps)
        step = lr * (a + wd * x) if couple else lr * a + wd * x
    return x - step, m, v


def reference(x, g, mc, ms, vc, vs, s, *, adamw: bool, couple: bool, fm: Quantized, fv: Quantized):
    """The step in XLA's operations: the moments dequantised, stepped and quantised as `load` / `store` do
    (optim._rules.moments). Returns `(new x, m codes, m scales, v codes, v scales)`."""
    from .._rules.quantized import quantize

    m = QuantizedArray(mc, ms, fm, True, tuple(x.shape)).dequantize()
    v = QuantizedArray(vc, vs, fv, False, tuple(x.shape)).dequantize()
    new_x, m, v = _step(adamw, couple, x, g, m, v, tuple(s[i] for i in range(7)))
    qm, qv = quantize(m, fm, True), quantize(v, fv, False)
    return new_x, qm.codes, qm.scale, qv.codes, qv.scale


def _kernel(s_ref, x_ref, g_ref, mc_ref, ms_ref, vc_ref, vs_ref, xo_ref, mco_ref, mso_ref, vco_ref, vso_ref, *,
            adamw: bool, couple: bool, bits: int):
    """One program: `rows_per_program` blocks of the parameter, read once and written once. With 4 bits a byte
    holds the codes of two neighbours (the even one in its low half): the even and the odd numbers step as two
    strided parts."""
    from jax.experimental import pallas as pl

    s = tuple(s_ref[i] for i in range(7))
    half = x_ref.shape[1] // 2
    parts = [slice(None)] if bits == 8 else [pl.ds(0, half, stride=2), pl.ds(1, half, stride=2)]
    old = [(mc_ref[...].astype(jnp.int32), ms_ref[...][:, None], True),
           (vc_ref[...].astype(jnp.int32), vs_ref[...][:, None], False)]
    new = []
    for k, part in enumerate(parts):
        m, v = (_decode(c if bits == 8 else (c & 15 if k == 0 else c >> 4), bits, signed) * scale
                for c, scale, signed in old)
        xo_ref[:, part], m, v = _step(adamw, couple, x_ref[:, part], g_ref[:, part], m, v, s)
        new.append((m, v))
    for j, (signed, codes, scales) in enumerate(((True, mco_ref, mso_ref), (False, vco_ref, vso_ref))):
        ys = [n[j] for n in new]
        top = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(y), axis=-1) for y in ys])   # the block's maximum
        inv = jnp.where(top > 0, 1 / jnp.where(top > 0, top, 1), 0)     # quantize's (optim._rules.quantized)
        c = [_encode(y * inv[:, None], bits, signed) for y in ys]
        codes[...] = (c[0] if bits == 8 else c[0] | (c[1] << 4)).astype(jnp.uint8)
        scales[...] = top


def rows_per_program(blocks: int) -> int:
    """The blocks one program steps: the largest power of 2 up to `ROWS` that divides `blocks`. Triton's loads
    and stores are not bounded by the array (interpret mode pads them): a partial last program would read and
    write past the parameter's end."""
    return math.gcd(blocks, ROWS)


def _pallas(x, g, mc, ms, vc, vs, s, *, adamw: bool, couple: bool, fm: Quantized, fv: Quantized,
            interpret: bool = False):
    """The kernel over the parameter's blocks (`x` a whole number of them), its buffers updated in place."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    nb, block = ms.shape[0], fm.block
    n = rows_per_program(nb)
    rows = pl.BlockSpec((n, block), lambda i: (i, 0))
    code_rows = pl.BlockSpec((n, mc.shape[1]), lambda i: (i, 0))
    per_block = pl.BlockSpec((n,), lambda i: (i,))
    scalars = jnp.zeros((8,), jnp.float32).at[:7].set(s[:7])
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)     # noqa: E731
    x2, g2 = x.reshape(nb, block), g.reshape(nb, block)
    out = pl.pallas_call(
        functools.partial(_kernel, adamw=adamw, couple=couple, bits=fm.bits), grid=(nb // n,),
        in_specs=[pl.BlockSpec((8,), lambda i: (0,)), rows, rows, code_rows, per_block, code_rows, per_block],
        out_specs=[rows, code_rows, per_block, code_rows, per_block],
        out_shape=[like(x2), like(mc), like(ms), like(vc), like(vs)],
        input_output_aliases={1: 0, 3: 1, 4: 2, 5: 3, 6: 4}, interpret=interpret, name=f"optim_adam_q{fm.bits}",
        compiler_params=None if interpret else plt.CompilerParams(num_warps=4),
    )(scalars, x2, g2, mc, ms, vc, vs)
    return (out[0].reshape(x.shape), *out[1:])


def _on_cpu_kernel(fmt: Quantized) -> bool:
    """Whether the fused CPU kernel's one-pass step (optim/_engine/fused_quantized.cc) takes blocks of `fmt`: it
    is loaded and on (optim._engine.fused), and a block fits its stack buffers, both maps alike."""
    return (fused.ENABLED and fused.AVAILABLE and fmt.block <= CPU_MAX_BLOCK
            and MANTISSA[fmt.bits, True] == MANTISSA[fmt.bits, False])


def _cpu_kernel(x, g, mc, ms, vc, vs, s, *, adamw: bool, couple: bool, fm: Quantized, fv: Quantized):
    """The step as the fused CPU kernel's custom call, in place (see `reference`)."""
    kind = 0 if not adamw else 1 if couple else 2      # fused.h's kAdam, kAdamWCoupled, kAdamWDecoupled
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)     # noqa: E731
    # fused_quantized.cc reads the scalars as fused_loops.inc's rows: lr, b1, b2, eps, c1, c2, wd.
    b1, b2, c1, c2, eps, lr, wd = (s[i] for i in range(7))
    # Updated in place (aliased). The codes and scales take a leading axis of 1 back: they come from the state's
    # stack of one through a squeeze (`_batch`), which XLA folds with this reshape, so the call reads and writes
    # the stack's own buffers; an aliased operand that is a reshape of the program's parameter, XLA:CPU copies
    # in and out.
    up = lambda a: a[None]      # noqa: E731
    call = jax.ffi.ffi_call(fused_load.QUANTIZED, [like(x), *(like(up(a)) for a in (mc, ms, vc, vs))],
                            input_output_aliases={1: 0, 3: 1, 4: 2, 5: 3, 6: 4})
    out = call(jnp.stack([lr, b1, b2, eps, c1, c2, wd]), x, g, up(mc), up(ms), up(vc), up(vs), kind=np.int64(kind),
               bits=np.int64(fm.bits), mantissa=np.int64(MANTISSA[fm.bits, True]))
    return (out[0], *(o[0] for o in out[1:]))


# ------------------------------------------------------------------------------------------------ primitive
onepass_p = jcore.Primitive("optim_adam_quantized")
onepass_p.multiple_results = True


def onepass(*args, **params) -> tuple:
    """`reference(*args, **params)`, computed by the Pallas kernel where the program is lowered for one CUDA
    device (see the module)."""
    # The fused CPU kernel's choice is made when traced, so that a program traced with it off (fused.ENABLED, a
    # switch) is lowered without it.
    return tuple(onepass_p.bind(*args, **params, cpu_kernel=_on_cpu_kernel(params["fm"])))


def _abstract(*avals, cpu_kernel: bool, **params):
    shapes = jax.eval_shape(functools.partial(reference, **params), *avals)
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in shapes]


def _lowering(on_cuda: bool):
    def rule(ctx, *args, cpu_kernel: bool, **params):
        own = own_kernel_may_run(ctx)
        if on_cuda and own:
            fn = functools.partial(_pallas, **params)
        elif INTERPRET and not on_cuda:
            fn = functools.partial(_pallas, **params, interpret=True)
        elif not on_cuda and own and cpu_kernel:
            fn = functools.partial(_cpu_kernel, **params)
        else:
            fn = functools.partial(reference, **params)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return rule


def _batch(args, dims, *, cpu_kernel: bool, **params):
    sizes = {a.shape[d] for a, d in zip(args, dims) if d is not None}
    if sizes == {1}:
        # A parameter alone in its stack: its arrays read through their stack of one (a reshape).
        squeezed = [a if d is None else jnp.squeeze(a, d) for a, d in zip(args, dims)]
        return [o[None] for o in onepass(*squeezed, **params)], [0] * 5
    # A group: XLA's own operations, which XLA's path evaluates member by member (optim._engine.members).
    axes = tuple(dims)
    return list(jax.vmap(functools.partial(reference, **params), in_axes=axes)(*args)), [0] * 5


def _jvp(primals, tangents, *, cpu_kernel: bool, **params):
    dots = tuple(ad.instantiate_zeros(t) for t in tangents)
    out, dout = jax.jvp(functools.partial(reference, **params), tuple(primals), dots)
    return list(out), list(dout)


onepass_p.def_impl(lambda *args, cpu_kernel, **params: jax.jit(functools.partial(onepass, **params))(*args))
onepass_p.def_abstract_eval(_abstract)
mlir.register_lowering(onepass_p, _lowering(False))
mlir.register_lowering(onepass_p, _lowering(True), platform="cuda")
batching.primitive_batchers[onepass_p] = _batch
ad.primitive_jvps[onepass_p] = _jvp


# ------------------------------------------------------------------------------------------------ the rule
def _fits(x, dx, mu, nu) -> bool:
    return (isinstance(mu, QuantizedArray) and isinstance(nu, QuantizedArray)
            and jnp.dtype(x.dtype) == jnp.float32 and jnp.dtype(dx.dtype) == jnp.float32
            and x.size % mu.fmt.block == 0 and mu.fmt.block & (mu.fmt.block - 1) == 0   # Triton: powers of 2
            and tuple(mu.codes.shape) == (x.size // mu.fmt.block, mu.fmt.block * mu.fmt.bits // 8))


def _float32(x, dx, mu, nu) -> bool:
    return all(isinstance(a, jax.Array) and jnp.dtype(a.dtype) == jnp.float32 for a in (x, dx, mu, nu))


def _apply(self, state, x, dx, *dxs, scale=None):
    """Adam's or AdamW's `apply` (optim._rules.adam) with the large arithmetic in `onepass` (quantised moments)
    or `multitensor.adam` (float32 moments: a group's one pass). `scale`: a factor of the gradient
    (`ClipGlobalNorm`'s, `_OnePassChain`), which the float32 step multiplies in itself."""
    mu, nu = state[0], state[1]
    f32 = _float32(x, dx, mu, nu)
    if scale is not None and not f32:
        dx = dx * scale.astype(compute_dtype(dx))       # as ClipGlobalNorm's own step
    if not f32 and not _fits(x, dx, mu, nu):
        return type(self).__mro__[1].apply(self, state, x, dx, *dxs)
    bt = bt_next(state[2], self.beta, x)
    c1, c2 = debias(bt)
    b1, b2 = pair_of(self.beta, x)
    adamw = isinstance(self, AdamW)
    wd = as_compute(self.weight_decay, x) if adamw else jnp.zeros((), jnp.float32)
    s = jnp.stack([b1, b2, c1, c2, eps_of(self.eps, x), as_compute(self.lr, x), wd]).astype(jnp.float32)
    couple = bool(getattr(self, "couple", True))
    if f32:
        gs = jnp.ones((1,), jnp.float32) if scale is None else scale.astype(jnp.float32).reshape(1)
        new_x, m, v = multitensor.adam(x, dx, mu, nu, jnp.concatenate([s, gs]), adamw=adamw, couple=couple)
        return AdamState(m, v, bt), Replace(new_x)
    new_x, mc, ms, vc, vs = onepass(x, dx, mu.codes, mu.scale, nu.codes, nu.scale, s, adamw=adamw,
                                    couple=couple, fm=mu.fmt, fv=nu.fmt)
    new_state = AdamState(dataclasses.replace(mu, codes=mc, scale=ms), dataclasses.replace(nu, codes=vc, scale=vs),
                          bt)
    return new_state, Replace(new_x)


class _OnePassAdam(Adam):
    apply = _apply


class _OnePassAdamW(AdamW):
    apply = _apply


class _OnePassChain(OptimiserChain):
    """A chain whose last stage is a one-pass Adam: that stage returns the new parameter (a `Replace`), which an
    `OptimiserChain` refuses from its stages (a later stage could not step from it; here none follows)."""

    def apply_tree(self, states, xs, dxs):
        last = self.rules[-1]
        if len(self.rules) == 2 and formula_of(self.rules[0]) == "clip" and len(dxs[0]) == 1:
            # The clip's factor goes to the last stage's step, which multiplies it in where it reads the
            # gradient (a float32 group's kernel: no scaled gradient written and read back).
            f = self.rules[0].factor([d[0] for d in dxs])
            out = [jax.vmap(functools.partial(_apply, last, scale=f))(s[-1], x, *d)
                   for s, x, d in zip(states, xs, dxs)]
            return [(*s[:-1], o[0]) for s, o in zip(states, out)], [o[1] for o in out]
        head_states, steps = OptimiserChain(*self.rules[:-1]).apply_tree([s[:-1] for s in states], xs, dxs)
        last_states, new = apply_all(self.rules[-1], [s[-1] for s in states], xs,
                                     [(step, *d[1:]) for step, d in zip(steps, dxs)])
        return [(*h, s) for h, s in zip(head_states, last_states)], new


_SUBSTITUTE = {Adam: _OnePassAdam, AdamW: _OnePassAdamW}


def _core(rule: Any) -> Any:
    """The `Adam` or `AdamW` that steps the parameters: `rule` itself, or the last stage of a chain whose only
    other stage is a clip (`ClipGlobalNorm`, as the fused kernel's chains); None for any other rule."""
    if type(rule) is OptimiserChain and len(rule.rules) in (1, 2) and (
            len(rule.rules) == 1 or formula_of(rule.rules[0]) == "clip"):
        rule = rule.rules[-1]
    return rule if type(rule) in _SUBSTITUTE else None


def _substitute(rule: Any) -> Any:
    """`rule` (an `Adam` or `AdamW`, or a chain ending in one: `_core`) with its one-pass class, same fields."""
    chain = type(rule) is OptimiserChain
    new = object.__new__(_OnePassChain if chain else _SUBSTITUTE[type(rule)])
    for f in dataclasses.fields(rule):
        object.__setattr__(new, f.name, getattr(rule, f.name))
    if chain:
        object.__setattr__(new, "rules", (*rule.rules[:-1], _substitute(rule.rules[-1])))
    return new


def _float32_moments(rule: Any) -> bool:
    """Whether an `Adam` or `AdamW` stores both moments in float32."""
    return all(f is None or not isinstance(f, Quantized) and jnp.dtype(f) == jnp.float32
               for f in (rule.mu_dtype, rule.nu_dtype))


class OnePass(Strategy):
    """The one-pass quantised Adam step as one of the engine's strategies (see the module)."""

    name = "the one-pass quantised Adam kernel"

    def enabled(self) -> bool:
        return ENABLED

    def wide(self, rule: Any) -> bool:
        return False

    def one_kernel(self, rule: Any) -> bool:
        # a group of float32 Adam or AdamW parameters steps in one kernel (optim._engine.multitensor)
        return _core(rule) is not None and _float32_moments(_core(rule))

    def refuse(self, request: Request) -> str | None:
        rule = _core(request.rule)
        if not self.enabled():
            return "turned off (OPTIM_ONEPASS=0)"
        if rule is None:
            return "its rule is not Adam or AdamW (alone or after ClipGlobalNorm)"
        fm, fv = rule.mu_dtype, rule.nu_dtype
        f32 = _float32_moments(rule)
        if not (f32 or isinstance(fm, Quantized) and isinstance(fv, Quantized) and fm == fv):
            return "its moments are stored neither in one Quantized format nor in float32"
        if request.n_trees != 1:
            return f"{request.n_trees} gradient trees"
        if f32 and not any(n > 1 and math.prod(p.shape) > STACK_MAX_SIZE and jnp.dtype(p.dtype) == jnp.float32
                           for n, p in zip(request.sizes, request.firsts)):
            # A float32 step is one pass on XLA's path but in a group (optim._engine.multitensor)
            return "float32 moments and no group of float32 parameters"
        quantised = lambda a: isinstance(a, QuantizedArray)     # noqa: E731
        if any(n > 1 and any(map(quantised, jax.tree.leaves(st, is_leaf=quantised)))
               for n, st in zip(request.sizes, request.stored)):
            # Its new parameters would be read out of the stack's result (a `Replace`), not written by XLA's
            # path in each member's own array (optim._engine.members): a copy of each.
            return "a group of parameters with quantised moments"
        return None

    def run(self, request: Request) -> Result:
        new_stored, new_params, written = xla.rule_step(request._replace(rule=_substitute(request.rule)))
        return Result(new_stored, new_params, written, xla.mirrors(new_params, request.mirrors))


ONE_PASS = register(OnePass())
switch(sys.modules[__name__], "ENABLED")
switch(sys.modules[__name__], "INTERPRET")
