"""The fused step on a GPU: the fused CPU kernel's calls (optim._engine.fused) as one Pallas (Triton) kernel each.

A call of the fused kernel steps up to `MAX_MEMBERS` parameters of one shape: their arrays, their gradients (one
or two parts, a tie's, summed here), the stacks their states sit in (a member's state is row `rows[r]` of its
set `sets[r]` of stacks), the rows of XLA-computed scalars (hyperparameters, bias corrections, the clip factor,
a chain's Scale, an EMA's decay, a gate's flag: optim._engine.fused_kinds), and the arrays of its tied positions
(mirrors), which get its new value. On a GPU, XLA's path steps each parameter in a kernel of its own (or a group
in two passes: optim._engine.group) and copies a tied parameter's new value to its other position; this kernel is
one launch per call, each program one block of every member, reading each parameter, gradient and state number
once and writing each once, the mirrors included.

Chosen when the program is lowered for one CUDA device (optim._engine.kernel_choice); `supports` says which
calls it runs (the Adam family's Adam and AdamW, Lion, Momentum and Descent, float32 throughout, sizes with a
power-of-2 block of at least `MIN_BLOCK` numbers); every other call keeps XLA's path there. The element formulas are
`fused_loops.inc`'s, in jnp; the tests run this kernel in Pallas's interpret mode on the CPU against XLA's path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from . import fused_kinds as kinds

__all__ = ["supports", "call", "block_of", "KINDS", "MAX_BLOCK", "MIN_BLOCK"]

_K = {"adam": kinds._ADAM, "adamw_coupled": kinds._ADAMW_COUPLED, "adamw": kinds._ADAMW, "lion": kinds._LION,
      "momentum": kinds._MOMENTUM, "descent": kinds._DESCENT}
KINDS = frozenset(_K.values())
MAX_BLOCK = 2048        # numbers a program steps of each member
MIN_BLOCK = 128         # below (a size with few factors of 2), XLA's path
INTERPRET = False       # set by the tests: the kernel in Pallas's interpret mode


def block_of(n: int) -> int:
    """The numbers of each member one program steps: the largest power of 2 up to `MAX_BLOCK` dividing `n`, so
    that the programs cover the members exactly (Triton's loads are not bounded by the array)."""
    return math.gcd(n, MAX_BLOCK)


def supports(kind: int, dtypes: list, size: int) -> bool:
    """Whether this kernel runs calls of `kind` with parameters, gradients and states of `dtypes` and `size`
    numbers a parameter."""
    return (kind in KINDS and all(jnp.dtype(d) == jnp.float32 for d in dtypes)
            and block_of(size) >= MIN_BLOCK)


def _elem(kind: int, s: dict, x, g, m, v):
    """One block of a member: `fused_loops.inc`'s `Elem`, in its order of operations. Returns (new x, m, v)."""
    if kind == _K["adam"] or kind == _K["adamw_coupled"] or kind == _K["adamw"]:
        m = s["b1"] * m + (1 - s["b1"]) * g
        v = s["b2"] * v + (1 - s["b2"]) * (g * g)
        a = m * s["c1"] / (jnp.sqrt(v * s["c2"]) + s["eps"])
        step = (a * s["lr"] if kind == _K["adam"] else s["lr"] * (a + s["wd"] * x) if kind == _K["adamw_coupled"]
                else s["lr"] * a + s["wd"] * x)
    elif kind == _K["lion"]:
        u = s["b1"] * m + (1 - s["b1"]) * g
        step = s["lr"] * jnp.sign(u)
        m = s["b2"] * m + (1 - s["b2"]) * g
    elif kind == _K["momentum"]:
        m = s["b1"] * m + s["lr"] * g
        step = m
    else:
        step = s["lr"] * g
    return x - s["f"] * step, m, v


def _kernel(*refs, kind: int, ema: bool, ns: int, sets: tuple, rows: tuple, parts: tuple, mirrors: tuple,
            n_state: int):
    """Program j: block j of every member of the call (the members unrolled: each has its own arrays)."""
    k = len(rows)
    n_grads = sum(parts)
    it = iter(refs)
    sc = next(it)
    state_in = [next(it) for _ in range(n_state)]
    xs = [next(it) for _ in range(k)]
    gs = [next(it) for _ in range(n_grads)]
    [next(it) for _ in range(sum(mirrors))]                 # the mirrors' old values are not read
    state_out = [next(it) for _ in range(n_state)]
    xo = [next(it) for _ in range(k)]
    mo = [next(it) for _ in range(sum(mirrors))]
    g_at = m_at = 0
    arrays = kinds.ARRAYS[kind]
    for r in range(k):
        s = {name: sc[r, c] for c, name in enumerate(kinds._COLUMNS) if name}
        base, row = sets[r] * ns, rows[r]
        x = xs[r][...]
        g = gs[g_at][...] if parts[r] == 1 else gs[g_at][...] + gs[g_at + 1][...]
        g = g * s["gs"]
        old = [state_in[base + a][row, :] for a in range(arrays)] + [None] * (2 - arrays)
        xn, m, v = _elem(kind, s, x, g, *old)
        keep = s["ok"] == 0                 # a gate's skipped step: every value as it was
        xo[r][...] = jnp.where(keep, x, xn)
        for a, new in zip(range(arrays), (m, v)):
            state_out[base + a][row, :] = jnp.where(keep, old[a], new)
        if ema:
            avg = state_in[base + arrays][row, :]
            state_out[base + arrays][row, :] = jnp.where(keep, avg, s["d"] * avg + (1 - s["d"]) * xn)
        for c in range(mirrors[r]):
            mo[m_at + c][...] = jnp.where(keep, x, xn)
        g_at += parts[r]
        m_at += mirrors[r]


def call(kind: int, ema: bool, scalars: jax.Array, state: list, xs: list, gs: list, ms: list, sets: list,
         rows: list, in_place: bool) -> list:
    """optim._engine.fused's `_call` on a GPU: the same operands, the same results (the new state stacks, the new
    parameters, the new mirrors). The state stacks are always updated in place (XLA copies an operand that is
    still needed first): a call writes only its members' rows."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    shape = tuple(xs[0].shape)
    n = math.prod(shape)
    blk = block_of(n)
    flat_x = [x.reshape(n) for x in xs]
    flat_g = [g.reshape(n) for parts in gs for g in parts]
    flat_m = [y.reshape(n) for m in ms for y in m]
    flat_s = [a.reshape(a.shape[0], n) for a in state]
    ns = len(state) // (max(sets) + 1)
    member = pl.BlockSpec((blk,), lambda j: (j,))
    stack = lambda a: pl.BlockSpec((a.shape[0], blk), lambda j: (0, j))    # noqa: E731
    ins = [scalars, *flat_s, *flat_x, *flat_g, *flat_m]
    in_specs = [pl.BlockSpec(scalars.shape, lambda j: (0, 0)), *map(stack, flat_s),
                *[member] * (len(flat_x) + len(flat_g) + len(flat_m))]
    out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*flat_s, *flat_x, *flat_m)]
    out_specs = [*map(stack, flat_s), *[member] * (len(flat_x) + len(flat_m))]
    alias = {1 + j: j for j in range(len(flat_s))}
    if in_place:
        alias.update({1 + len(flat_s) + j: len(flat_s) + j for j in range(len(flat_x))})
        first_m = 1 + len(flat_s) + len(flat_x) + len(flat_g)
        alias.update({first_m + c: len(flat_s) + len(flat_x) + c for c in range(len(flat_m))})
    kernel = functools.partial(_kernel, kind=kind, ema=ema, ns=ns, sets=tuple(sets), rows=tuple(rows),
                               parts=tuple(len(p) for p in gs), mirrors=tuple(len(m) for m in ms),
                               n_state=len(flat_s))
    outs = pl.pallas_call(kernel, grid=(n // blk,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          input_output_aliases=alias, interpret=INTERPRET, name="optim_fused_step",
                          compiler_params=None if INTERPRET else plt.CompilerParams(num_warps=4))(*ins)
    ls, lx = len(flat_s), len(flat_x)
    return ([o.reshape(a.shape) for o, a in zip(outs[:ls], state)]
            + [o.reshape(shape) for o in outs[ls:ls + lx]] + [o.reshape(shape) for o in outs[ls + lx:]])

