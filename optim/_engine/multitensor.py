"""The one-pass step of a group of float32 Adam or AdamW parameters: one Pallas kernel for all its members on the
GPU, XLA's operations elsewhere.

A group (optim._engine.group) stores its members' moments as one stack each. On XLA's path its step takes two
passes over the state: one kernel reads the gradients (through their concatenation) and the stacked moments and
writes the new moments, then each member's own kernel reads its parameter and its rows of the new moments back
and writes the new parameter: 36 bytes a parameter where one pass moves 28 (XLA fuses a kernel's outputs only
where they have one shape, and a member's parameter has not the stack's). This kernel is that one pass: each
program reads a range of every member's parameter, gradient and moments rows once, steps them and writes them;
the parameters and the stacks are updated in place.

Three primitives carry the step from the rule to the kernel:

- `adam_p(x, g, m, v, s)`: one parameter's step (Adam's arithmetic, `_step`), bound by the one-pass rules'
  `apply` (optim._engine.onepass) where the moments are float32 arrays;
- `group_p`, the same on a stack: what `adam_p` becomes under the `vmap` of XLA's path over a stack;
- `multi_p(*xs, *gs, m, v, s)`: the step of a group whose parameters and gradients are its members' own arrays
  and whose moments are the stacks. XLA's path evaluates a group's step member by member (optim._engine.members),
  and there `group_p` becomes `multi_p`: the members' arrays are read where they are, not through their stack.

`multi_p` lowers to the kernel for one CUDA device (not `jax.export`); anywhere else, and `group_p` and `adam_p`
everywhere, to XLA's operations, which compute what XLA's path computes without these primitives.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from . import members as _members_eval
from .backend import own_kernel_may_run
from .stack import STACK_MAX_SIZE
from .._base.cache import memoize
from .strategies import switch
from .._rules.protocol import abs2

__all__ = ["adam", "adam_p", "group_p", "multi_p", "kernel_shape", "INTERPRET"]

# Lowered for CPU: the Pallas kernel in interpret mode, not XLA's operations (tests). Read when traced (a
# parameter of `multi_p`): a program traced with one value is not lowered with the other.
INTERPRET = False
LANES_MIN = 128         # the numbers of a member a program steps at least (a row of the kernel's blocks)
LANES_MAX = 1024        # and at most
PROGRAMS = 512          # the programs a kernel launches at least, where its members allow (an H100 has 132 SMs)


def _step(adamw: bool, couple: bool, x, g, m, v, s):
    """Adam's or AdamW's new parameter and moments, operation by operation as their `apply`
    (optim._rules.adam), with `s` the scalars (β₁, β₂, c₁, c₂, ε, η, λ, γ) and `γ g` the gradient (γ:
    `ClipGlobalNorm`'s factor in a chain, which the clip would otherwise write as a gradient of its own)."""
    b1, b2, c1, c2, eps, lr, wd, gs = s
    g = g * gs
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * abs2(g)
    a = m * c1 / (jnp.sqrt(v * c2) + eps)
    if not adamw:
        step = a * lr
    else:
        step = lr * (a + wd * x) if couple else lr * a + wd * x
    return x - step, m, v


def _scalars(s) -> tuple:
    return tuple(s[..., i] for i in range(8))


# ------------------------------------------------------------------------------------------------ the kernel
def kernel_shape(size: int) -> tuple[int, int] | None:
    """How the kernel sees a member of `size` numbers: `(rows, lanes)`, a row a program, `lanes` the largest
    power of 2 up to `LANES_MAX` that divides `size` (Triton's blocks are powers of 2, and its loads are not
    bounded by the array), made smaller while the grid has fewer than `PROGRAMS` programs; None where no power of
    2 of at least `LANES_MIN` divides `size` (XLA's operations then)."""
    lanes = math.gcd(size, LANES_MAX)
    if lanes < LANES_MIN:
        return None
    while lanes > LANES_MIN and size // lanes < PROGRAMS:
        lanes //= 2
    return size // lanes, lanes


def _kernel(*refs, n: int, adamw: bool, couple: bool):
    """One program: row `i` of every member, read once and written once."""
    s_ref, xs, gs, m_ref, v_ref = refs[0], refs[1:1 + n], refs[1 + n:1 + 2 * n], refs[1 + 2 * n], refs[2 + 2 * n]
    outs = refs[3 + 2 * n:]
    xo, mo, vo = outs[:n], outs[n], outs[n + 1]
    for k in range(n):
        s = tuple(s_ref[k, j] for j in range(8))
        xo[k][...], mo[k], vo[k] = _step(adamw, couple, xs[k][...], gs[k][...], m_ref[k], v_ref[k], s)


def _pallas(*args, n: int, adamw: bool, couple: bool, interpret: bool = False):
    """The kernel over the members' rows, a program a row of every member; the members' parameters and the
    stacks updated in place. Compiling it takes time that grows with the square of the members (a program holds
    each one's step): such a group holds at most `ONE_KERNEL_MAX_ELEMENTS` numbers (optim._engine.stack)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    xs, gs, m, v, s = args[:n], args[n:2 * n], args[2 * n], args[2 * n + 1], args[2 * n + 2]
    shape = xs[0].shape
    rows, lanes = kernel_shape(math.prod(shape))
    row = pl.BlockSpec((1, lanes), lambda i: (i, 0))
    stacked = pl.BlockSpec((n, 1, lanes), lambda i: (0, i, 0))
    height = 1 << max(3, (n - 1).bit_length())       # the scalars' block: powers of 2
    scalars = jnp.zeros((height, 8), jnp.float32).at[:n].set(s.astype(jnp.float32))
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)     # noqa: E731
    ins = [scalars, *(a.reshape(rows, lanes) for a in (*xs, *gs)), m.reshape(n, rows, lanes),
           v.reshape(n, rows, lanes)]
    out = pl.pallas_call(
        functools.partial(_kernel, n=n, adamw=adamw, couple=couple), grid=(rows,),
        in_specs=[pl.BlockSpec((height, 8), lambda i: (0, 0)), *[row] * (2 * n), stacked, stacked],
        out_specs=[*[row] * n, stacked, stacked],
        out_shape=[*(like(a) for a in ins[1:1 + n]), like(ins[-2]), like(ins[-1])],
        input_output_aliases={**{1 + j: j for j in range(n)}, 1 + 2 * n: n, 2 + 2 * n: n + 1},
        interpret=interpret, name=f"optim_adam_members{n}",
        compiler_params=None if interpret else plt.CompilerParams(num_warps=4),
    )(*ins)
    return [*(o.reshape(shape) for o in out[:n]), out[n].reshape(m.shape), out[n + 1].reshape(v.shape)]


# ------------------------------------------------------------------------------------------------ XLA's operations
def _one(x, g, m, v, s, *, adamw: bool, couple: bool):
    return list(_step(adamw, couple, x, g, m, v, _scalars(s)))


def _group(x, g, m, v, s, *, adamw: bool, couple: bool):
    return list(jax.vmap(functools.partial(_one, adamw=adamw, couple=couple))(x, g, m, v, s))


def _members(*args, n: int, adamw: bool, couple: bool, interpret: bool = False):
    """`multi_p` in XLA's operations, arranged as XLA's path arranges a group's step (optim._engine.members): the
    moments and Adam's direction on the stacks, each new parameter from its own array and its row of them."""
    xs, gs, m, v, s = args[:n], args[n:2 * n], args[2 * n], args[2 * n + 1], args[2 * n + 2]
    b1, b2, c1, c2, eps, lr, wd, scale = (s[:, i].reshape((n,) + (1,) * (m.ndim - 1)) for i in range(8))
    g = jnp.stack(gs) * scale
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * abs2(g)
    a = m * c1 / (jnp.sqrt(v * c2) + eps)
    if not adamw:
        step = a * lr
        new = [x - step[k] for k, x in enumerate(xs)]
    elif couple:
        new = [x - lr[k] * (a[k] + wd[k] * x) for k, x in enumerate(xs)]
    else:
        new = [x - (lr[k] * a[k] + wd[k] * x) for k, x in enumerate(xs)]
    return [*new, m, v]


# ------------------------------------------------------------------------------------------------ primitives
adam_p = jcore.Primitive("optim_adam_one_pass")
group_p = jcore.Primitive("optim_adam_group")
multi_p = jcore.Primitive("optim_adam_members")
for _p in (adam_p, group_p, multi_p):
    _p.multiple_results = True


def adam(x, g, m, v, s, *, adamw: bool, couple: bool) -> tuple:
    """One parameter's step: `(new x, new m, new v)` from float32 `x`, `g`, `m`, `v` and the scalars `s`
    (β₁, β₂, c₁, c₂, ε, η, λ, γ: `_step`); a group's one pass where XLA's path steps a group (see the module)."""
    return tuple(adam_p.bind(x, g, m, v, s, adamw=adamw, couple=couple))


def _like(*avals, **params):
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in (avals[0], avals[2], avals[3])]


def _multi_abstract(*avals, n: int, **params):
    return [jax.core.ShapedArray(a.shape, a.dtype) for a in (*avals[:n], avals[2 * n], avals[2 * n + 1])]


@memoize(64)
def _jitted_pallas(n: int, adamw: bool, couple: bool, interpret: bool) -> Callable:
    """The kernel, jitted: one function object per kind, so that a program's groups of one shape share one
    traced jaxpr, which JAX lowers once (Pallas' lowering takes seconds for a large group) and XLA compiles once."""
    def kernel(*args):
        return _pallas(*args, n=n, adamw=adamw, couple=couple, interpret=interpret)
    return jax.jit(kernel)


def _lower_multi(on_cuda: bool):
    def rule(ctx, *args, interpret: bool, **params):
        # Small members (a stack of biases) stay on XLA's operations: the kernel's compile grows with the square
        # of its members, and a stack of small ones holds up to 64
        size = math.prod(ctx.avals_in[0].shape)
        fits = size > STACK_MAX_SIZE and kernel_shape(size) is not None
        if fits and (own_kernel_may_run(ctx) if on_cuda else interpret):
            fn = _jitted_pallas(params["n"], params["adamw"], params["couple"], not on_cuda)
        else:
            fn = functools.partial(_members, **params)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return rule


def _batch_one(args, dims, **params):
    n = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (n, *a.shape))
            for a, d in zip(args, dims)]
    return group_p.bind(*args, **params), [0] * 3


def _batch_group(args, dims, **params):
    """A vmap over groups (the user's): XLA's operations, vmapped."""
    return list(jax.vmap(functools.partial(_group, **params), in_axes=tuple(dims))(*args)), [0] * 3


def _batch_multi(args, dims, n: int, interpret: bool, **params):
    return list(jax.vmap(functools.partial(_members, n=n, **params), in_axes=tuple(dims))(*args)), [0] * (n + 2)


def _jvp(fn):
    def rule(primals, tangents, **params):
        dots = tuple(ad.instantiate_zeros(t) for t in tangents)
        out, dout = jax.jvp(functools.partial(fn, **params), tuple(primals), dots)
        return list(out), list(dout)
    return rule


for _p, _fn, _abs, _batch in ((adam_p, _one, _like, _batch_one), (group_p, _group, _like, _batch_group),
                              (multi_p, _members, _multi_abstract, _batch_multi)):
    _p.def_impl(functools.partial(lambda fn, *a, **k: jax.jit(functools.partial(fn, **k))(*a), _fn))
    _p.def_abstract_eval(_abs)
    batching.primitive_batchers[_p] = _batch
    ad.primitive_jvps[_p] = _jvp(_fn)
mlir.register_lowering(adam_p, mlir.lower_fun(_one, multiple_results=True))
mlir.register_lowering(group_p, mlir.lower_fun(_group, multiple_results=True))
mlir.register_lowering(multi_p, _lower_multi(False))
mlir.register_lowering(multi_p, _lower_multi(True), platform="cuda")


def _memberwise(ins: list, **params) -> list:
    """`group_p` where XLA's path evaluates a group member by member (optim._engine.members): `multi_p` on the
    members' parameters and gradients (a member's row of a stacked gradient: a slice of the stack's
    concatenation, which XLA folds into the member's own array), the stacked moments and scalars."""
    x, g, m, v, s = ins
    n = len(x.members) if x.members is not None else x.shape[0]
    out = multi_p.bind(*(x.member(k) for k in range(n)), *(g.member(k) for k in range(n)), m.stacked(),
                       v.stacked(), s.stacked(), n=n, interpret=INTERPRET, **params)
    return [_members_eval._Value(None, tuple(out[:n]), x.shape), _members_eval._Value(out[n]),
            _members_eval._Value(out[n + 1])]


_members_eval.MEMBERWISE[group_p.name] = _memberwise
switch(sys.modules[__name__], "INTERPRET")
