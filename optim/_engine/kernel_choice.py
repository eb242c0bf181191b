"""`kernel_or_xla`: optim's CPU kernel where the program will run it, XLA's code everywhere else.

Which code a parameter's step runs is decided when the program is lowered, not when it is traced: only then is
the target known. A program lowered for CPU to run in a process gets the kernel (optim/_engine/fused.cc, an XLA
custom call that optim registers when it is imported); one lowered for GPU or TPU (`.lower(lowering_platforms=
("cuda",))`, ahead-of-time compilation for another machine) or by `jax.export`, for any platform, gets XLA's
code: a custom call runs only where its library is loaded, and `jax.export` accepts only custom calls with a
stability guarantee. Lowered for several platforms at once, each platform gets its own branch.

The kernel is traced when `kernel_or_xla` is called, XLA's code only where it is lowered (for another platform,
for export) or differentiated: a CPU program pays for tracing one of the two. Both must return the same
structure. Under `vmap` both are vmapped and the choice stays open; differentiated (a meta-gradient through
`update`), the kernel's derivative is that of XLA's code (the kernel has none).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax._src import dispatch                            # apply_primitive: the eager call of a primitive
from jax._src.interpreters import partial_eval as pe     # convert_constvars_jaxpr: no public spelling
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

__all__ = ["kernel_or_xla"]

_choice_p = jcore.Primitive("optim_kernel_or_xla")
_choice_p.multiple_results = True


def kernel_or_xla(kernel: Callable, xla: Callable, *args: Any) -> Any:
    """`kernel(*args)` in a program lowered for CPU outside `jax.export`, else `xla(*args)` (see the module).

    `kernel` is traced now; `xla` only where it is lowered or differentiated (a CPU program never traces it), so
    it must return what `kernel` returns, and must not keep the objects it closes over alive (the traced program
    keeps it: reach them through a weak reference)."""
    flat, in_tree = jax.tree_util.tree_flatten(args)
    k, k_shape = jax.make_jaxpr(lambda *a: kernel(*jax.tree_util.tree_unflatten(in_tree, a)),
                                return_shape=True)(*flat)
    if k.effects:
        raise AssertionError("kernel_or_xla: the kernel must be pure")
    out_tree = jax.tree_util.tree_structure(k_shape)
    # The kernel's constants (arrays it closes over, perhaps tracers of an enclosing trace) become operands.
    outs = _choice_p.bind(*k.consts, *flat, kernel=_open(k), xla=_Flat(xla, in_tree, out_tree), n_consts=len(k.consts))
    return jax.tree_util.tree_unflatten(out_tree, outs)


class _Flat:
    """`xla` on flat operands, returning flat results checked against the kernel's tree (a primitive's parameter:
    hashed and compared by identity)."""

    def __init__(self, fn: Callable, in_tree: Any, out_tree: Any):
        self.fn, self.in_tree, self.out_tree = fn, in_tree, out_tree

    def __call__(self, *flat: Any) -> list:
        out = self.fn(*jax.tree_util.tree_unflatten(self.in_tree, flat))
        leaves, tree = jax.tree_util.tree_flatten(out)
        if tree != self.out_tree:
            raise AssertionError(f"kernel_or_xla: XLA's code returns {tree}, the kernel {self.out_tree}")
        return leaves


def _open(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    return jcore.ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ())


def _lowering(on_cpu: bool) -> Callable:
    def rule(ctx, *args, kernel, xla, n_consts):
        # jax.export lowers with `for_export`: an exported program must not need optim's library.
        if on_cpu and not ctx.module_context.lowering_parameters.for_export:
            return _inline(ctx, kernel, args)
        return mlir.lower_fun(xla)(ctx.replace(avals_in=ctx.avals_in[n_consts:]), *args[n_consts:])
    return rule


def _inline(ctx: Any, closed: jcore.ClosedJaxpr, args: tuple) -> Any:
    """The kernel's jaxpr lowered in place, as it was traced (`lower_fun` would trace it a second time)."""
    out, tokens = mlir.jaxpr_subcomp(ctx.module_context, closed.jaxpr, ctx.name_stack, ctx.tokens_in, (), *args,
                                     dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering,
                                     outer_traceback=None)
    ctx.set_tokens_out(tokens)
    return out


def _jvp(primals, tangents, *, kernel, xla, n_consts):
    dots = tuple(ad.instantiate_zeros(t) for t in tangents[n_consts:])
    return jax.jvp(xla, tuple(primals[n_consts:]), dots)


def _batch(args, dims, *, kernel, xla, n_consts):
    axes = tuple(dims)     # an operand without a batch axis has None (batching.NotMapped), as vmap takes it
    k_fun = jax.vmap(jcore.jaxpr_as_fun(kernel), in_axes=axes)
    x_fun = jax.vmap(xla, in_axes=axes[n_consts:])
    outs = kernel_or_xla(lambda *a: k_fun(*a), lambda *a: x_fun(*a[n_consts:]), *args)
    return outs, [0] * len(outs)


_choice_p.def_impl(functools.partial(dispatch.apply_primitive, _choice_p))
_choice_p.def_abstract_eval(lambda *avals, kernel, xla, n_consts: kernel.out_avals)
mlir.register_lowering(_choice_p, _lowering(False))
mlir.register_lowering(_choice_p, _lowering(True), platform="cpu")
ad.primitive_jvps[_choice_p] = _jvp
batching.primitive_batchers[_choice_p] = _batch
