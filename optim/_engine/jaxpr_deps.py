"""Data dependencies through a jaxpr: which inputs each output depends on.

`output_deps(jaxpr, labels)` gives every input a set of labels and returns, for each output, the union of the
labels of the inputs it is computed from. It follows the data through nested jaxprs (jit, custom-derivative
calls, remat, ...), both branches of a `cond` (plus its index) and `while` / `scan` loops (iterated to a fixed
point). A primitive it does not know is taken to make each output depend on all its inputs, so the answer can
only over-approximate. Nothing is compiled or run. `optim/_interop/optax_probe.py` uses it to see whether an optax
transformation mixes the arrays of a tree.
"""

from __future__ import annotations

from typing import Any

__all__ = ["output_deps"]


def output_deps(jaxpr: Any, ins: list) -> list:
    """Data dependencies through a jaxpr: the labels of each output given the labels of each input."""
    from jax.extend import core as jcore

    env: dict = {}

    def read(v):
        return frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())

    for v, lab in zip(jaxpr.invars, ins):
        env[v] = lab
    for eqn in jaxpr.eqns:
        outs = _eqn_deps(eqn, [read(v) for v in eqn.invars])
        for v, lab in zip(eqn.outvars, outs):
            env[v] = lab
    return [read(v) for v in jaxpr.outvars]


def _union(labels) -> frozenset:
    out: frozenset = frozenset()
    for lab in labels:
        out = out | lab
    return out


def _closed(j: Any) -> Any:
    """The jaxpr inside a `ClosedJaxpr`; anything else as it is."""
    return j.jaxpr if hasattr(j, "jaxpr") and hasattr(j, "consts") else j


def _eqn_deps(eqn: Any, ins: list) -> list:
    """The labels of one equation's outputs given the labels of its inputs."""
    name, params, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if name == "cond":                       # operands: index, *args; every branch may run
        outs = [frozenset()] * n_out
        for br in params["branches"]:
            outs = [o | d for o, d in zip(outs, output_deps(_closed(br), ins[1:]))]
        return [o | ins[0] for o in outs]
    if name == "while":
        cj, bj = _closed(params["cond_jaxpr"]), _closed(params["body_jaxpr"])
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = ins[:nc], ins[nc:nc + nb], list(ins[nc + nb:])
        for _ in range(len(carry) + 2):       # labels only grow: a fixed point within len(carry) + 1 rounds
            pred = output_deps(cj, cconsts + carry)[0]
            new = [c | d | pred for c, d in zip(carry, output_deps(bj, bconsts + carry))]
            if new == carry:
                break
            carry = new
        return carry
    if name == "scan":
        body, nc, nk = _closed(params["jaxpr"]), params["num_consts"], params["num_carry"]
        consts, carry, xs = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
        for _ in range(len(carry) + 2):
            out = output_deps(body, consts + carry + xs)
            new = [c | d for c, d in zip(carry, out[:nk])]
            if new == carry:
                break
            carry = new
        return carry + out[nk:]
    for v in params.values():               # jit, custom_jvp / custom_vjp calls, remat, closed_call, ...
        j = _closed(v)
        if hasattr(j, "invars") and hasattr(j, "eqns") and len(j.invars) == len(ins) and len(j.outvars) == n_out:
            return output_deps(j, ins)
    return [_union(ins)] * n_out            # an ordinary primitive (or an unknown one: conservatively all)
