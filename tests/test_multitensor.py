"""A group's one-pass float32 Adam step (optim._engine.multitensor): on the CPU it lowers to XLA's operations,
which must compute exactly what XLA's path computes without it; its Pallas kernel, run in interpret mode, against
XLA's path; how a member is laid out for the kernel; which requests it takes; vmap, a tie, a `None` gradient, a
derivative and export through it. What it compiles to on an H100 (one kernel a group, the bytes' floor) is in
`tests/test_gpu_kernels.py`."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from optim._base.cache import memoize
from optim._engine import fused, group, multitensor, onepass, stack

RULES = {
    "Adam": lambda: optim.Adam(1e-2),
    "AdamW": lambda: optim.AdamW(1e-2, weight_decay=0.3),
    "AdamW uncoupled": lambda: optim.AdamW(1e-2, weight_decay=1e-3, couple=False),
    "ClipGlobalNorm, AdamW": lambda: optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-2, weight_decay=0.3)),
    "Adam float32 moments named": lambda: optim.Adam(1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.float32),
}


@pytest.fixture(autouse=True)
def _grouped(monkeypatch):
    """XLA's path groups large parameters (as it does on a GPU); the fused CPU kernel, which would take these
    rules on the CPU, off."""
    monkeypatch.setattr(group, "MODE", "all")
    monkeypatch.setattr(fused, "ENABLED", False)


def _params():
    k = jax.random.split(jax.random.key(0), 6)
    # w0-w3: a group of 4 (16000 numbers: 125 rows of 128 for the kernel); u0-u1: a group of 2 that no power of
    # 2 of at least 128 divides (XLA's operations); b: small
    out = {f"w{i}": jax.random.normal(k[i], (100, 160)) for i in range(4)}
    out |= {f"u{i}": jax.random.normal(k[4 + i], (90, 101)) for i in range(2)}
    return out | {"b": jnp.linspace(-1.0, 1.0, 7)}


def _train(monkeypatch, rule, *, enabled, interpret=False, steps=4, none_at=None):
    monkeypatch.setattr(onepass, "ENABLED", enabled)
    monkeypatch.setattr(multitensor, "INTERPRET", interpret)
    params = _params()
    state = optim.setup(rule, params)
    for i in range(steps):
        g = jax.tree.map(lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(1), i), p.shape), params)
        if i == none_at:
            g["w1"] = None
        state, params = optim.update(state, params, g)
    return state, params


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _kernel_calls(monkeypatch) -> list:
    """The members of each kernel traced from now on (a fresh cache of the jitted kernels, so that each is traced
    here)."""
    calls = []
    real = multitensor._pallas
    monkeypatch.setattr(multitensor, "_pallas", lambda *a, **k: calls.append(k["n"]) or real(*a, **k))
    monkeypatch.setattr(multitensor, "_jitted_pallas", memoize(64)(multitensor._jitted_pallas.__wrapped__))
    return calls


@pytest.mark.parametrize("name", sorted(RULES))
def test_cpu_lowering_is_xla_s_path(monkeypatch, name):
    """On the CPU the group's primitive lowers to XLA's operations, arranged as XLA's path arranges a group's step:
    the same values, to the rounding of a product and a sum that XLA may contract in one program and not in the
    other (seen: one float32 ulp of a moment, in the step where a member's gradient is None)."""
    on = _train(monkeypatch, RULES[name](), enabled=True, none_at=2)
    off = _train(monkeypatch, RULES[name](), enabled=False, none_at=2)
    for a, b in zip(_leaves(on), _leaves(off)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(RULES))
def test_pallas_kernel_against_xla_s_path(monkeypatch, name):
    """The kernel in interpret mode, one call per group that steps (4 members, then 3 with a None gradient):
    the same operations, compiled otherwise (a product and a sum may be contracted): within a few float32 ulp."""
    calls = _kernel_calls(monkeypatch)
    got = _train(monkeypatch, RULES[name](), enabled=True, interpret=True, none_at=2)
    want = _train(monkeypatch, RULES[name](), enabled=False, none_at=2)
    assert sorted(calls) == [3, 4], calls          # the u group has no kernel shape: XLA's operations
    for a, b in zip(_leaves(got), _leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


def test_groups_of_one_shape_share_one_kernel(monkeypatch):
    """Four members under a bound of two a group: two groups of one shape, whose kernel is traced (and lowered,
    and compiled) once; the values are XLA's path's."""
    monkeypatch.setattr(stack, "ONE_KERNEL_MAX_ELEMENTS", 2 * 16000)
    calls = _kernel_calls(monkeypatch)
    got = _train(monkeypatch, optim.Adam(1e-2), enabled=True, interpret=True)
    want = _train(monkeypatch, optim.Adam(1e-2), enabled=False)
    layout = got[0].layout
    assert [len(s) for s in layout.stacks if layout.params[s[0]].shape == (100, 160)] == [2, 2]
    assert calls == [2], calls
    # the layouts differ (two groups against one): each parameter's value and state
    for a, b in zip(_leaves((got[1], got[0].param_states())), _leaves((want[1], want[0].param_states()))):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("size, want", [
    (160000, (625, 256)),       # 400 x 400: 2^8 divides it
    (16384, (128, 128)),        # 128 x 128: rows of 1024 would make 16 programs; 128 of 128
    (1 << 24, (16384, 1024)),
    (16000, (125, 128)),
    (9090, None),               # 2 divides it, no power of 2 of 128 or more
])
def test_kernel_shape(size, want):
    assert multitensor.kernel_shape(size) == want


def _refusal(rule, params, caplog):
    state = optim.setup(rule, params)
    with caplog.at_level(logging.DEBUG, logger="optim"):
        optim.update(state, params, params)
    return [r.getMessage() for r in caplog.records if onepass.ONE_PASS.name in r.getMessage()]


def test_refuses_float32_moments_without_a_group(caplog):
    """Alone, a large parameter's step is one pass on XLA's path already; small ones are stacks XLA steps whole."""
    got = _refusal(optim.Adam(1e-3), {"w": jnp.ones((100, 160)), "b": jnp.ones(7), "c": jnp.ones(7)}, caplog)
    assert got and "float32 moments and no group" in got[0], got


def test_refuses_bfloat16_moments(caplog):
    params = {f"w{i}": jnp.ones((100, 160)) for i in range(3)}
    got = _refusal(optim.Adam(1e-3, mu_dtype=jnp.bfloat16), params, caplog)
    assert got and "neither in one Quantized format nor in float32" in got[0], got


def test_vmap_of_update_equals_each_model(monkeypatch):
    """Under the user's vmap (3 models of a group of 3) the primitive is vmapped: XLA's operations."""
    monkeypatch.setattr(multitensor, "INTERPRET", True)
    rule = RULES["AdamW"]()
    keys = jax.random.split(jax.random.key(2), 6)
    params = {f"w{i}": jax.random.normal(keys[i], (3, 100, 160)) for i in range(3)}
    grads = {f"w{i}": jax.random.normal(keys[3 + i], (3, 100, 160)) for i in range(3)}
    row = lambda t, i: {k: v[i] for k, v in t.items()}     # noqa: E731
    one = [optim.setup(rule, row(params, i)) for i in range(3)]
    each = [optim.update(s, row(params, i), row(grads, i)) for i, s in enumerate(one)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *one)
    got_state, got = jax.vmap(optim.update)(stacked, params, grads)
    for i, (s, p) in enumerate(each):
        for k in p:
            np.testing.assert_allclose(got[k][i], p[k], rtol=2e-6, atol=1e-7)
        for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(s)):
            np.testing.assert_allclose(a[i], b, rtol=2e-6, atol=1e-7)


def test_tie_sums_gradients_and_writes_both_positions(monkeypatch):
    monkeypatch.setattr(multitensor, "INTERPRET", True)
    ws = [jax.random.normal(jax.random.key(4 + i), (100, 160)) for i in range(3)]
    model = {"a": ws[0], "b": ws[1], "c": ws[2], "head": ws[0]}
    state = optim.setup(optim.Adam(1e-2), model)
    grads = {k: jnp.full(w.shape, 0.25 * (i + 1)) for i, (k, w) in enumerate(model.items())}
    _, new = optim.update(state, model, grads)
    alone = optim.setup(optim.Adam(1e-2), {"a": ws[0]})
    _, want = optim.update(alone, {"a": ws[0]}, {"a": grads["a"] + grads["head"]})
    np.testing.assert_allclose(new["a"], want["a"], rtol=2e-6)
    np.testing.assert_array_equal(new["head"], new["a"])


def test_derivative_through_the_step(monkeypatch):
    """A derivative with respect to the learning rate goes through XLA's operations: as without the strategy."""
    params = {f"w{i}": jax.random.normal(jax.random.key(7 + i), (100, 160)) for i in range(3)}

    def loss(lr):
        state = optim.adjust(optim.setup(optim.Adam(1e-2), params), lr=lr)
        _, new = optim.update(state, params, params)
        return sum(jnp.sum(x * x) for x in jax.tree.leaves(new))

    got = jax.grad(loss)(jnp.float32(1e-2))
    monkeypatch.setattr(onepass, "ENABLED", False)
    want = jax.grad(loss)(jnp.float32(1e-2))
    assert got == want and got != 0


def test_export_lowers_xla_s_operations():
    params = {f"w{i}": jnp.full((100, 160), 1.0 + i) for i in range(3)}
    state = optim.setup(optim.AdamW(1e-3), params)
    exp = jax.export.export(jax.jit(optim.update), platforms=("cpu", "cuda"))(state, params, params)
    assert "tt.func" not in exp.mlir_module() and "stablehlo.custom_call" not in exp.mlir_module()
    _, got = exp.call(state, params, params)
    _, want = optim.update(state, params, params)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
