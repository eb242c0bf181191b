"""The one-pass quantised Adam step (optim._engine.onepass; q8 and q4): on the CPU without the fused kernel it
lowers to XLA's operations, which must compute exactly what XLA's path computes without it; the fused CPU kernel's
step and its Pallas kernel, run in interpret mode, against XLA's path; which requests it takes and why it refuses
the others; vmap, a tie, a `None` gradient, a derivative and export through it. What it compiles to on an H100 (one
kernel a parameter, the bytes' floor) is in `tests/test_gpu_kernels.py`."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from optim._engine import fused, onepass

Q8 = dict(mu_dtype=optim.q8, nu_dtype=optim.q8)
Q4 = dict(mu_dtype=optim.q4, nu_dtype=optim.q4)
RULES = {
    "Adam": lambda: optim.Adam(1e-2, **Q8),
    "AdamW": lambda: optim.AdamW(1e-2, weight_decay=0.3, **Q8),
    "AdamW uncoupled": lambda: optim.AdamW(1e-2, weight_decay=1e-3, couple=False, **Q8),
    "Adam q4": lambda: optim.Adam(1e-2, **Q4),
    "AdamW q4": lambda: optim.AdamW(1e-2, weight_decay=0.3, **Q4),
    "AdamW q4 block 64": lambda: optim.AdamW(1e-2, mu_dtype=optim.Quantized(4, 64), nu_dtype=optim.Quantized(4, 64)),
    "ClipGlobalNorm, AdamW": lambda: optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-2, weight_decay=0.3, **Q8)),
}
Q96 = optim.Quantized(8, 96)    # not a power of 2: no Triton block of it, XLA's path


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    # w: 64 blocks of 256 (4 programs of the kernel); r: 66 blocks (33 programs of 2); u: 5000 numbers, not a whole
    # number of blocks (XLA's path); b: too small to be quantised
    return {"w": jax.random.normal(k[0], (64, 256)), "r": jax.random.normal(k[1], (33, 512)),
            "u": jax.random.normal(k[2], (100, 50)), "b": jnp.linspace(-1.0, 1.0, 7)}


def _grads(params, i):
    return jax.tree.map(lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(1), i), p.shape), params)


def _train(monkeypatch, rule, *, enabled, interpret=False, steps=4, none_at=None):
    monkeypatch.setattr(onepass, "ENABLED", enabled)
    monkeypatch.setattr(onepass, "INTERPRET", interpret)
    params = _params()
    state = optim.setup(rule, params)
    for i in range(steps):
        g = _grads(params, i)
        if i == none_at:
            g["w"] = None
        state, params = optim.update(state, params, g)
    return state, params


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _assert_near(got, want):
    """A kernel's (state, params) against XLA's path's: parameters within a few float32 ulp (XLA may contract a
    product and a sum, a kernel compiled otherwise may not), codes within one code."""
    (s1, p1), (s0, p0) = got, want
    for k in p0:
        np.testing.assert_allclose(p1[k], p0[k], rtol=1e-6, atol=1e-7)
    for a, b in zip(_leaves(s1), _leaves(s0)):
        if a.dtype == np.uint8:
            assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("name", sorted(RULES))
def test_cpu_lowering_is_xla_s_path_bitwise(monkeypatch, name):
    """Without the fused CPU kernel the primitive lowers to `reference`: XLA's own operations, the same bits."""
    monkeypatch.setattr(fused, "ENABLED", False)
    on = _train(monkeypatch, RULES[name](), enabled=True, none_at=2)
    off = _train(monkeypatch, RULES[name](), enabled=False, none_at=2)
    for a, b in zip(_leaves(on), _leaves(off)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("name", sorted(RULES))
def test_pallas_kernel_against_xla_s_path(monkeypatch, name):
    """The kernel in interpret mode: the same operations, compiled differently (another CPU may contract a
    product and a sum differently): parameters within a few float32 ulp, codes within one code."""
    calls = []
    real = onepass._pallas
    monkeypatch.setattr(onepass, "_pallas", lambda *a, **k: calls.append(k) or real(*a, **k))
    (s1, p1) = _train(monkeypatch, RULES[name](), enabled=True, interpret=True)
    (s0, p0) = _train(monkeypatch, RULES[name](), enabled=False)
    assert len(calls) == 2          # w and r, traced once
    _assert_near((s1, p1), (s0, p0))


@pytest.mark.skipif(not fused.AVAILABLE, reason="the fused CPU kernel is not built")
@pytest.mark.parametrize("name", sorted(RULES))
def test_cpu_kernel_against_xla_s_path(monkeypatch, name):
    """The fused CPU kernel's one-pass step (fused_quantized.cc) on one CPU device: the kernel's own arithmetic,
    uncontracted, where XLA may contract a product and a sum: parameters within a few float32 ulp, codes within
    one code; a None gradient leaves the state as it was."""
    monkeypatch.setattr(onepass, "ENABLED", True)
    monkeypatch.setattr(onepass, "INTERPRET", False)
    params = _params()
    state = optim.setup(RULES[name](), params)
    lowered = jax.jit(lambda s, m, g: optim.update(s, m, g)).lower(state, params, _grads(params, 0)).as_text()
    assert lowered.count("custom_call @optim_adam_quantized") == 2       # w and r; u and b on XLA's path
    (s1, p1) = _train(monkeypatch, RULES[name](), enabled=True, none_at=2)
    (s0, p0) = _train(monkeypatch, RULES[name](), enabled=False, none_at=2)
    _assert_near((s1, p1), (s0, p0))


@pytest.mark.skipif(not fused.AVAILABLE, reason="the fused CPU kernel is not built")
def test_cpu_kernel_steps_parameters_of_one_shape_each_alone(monkeypatch):
    """With the fused kernel on, `setup` stacks the large parameters of the rules it runs; not those of a rule with
    quantised moments, which it refuses: each takes its own call instead of XLA's code on a stack."""
    monkeypatch.setattr(onepass, "ENABLED", True)
    params = {f"w{i}": jax.random.normal(jax.random.key(i), (64, 256)) for i in range(4)}
    state = optim.setup(RULES["ClipGlobalNorm, AdamW"](), params)
    lowered = jax.jit(lambda s, m, g: optim.update(s, m, g)).lower(state, params, params).as_text()
    assert lowered.count("custom_call @optim_adam_quantized") == 4


@pytest.mark.skipif(not fused.AVAILABLE, reason="the fused CPU kernel is not built")
def test_cpu_kernel_copies_nothing(monkeypatch):
    """Donated, the step copies no array: the parameter, the codes and the scales are updated in their own
    buffers (reached through the state stack's squeeze, they would be copied in and out by XLA:CPU)."""
    monkeypatch.setattr(onepass, "ENABLED", True)
    params = {"w": jax.random.normal(jax.random.key(0), (64, 256))}
    state = optim.setup(RULES["AdamW"](), params)
    step = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))
    state, params = step(state, params, _grads(params, 0))      # the state on the device
    compiled = step.lower(state, params, _grads(params, 1)).compile().as_text()
    entry = compiled[compiled.index("ENTRY"):]
    assert entry.count("custom-call(") == 1
    copies = [line for line in entry.splitlines() if re.search(r"\bcopy\(|copy_fusion|copy\.\d+ =", line)]
    sizes = [np.prod([int(d) for d in re.search(r"= \w+\[([\d,]*)\]", c).group(1).split(",") if d]) for c in copies]
    assert max(sizes, default=0) < 64, copies       # a few scalars (the step's count) are
    pointers = {a.unsafe_buffer_pointer() for a in jax.tree.leaves((state, params))
                if isinstance(a, jax.Array) and a.size >= 64}
    state, params = step(state, params, _grads(params, 1))
    assert {a.unsafe_buffer_pointer() for a in jax.tree.leaves((state, params))
            if isinstance(a, jax.Array) and a.size >= 64} == pointers


@pytest.mark.parametrize("blocks, rows", [(64, 16), (66, 2), (33, 1), (16, 16), (48, 16), (24, 8)])
def test_programs_cover_the_blocks_exactly(blocks, rows):
    """No partial program: on a GPU a Triton load past the parameter's end is not masked."""
    assert onepass.rows_per_program(blocks) == rows and blocks % rows == 0


def test_a_block_of_96_numbers_takes_xla_s_path(monkeypatch):
    calls = []
    monkeypatch.setattr(onepass, "onepass", lambda *a, **k: calls.append(k))
    params = {"w": jnp.ones((96, 64))}
    state = optim.setup(optim.Adam(1e-3, mu_dtype=Q96, nu_dtype=Q96), params)
    optim.update(state, params, params)
    assert not calls


def _refusal(rule, params, grads, caplog, *extra):
    state = optim.setup(rule, params)
    with caplog.at_level(logging.DEBUG, logger="optim"):
        optim.update(state, params, grads, *extra)
    return [r.getMessage() for r in caplog.records if onepass.ONE_PASS.name in r.getMessage()]


@pytest.mark.parametrize("rule, why", [
    (optim.NAdam(1e-3, **Q8), "its rule is not Adam or AdamW"),
    (optim.chain(optim.Scale(0.5), optim.Adam(1e-3, **Q8)), "its rule is not Adam or AdamW"),
    (optim.chain(optim.ClipGlobalNorm(1.0), optim.Adam(1e-3, **Q8), optim.Scale(0.5)), "its rule is not Adam"),
    (optim.Adam(1e-3, mu_dtype=optim.q8, nu_dtype=optim.q4), "neither in one Quantized format"),
    (optim.Adam(1e-3, mu_dtype=optim.q8), "neither in one Quantized format"),
    (optim.Adam(1e-3, mu_dtype=optim.q8, nu_dtype=optim.Quantized(8, 128)), "neither in one Quantized format"),
])
def test_refusals(caplog, rule, why):
    params = {"w": jnp.ones((64, 256))}
    got = _refusal(rule, params, params, caplog)
    assert got and why in got[0], got


def test_refuses_two_gradient_trees(caplog):
    params = {"w": jnp.ones((64, 256))}
    got = _refusal(optim.Adam(1e-3, **Q8), params, params, caplog, params)
    assert got and "2 gradient trees" in got[0], got


def test_refuses_a_group_of_quantised_parameters(monkeypatch, caplog):
    from optim._engine import group
    monkeypatch.setattr(group, "MODE", "all")
    params = {f"w{i}": jnp.ones((64, 256)) for i in range(3)}
    got = _refusal(optim.Adam(1e-3, **Q8), params, params, caplog)
    assert got and "a group of parameters with quantised moments" in got[0], got


def test_vmap_of_update_equals_each_model(monkeypatch):
    """Under the user's vmap the primitive sees a batch of 3 models: XLA's operations, vmapped (the fused CPU
    kernel off, which each model alone would take: an ulp apart, `test_cpu_kernel_against_xla_s_path`)."""
    monkeypatch.setattr(fused, "ENABLED", False)
    rule = RULES["AdamW"]()
    params = {"w": jax.random.normal(jax.random.key(2), (3, 64, 256))}
    grads = {"w": jax.random.normal(jax.random.key(3), (3, 64, 256))}
    one = [optim.setup(rule, {"w": params["w"][i]}) for i in range(3)]
    each = [optim.update(s, {"w": params["w"][i]}, {"w": grads["w"][i]}) for i, s in enumerate(one)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *one)
    got_state, got = jax.vmap(optim.update)(stacked, params, grads)
    for i, (s, p) in enumerate(each):
        np.testing.assert_array_equal(got["w"][i], p["w"])
        for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(s)):
            np.testing.assert_array_equal(a[i], b)


def test_tie_sums_gradients_and_writes_both_positions():
    w = jax.random.normal(jax.random.key(4), (64, 256))
    model = {"emb": w, "head": w}
    state = optim.setup(optim.Adam(1e-2, **Q8), model)
    g1, g2 = jnp.full(w.shape, 0.5), jnp.full(w.shape, -0.25)
    state, new = optim.update(state, model, {"emb": g1, "head": g2})
    alone = optim.setup(optim.Adam(1e-2, **Q8), {"emb": w})
    _, want = optim.update(alone, {"emb": w}, {"emb": g1 + g2})
    np.testing.assert_array_equal(new["emb"], want["emb"])
    np.testing.assert_array_equal(new["head"], want["emb"])


def test_derivative_through_the_step(monkeypatch):
    """A derivative with respect to the learning rate goes through XLA's operations (the kernel has none): the
    same as without the strategy."""
    w = jax.random.normal(jax.random.key(5), (64, 256))
    g = jax.random.normal(jax.random.key(6), (64, 256))

    def loss(lr):
        state = optim.adjust(optim.setup(optim.Adam(1e-2, **Q8), w), lr=lr)
        _, new = optim.update(state, w, g)
        return jnp.sum(new * new)

    got = jax.grad(loss)(jnp.float32(1e-2))
    monkeypatch.setattr(onepass, "ENABLED", False)
    want = jax.grad(loss)(jnp.float32(1e-2))
    assert got == want and got != 0


def test_export_lowers_xla_s_operations():
    w = jnp.ones((64, 256))
    state = optim.setup(optim.AdamW(1e-3, **Q8), w)
    exp = jax.export.export(jax.jit(optim.update), platforms=("cpu", "cuda"))(state, w, w)
    assert "stablehlo.custom_call" not in exp.mlir_module()
    _, got = exp.call(state, w, w)
    _, want = optim.update(state, w, w)
    np.testing.assert_array_equal(got, want)
