"""optim's fused CPU kernel (`optim._engine.fused`, `optim/_engine/fused.cc`): the same numbers as XLA's path, in
one pass.

The reference is the rules' own JAX code (`_fused.ENABLED = False`), compared to a few ulp of each array's scale
(the kernel does not contract multiply-adds where XLA does). Every case checks that the kernel really ran (its
custom call is in the program). `make test` builds the kernel (`pip install -e .` compiles it), so a missing
kernel is a failure here, not a skip.
"""

import functools
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from bench.program import entry_counts
from optim._engine import backend as _backend
from optim._engine import fused as _fused
from optim._engine import fused_kinds as _kinds
from optim._engine import pack as _pack
from rule_cases import RULES as REGISTRY, table
# The model (ties, single and multi-member stacks, a scalar) and gradients (None at a single stack, a row, half a
# tie) of tests/test_pack.py, and its comparison to a few ulp of each array's scale.
from tests.test_pack import BIG, assert_ulp, grads_at, model


def test_kernel_is_built_and_loaded():
    assert _fused.AVAILABLE, _fused.WHY
    assert _fused.ENABLED


def train(rule, dtype=jnp.float32, steps=3, fused=True, jit=False, monkeypatch=None):
    monkeypatch.setattr(_fused, "ENABLED", fused)
    m = model(dtype)
    state = optim.freeze(optim.setup(rule, m), "big.2")
    upd = jax.jit(lambda s, m, g: optim.update(s, m, g)) if jit else optim.update   # a fresh function per run
    for t in range(steps):
        state, m = upd(state, m, grads_at(t, m))
    return state, m


def uses_kernel(rule, dtype=jnp.float32) -> bool:
    m = model(dtype)
    text = jax.jit(lambda s, m, g: optim.update(s, m, g)).lower(optim.setup(rule, m), m, grads_at(0, m)).as_text()
    return "optim_fused" in text


# The kernel's configurations, from the registry (`rule_cases.py`): each rule's `kernel` cases (the rules the kernel
# runs, and the wrappers and chains it runs them in).
KERNEL = {c.id: c for c in table("kernel")}
RULES = {name: c.make() for name, c in KERNEL.items()}


def test_every_rule_the_kernel_runs_has_kernel_cases():
    """A rule class that declares a formula the kernel has a kind for (`Rule._formula`, its own class's:
    `protocol.formula_of`) has `kernel` cases in its registry entry, and every case really runs the kernel
    (`test_fused_equals_xla`)."""
    runs = {r.cls for r in REGISTRY if r.cls.__dict__.get("_formula") in _kinds._KINDS}
    assert runs and runs <= {r.cls for r in REGISTRY if r.kernel}, sorted(c.__name__ for c in runs)


@pytest.mark.parametrize("name", list(RULES))
def test_fused_equals_xla(name, monkeypatch):
    rule = RULES[name]
    state, m = train(rule, monkeypatch=monkeypatch)
    assert uses_kernel(rule)
    want_state, want = train(rule, fused=False, monkeypatch=monkeypatch)
    assert_ulp(m, want)
    # per parameter (the stacks differ)
    assert_ulp(optim.state_dict(state), optim.state_dict(want_state), ulps=KERNEL[name].state_ulps)
    assert m["emb"] is m["head"]
    np.testing.assert_array_equal(m["big"][2], model()["big"][2])       # frozen


@pytest.mark.parametrize("mu_dtype", [None, jnp.bfloat16], ids=["float32", "bfloat16 m"])
def test_fused_radam(mu_dtype, monkeypatch):
    """RAdam's step is `η m̂` until ρ > 4, then rectified: with β₂ = 0.9 from the fifth step (ρ = 4.58), so 7
    steps run both branches; its step number t is a packed leaf the kernel's call advances with the powers."""
    rule = optim.RAdam(0.01, beta=(0.9, 0.9), mu_dtype=mu_dtype)
    assert uses_kernel(rule)
    state, m = train(rule, steps=7, monkeypatch=monkeypatch)
    want_state, want = train(rule, steps=7, fused=False, monkeypatch=monkeypatch)
    assert_ulp(m, want, ulps=8)
    assert_ulp(optim.state_dict(state), optim.state_dict(want_state), ulps=16)
    assert int(state["mat"].state.t) == 8


def nan_at(t, m):
    """`grads_at`, with a NaN in one matrix gradient at step 1 and an Inf in a tied one at step 3."""
    g = grads_at(t, m)
    if t == 1:
        g["mat"] = g["mat"].at[3, 4].set(jnp.nan)
    if t == 3:
        g["head"] = g["head"].at[-1].set(-jnp.inf)
    return g


_SKIP_REFERENCE: dict = {}     # (rule, dtype) -> XLA's path's five eager steps


# float32 in the three modes; bfloat16 beside (eager) and in place (jit): donating eagerly runs the same in-place
# loops as the jit.
@pytest.mark.parametrize("dtype, mode", [(jnp.float32, "eager"), (jnp.float32, "donate"), (jnp.float32, "jit"),
                                         (jnp.bfloat16, "eager"), (jnp.bfloat16, "jit")],
                         ids=["float32-eager", "float32-donate", "float32-jit", "bfloat16-eager", "bfloat16-jit"])
@pytest.mark.parametrize("name", ["SkipNonFinite(AdamW)", "EMA(SkipNonFinite(chain(ClipGlobalNorm, Lion, Scale)))",
                                  "SkipNonFinite(SkipLargeUpdates(EMA(Momentum)))", "SkipNonFinite(EMA(AMSGrad))",
                                  "SkipNonFinite(RAdam)"])
def test_skipped_steps(name, dtype, mode, monkeypatch):
    """A step with a NaN or an Inf gradient anywhere is skipped by the kernel as by XLA's path: every parameter,
    tie and state (moments, powers, averages) keeps its value, and the skipped steps are counted, whether the
    kernel writes in place (donated, or inside a jit) or beside its inputs (eager, not donated). XLA's path runs
    once per rule and dtype, eagerly: the reference for the kernel in every mode."""
    rule = RULES[name]

    def run(fused, mode):
        monkeypatch.setattr(_fused, "ENABLED", fused)
        m = model(dtype)
        state = optim.freeze(optim.setup(rule, m), "big.2")
        step = jax.jit(lambda s, m, g: optim.update(s, m, g)) if mode == "jit" else functools.partial(
            optim.update, donate=mode == "donate")
        out = []
        for t in range(5):
            state, m = step(state, m, nan_at(t, m))
            out.append((jax.tree.map(np.asarray, m), jax.tree.map(np.asarray, optim.state_dict(state))))
        return out

    key = (name, jnp.dtype(dtype).name)
    if key not in _SKIP_REFERENCE:
        _SKIP_REFERENCE[key] = run(False, "eager")
    want = _SKIP_REFERENCE[key]
    got = run(True, mode)
    assert uses_kernel(rule, dtype)
    for (m, st), (wm, wst) in zip(got, want):
        assert_ulp(m, wm, ulps=2 if dtype == jnp.bfloat16 else 4)
        # The counters exactly. The gradients are functions of the parameter (cos(a (t + 1))), so by the fifth
        # step a parameter's few-ulp difference (contracted multiply-adds) reaches the moments 5x: measured 5.5
        # ulp of AMSGrad's m.
        assert_ulp(st, wst, ulps=8 if "AMSGrad" in name else 4)
    for t in (1, 3):       # the skipped steps change no parameter and no floating state, bitwise
        for a, b in zip(jax.tree.leaves(got[t]), jax.tree.leaves(got[t - 1]), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_array_equal(a, b)
    counts = {jax.tree_util.keystr(k): int(v) for k, v in jax.tree_util.tree_leaves_with_path(got[-1][1])
              if jax.tree_util.keystr(k).endswith(".skipped")}    # SkipNonFinite's (SkipLargeUpdates': ['skipped'])
    # Both skips counted where the parameter stepped both times (big.1 had no gradient at step 1, big.2 is frozen).
    assert [v for k, v in counts.items() if "'mat'" in k or "'emb'" in k] == [2, 2], counts


def test_centred_rmsprop_with_an_overflowing_square_agrees_with_xla(monkeypatch):
    """A finite 1e30 gradient: q = ρq + (1-ρ)g² overflows to Inf, and so does l². XLA contracts q - l² into one
    multiply-add (Inf, a 0 step); the kernel's plain difference was Inf - Inf, a NaN parameter. A NaN or an Inf
    gradient still gives NaN in both."""
    m = {"w": jnp.ones((300,))}
    grads = [{"w": jnp.full((300,), 0.1).at[3].set(1e30)}, {"w": jnp.full((300,), 0.1)},
             {"w": jnp.full((300,), 0.1).at[5].set(jnp.inf)}]

    def run(fused):
        monkeypatch.setattr(_fused, "ENABLED", fused)
        st, mm, out = optim.setup(optim.RMSProp(0.01, centred=True), m), m, []
        for g in grads:
            st, mm = optim.update(st, mm, g)
            out.append(np.asarray(mm["w"]))
        return out

    got, want = run(True), run(False)
    assert np.isfinite(got[0]).all() and got[0][3] == 1.0 and np.isfinite(got[1]).all()
    assert np.isnan(got[2][5]) and np.isnan(want[2][5])
    for a, b in zip(got, want):
        assert_ulp(a, b)


@pytest.mark.parametrize("rule", [
    optim.SkipNonFinite(optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(0.01, weight_decay=0.1))),
    optim.SkipNonFinite(optim.EMA(optim.chain(optim.ClipGlobalNorm(1.0), optim.Adam(0.01)), decay=0.9))],
    ids=["SkipNonFinite(chain(ClipGlobalNorm, AdamW))", "SkipNonFinite(EMA(chain(ClipGlobalNorm, Adam)))"])
def test_skip_reads_the_clip_norm(rule, monkeypatch):
    """Around a chain that clips, SkipNonFinite's question is answered by the clip's norm: a finite norm means
    finite gradients, and only an Inf or NaN norm runs the kernel's own check (inside a conditional, not on every
    step). So a finite gradient whose square overflows (1e20: the norm is Inf) still steps, a NaN or an Inf is
    still skipped, as on XLA's path."""
    m = {"w": jnp.ones((300,)), "v": jnp.ones((4, 5))}
    state = optim.setup(rule, m)
    step = jax.jit(lambda s, m, g: optim.update(s, m, g))
    text = step.lower(state, m, m).compile().as_text()
    entry = text[text.index("ENTRY"):]
    assert "optim_finite" in text and "optim_finite" not in entry.split("\n\n")[0], "the check runs every step"
    assert "optim_fused" in text
    steps = [{"w": jnp.full((300,), 0.1), "v": jnp.full((4, 5), -0.2)},
             {"w": jnp.full((300,), 0.1).at[7].set(1e20), "v": jnp.full((4, 5), -0.2)},   # finite, norm Inf
             {"w": jnp.full((300,), 0.1), "v": jnp.full((4, 5), -0.2).at[1, 2].set(jnp.nan)},
             {"w": jnp.full((300,), 0.1).at[0].set(-jnp.inf), "v": jnp.full((4, 5), -0.2)}]

    def run(fused):
        monkeypatch.setattr(_fused, "ENABLED", fused)
        st, mm, out = optim.setup(rule, m), m, []
        f = jax.jit(lambda s, m, g: optim.update(s, m, g))
        for g in steps:
            st, mm = f(st, mm, g)
            out.append((jax.tree.map(np.asarray, mm), optim.state_dict(st)))
        return out

    got, want = run(True), run(False)
    for (a, sa), (b, sb) in zip(got, want):
        assert_ulp(a, b)
        assert_ulp(sa, sb)
    assert not np.array_equal(got[1][0]["w"], got[0][0]["w"])     # the overflowing step was taken
    for t in (2, 3):                                                # the NaN and the Inf steps were not
        for a, b in zip(jax.tree.leaves(got[t][0]), jax.tree.leaves(got[t - 1][0])):
            np.testing.assert_array_equal(a, b)


def test_finite_check():
    """`optim_finite`, SkipNonFinite's question: one Inf, -Inf or NaN anywhere, in float32 or bfloat16, in any
    thread's part of a large array, is found; finite extremes are finite."""
    check = jax.jit(lambda *a: jax.ffi.ffi_call("optim_finite", jax.ShapeDtypeStruct((), jnp.float32))(*a))
    big = jnp.full((1 << 20,), 3e38, jnp.float32)
    small = jnp.full((7,), -3e38, jnp.float32).astype(jnp.bfloat16)
    assert float(check(big, small)) == 1
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        for at in (0, 1 << 19, (1 << 20) - 1):
            assert float(check(big.at[at].set(bad), small)) == 0, (bad, at)
        assert float(check(big, small.at[6].set(bad))) == 0
    assert float(check(jnp.zeros(0), small)) == 1


@pytest.mark.parametrize("name", ["Adam", "Lion", "EMA(AdamW)", "chain(Adam, Scale)", "AdaBelief", "AMSGrad", "RAdam",
                                  "ADOPT", "AdEMAMix"])
def test_fused_bfloat16_parameters(name, monkeypatch):
    rule = RULES[name]
    state, m = train(rule, jnp.bfloat16, jit=True, monkeypatch=monkeypatch)
    assert uses_kernel(rule, jnp.bfloat16)
    want_state, want = train(rule, jnp.bfloat16, fused=False, jit=True, monkeypatch=monkeypatch)
    assert_ulp(m, want, ulps=2)
    assert_ulp(optim.state_dict(state), optim.state_dict(want_state))   # per parameter (the stacks differ)


def test_centred_rmsprop_with_bfloat16_moments_runs_on_xla_s_path(monkeypatch, caplog):
    """Stored in bfloat16 (a bfloat16 parameter's default, or `mu_dtype` / `nu_dtype`), centred RMSProp's state
    holds the variance, which the kernel does not compute: it steps aside, saying why, and the step is XLA's."""
    import logging
    rule = optim.RMSProp(0.01, centred=True)
    assert not uses_kernel(rule, jnp.bfloat16)
    assert uses_kernel(rule, jnp.float32)
    stored = optim.RMSProp(0.01, centred=True, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="optim"):
        assert not uses_kernel(stored)
    assert "centred RMSProp with a moment stored in bfloat16" in caplog.text
    state, m = train(stored, jnp.float32, jit=True, monkeypatch=monkeypatch)
    want_state, want = train(stored, jnp.float32, fused=False, jit=True, monkeypatch=monkeypatch)
    assert_ulp(m, want, ulps=2)
    assert_ulp(optim.state_dict(state), optim.state_dict(want_state))   # per parameter (the stacks differ)


def test_inputs_untouched_without_donation():
    m = model()
    before = jax.tree.map(np.array, m)
    state = optim.setup(optim.Adam(0.1), m)
    moments = jax.tree.map(np.array, state.stacks)
    new_state, new = optim.update(state, m, grads_at(0, m))
    for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(state.stacks), jax.tree.leaves(moments), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(new["mat"], before["mat"])


def test_donated_step_runs_in_place():
    """A user-jitted, donated Adam step on 4 parameters of 16k floats, one of them tied at three positions: one
    kernel call for all four (their moments are separate stacks, one set each), which also writes the tie's new
    value into the other two positions' donated buffers; no copy of a parameter's or a moment's array (the one
    copy is of the pack of bias-correction products, 4 x 2 numbers). XLA's path compiles 17 fusions (optax: 15)."""
    m = {f"w{i}": jnp.ones(16384) * (i + 1) for i in range(4)}
    m["t1"] = m["t2"] = m["w0"]
    g = jax.tree.map(lambda a: a * 0.1, m)
    state = optim.setup(optim.Adam(1e-3), m)
    want_state, want = optim.update(state, m, g)
    m = {k: v if k == "w0" else jnp.array(v) for k, v in m.items()}   # distinct buffers: each is donated
    f = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))
    compiled = f.lower(state, m, g).compile()
    text = compiled.as_text()
    c = entry_counts(text)
    assert text.count('custom_call_target="optim_fused"') == 1
    # fusions: the step counter, β, the pack's new products of the β's, their corrections (which read them)
    assert c["copies"] <= 1 and c["fusions"] <= 5
    assert all("f32[4,2]" in line for line in text[text.index("ENTRY"):].splitlines() if " copy(" in line)
    assert text.count("may-alias") == len(jax.tree.leaves((state, m)))     # every output reuses its input
    new_state, new = compiled(state, m, g)
    for k in ("w0", "t1", "t2", "w3"):
        np.testing.assert_array_equal(new[k], want["w0" if k[0] == "t" else k])
    assert_ulp(optim.state_dict(new_state), optim.state_dict(want_state), ulps=0)


def test_tied_positions_in_a_jit_that_does_not_donate():
    """Without donation, the tied positions the kernel writes are copies XLA makes first: the inputs keep their
    values, and every position holds the new value."""
    m = model()
    m["tail"] = m["emb"]
    before = jax.tree.map(np.array, m)
    state = optim.setup(optim.Adam(0.1), m)
    g = grads_at(0, m)
    _, want = optim.update(state, m, g)
    _, new = jax.jit(lambda s, m, g: optim.update(s, m, g))(state, m, g)
    for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    for k in ("emb", "head", "tail"):
        np.testing.assert_array_equal(new[k], want["emb"])


def test_vmap_runs_each_member(monkeypatch):
    """Under `vmap` (a batch of models), the kernel runs once per batch entry (`vmap_method="sequential"`)."""
    m = {"w": jnp.ones(BIG), "v": jnp.ones((3, 4))}
    batch = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), m)
    g = jax.tree.map(lambda a: jnp.stack([a * 0.1, -a]), m)
    states = jax.tree.map(lambda a: jnp.stack([a, a]), optim.setup(optim.Adam(0.1), m))

    def run():
        return jax.vmap(lambda s, x, d: optim.update(s, x, d))(states, batch, g)

    got = run()
    monkeypatch.setattr(_fused, "ENABLED", False)
    want = run()
    assert_ulp(got[1], want[1])
    assert_ulp(got[0].stacks, want[0].stacks)


def test_cpu_program_is_the_kernel_alone(monkeypatch):
    """The choice between the kernel and XLA's path is made at lowering (optim._engine.kernel_choice; the other
    platforms are tests/test_export.py): lowered for the CPU, the program has the kernel and no conditional,
    whatever other backends the process has, with the same numbers."""
    monkeypatch.setattr(_backend, "_ONLY_CPU", False)
    m = model()
    state = optim.setup(optim.Adam(0.1), m)
    f = jax.jit(lambda s, m, g: optim.update(s, m, g))
    text = f.lower(state, m, grads_at(0, m)).compile().as_text()
    assert "optim_fused" in text and "conditional" not in text
    got = f(state, m, grads_at(0, m))
    monkeypatch.setattr(_fused, "ENABLED", False)
    assert_ulp(got, optim.update(state, m, grads_at(0, m)))


@pytest.mark.parametrize("inner", [optim.Descent(0.1), optim.Momentum(0.1), optim.Adam(0.01)],
                         ids=["Descent", "Momentum", "Adam"])
def test_clip_factor_of_a_mixed_precision_model(inner, monkeypatch):
    """`chain(ClipGlobalNorm, rule)` on bfloat16 matrices and float32 norms (the bfloat16 one first): one float32
    factor scales every parameter, in the kernel as in XLA's path (the kernel used to round it to the first
    parameter's dtype: 3e-3 relative on the float32 parameter's Descent step)."""
    m = {"a": jnp.ones((64, 64), jnp.bfloat16), "n": jnp.full((BIG,), 0.5, jnp.float32)}
    g = {"a": jnp.full((64, 64), 0.37, jnp.bfloat16), "n": jnp.linspace(-1, 1, BIG, dtype=jnp.float32)}
    rule = optim.chain(optim.ClipGlobalNorm(0.3), inner)
    assert uses_kernel_on(rule, m, g)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(_fused, "ENABLED", fused)
        state, new = optim.update(optim.setup(rule, m), m, g)
        runs.append(new)
    np.testing.assert_allclose(runs[0]["n"], runs[1]["n"], rtol=2e-7)
    np.testing.assert_array_equal(runs[0]["a"], runs[1]["a"])
    if isinstance(inner, optim.Descent):      # the factor itself, from numpy in float64
        norm = np.sqrt(np.sum(np.float64(g["a"].astype(jnp.float32)) ** 2) + np.sum(np.float64(g["n"]) ** 2))
        want = 0.5 - 0.1 * np.float64(g["n"]) * 0.3 / norm
        np.testing.assert_allclose(runs[0]["n"], want, rtol=1e-6)


def uses_kernel_on(rule, m, g) -> bool:
    return "optim_fused" in jax.jit(lambda s, m, g: optim.update(s, m, g)).lower(optim.setup(rule, m), m, g).as_text()


def test_not_used_where_it_does_not_apply(monkeypatch):
    assert not uses_kernel(optim.AdaGrad(0.01))                                # another rule
    assert not uses_kernel(optim.chain(optim.ClipNorm(1.0), optim.Adam(0.01)))     # another chain
    assert not uses_kernel(optim.chain(optim.Scale(0.5), optim.Adam(0.01)))       # a Scale before the rule
    assert not uses_kernel(optim.chain(optim.Adam(0.01), optim.Scale(0.5), optim.Scale(2.0)))
    assert not uses_kernel(optim.EMA(optim.EMA(optim.Adam(0.01))))                 # two averages
    assert not uses_kernel(optim.chain(optim.AccumGrad(2), optim.Adam(0.01)))
    assert not uses_kernel(optim.SkipNonFinite(optim.chain(optim.ClipGlobalNorm(1.0), optim.SkipNonFinite(
        optim.Adam(0.01)))))                                                        # a gate inside a chain
    x = {"w": jnp.ones(BIG, jnp.float16)}
    assert "optim_fused" not in jax.jit(optim.update).lower(optim.setup(optim.Adam(0.1), x), x, x).as_text()
    monkeypatch.setattr(_fused, "ENABLED", False)
    assert not uses_kernel(optim.Adam(0.01))


@pytest.mark.parametrize("name", ["Adam", "RAdam", "AdEMAMix", "EMA(AdaBelief)", "SkipNonFinite(AdamW)"])
def test_a_parameter_shaped_like_the_powers_runs_in_the_kernel(name, monkeypatch):
    """A 2-element parameter is shaped like the Adam family's powers `bt` = (β₁ᵗ, β₂ᵗ). The state declares `bt`
    small (`bt: Small`, `optim.fields`), so it is packed whatever the parameter's shape, and every stack of the
    rule runs in the kernel (`bt` was stored per stack for `b`, and the kernel refused the whole rule)."""
    rule = RULES[name]
    m0 = {"a": jnp.asarray([0.5, -1.0, 2.0]), "b": jnp.asarray([0.25, -0.75])}
    assert uses_kernel_on(rule, m0, m0)

    def run(fused):
        monkeypatch.setattr(_fused, "ENABLED", fused)
        state, m = optim.setup(rule, m0), m0
        for t in range(3):
            state, m = optim.update(state, m, jax.tree.map(lambda a: jnp.cos(a * (t + 1)) + 0.1 * t, m))
        return state, m

    state, m = run(True)
    want_state, want = run(False)
    assert_ulp(m, want)
    assert_ulp(optim.state_dict(state), optim.state_dict(want_state), ulps=KERNEL[name].state_ulps)


def test_a_two_element_parameter_leaves_the_large_ones_in_the_kernel(monkeypatch, caplog):
    """Issue 50 item 4: a model of large matrices and one 2-element parameter under Adam. The small parameter's
    `bt` has its shape; it is declared small, so it is packed, and the kernel takes every stack of the rule, the
    matrices included (judged by shape, `bt` was stored per stack and the kernel refused the whole rule: the
    matrices went to XLA's path)."""
    key = iter(jax.random.split(jax.random.key(0), 3))
    m0 = {"w": jax.random.normal(next(key), (96, 80)), "v": jax.random.normal(next(key), (48, 130)),
          "b": jnp.asarray([0.25, -0.75])}
    g = jax.tree.map(lambda a: jnp.cos(3 * a), m0)

    def refusals():
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="optim"):
            used = uses_kernel_on(optim.Adam(0.01), m0, g)
        return used, [r.getMessage() for r in caplog.records if "fused CPU kernel does not run" in r.getMessage()]

    assert refusals() == (True, [])
    state = optim.setup(optim.Adam(0.01), m0)
    assert all(isinstance(st.bt, _pack.Packed) for st in state.stored)    # the 2-element one's bt too

    def run(fused):
        monkeypatch.setattr(_fused, "ENABLED", fused)
        s, m = optim.setup(optim.Adam(0.01), m0), m0
        for t in range(3):
            s, m = optim.update(s, m, jax.tree.map(lambda a: a * (t + 1), g))
        return m

    assert_ulp(run(True), run(False))
    monkeypatch.setattr(_fused, "ENABLED", True)

    # The failure it fixes: judged by its shape, the 2-element parameter's bt is not packed, and the kernel
    # refuses the whole rule, saying why.
    monkeypatch.setattr(_pack, "small_fields", lambda cls: ())
    used, why = refusals()
    assert not used and any(".bt is not packed (it is float32[1, 2]" in w for w in why), why


def test_each_refusal_names_its_cause(monkeypatch, caplog):
    """The kernel's refusals of a stack's state each say what is wrong (they shared "a state of another
    structure"): a tree that is not the rule's wrappers around its state, a core state of other leaves, an array
    where the kernel reads a packed leaf or the reverse, a gate's own state that is not numbers per parameter."""
    # A state that does not declare its small leaves: a bt shaped like the parameter is not packed (pack.py's
    # fallback), and the debug log names the leaf.
    monkeypatch.setattr(_pack, "small_fields", lambda cls: ())
    m = {"a": jnp.ones(3), "b": jnp.ones(2), "only_here_undeclared": jnp.ones(13)}
    with caplog.at_level(logging.DEBUG, logger="optim"):
        optim.update(optim.setup(optim.Adam(0.01), m), m, m)
    assert any("optim's fused CPU kernel does not run Adam here: Adam's small state leaf .bt is not packed (it is "
               "float32[1, 2]" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    monkeypatch.undo()

    requests = []
    refuse = _fused.KERNEL.refuse
    monkeypatch.setattr(_fused.KERNEL, "refuse", lambda r: requests.append(r) or refuse(r))
    m = {"only_here_refusals": jnp.ones(17)}
    optim.update(optim.setup(optim.SkipNonFinite(optim.Adam(0.01)), m), m, m)
    (req,) = requests
    (st,) = req.stored                       # SkipNonFiniteState(AdamState(mu, nu, bt), skipped)
    assert refuse(req) is None and isinstance(st.inner.bt, _pack.Packed)

    def why(tree):
        return refuse(req._replace(stored=(tree,)))

    inner = st.inner
    reasons = [
        why(None),
        why(st._replace(inner=(*inner, inner.mu))),
        why(st._replace(inner=inner._replace(mu=inner.bt))),
        why(st._replace(inner=inner._replace(bt=jnp.ones((1, 2))))),
        why(st._replace(skipped=jnp.zeros((1, 100), jnp.int32))),
    ]
    assert reasons == [
        "a state tree that is not the nesting of the rule's wrappers and chain (its structure is not the rule's "
        "init's)",
        "Adam's state has 4 leaves where the kernel reads 2 arrays and 1 packed small leaves",
        "Adam's state leaf .mu is packed where the kernel reads an array",
        "Adam's small state leaf .bt is not packed (it is float32[1, 2]; a stack stored as it is: batch axes, or a "
        "state whose small leaves are not declared)",
        "SkipNonFinite's own state leaf is not a few numbers per parameter (it is int32[1, 100] for a stack of 1)",
    ]


def test_environment_variable_turns_it_off():
    code = ("import jax, jax.numpy as jnp, optim; from optim._engine import fused as _fused; x = jnp.ones(3); "
            "t = jax.jit(optim.update).lower(optim.setup(optim.Adam(), x), x, x).as_text(); "
            "print(_fused.ENABLED, 'optim_fused' in t)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OPTIM_FUSED": "0"}, capture_output=True,
                         text=True, timeout=600)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_matches_optax_adam():
    """The kernel's Adam is optax's (to float32 rounding: optim computes `1 - β` in float32)."""
    m = {"w": jnp.linspace(-1, 1, BIG), "b": jnp.linspace(0, 2, 7)}
    state, tx = optim.setup(optim.Adam(0.01), m), optax.adam(0.01)
    p, s = m, tx.init(m)
    for t in range(4):
        g = jax.tree.map(lambda a: jnp.sin(a * (t + 1)), m)
        state, m = optim.update(state, m, g)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
    for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_large_parameters_of_kernel_rules_are_stacked(monkeypatch):
    """The kernel reads each member where it is, so `setup` stacks the states of large parameters too (up to 64
    per stack) for the rules it runs: 100 leaves of 16k floats are 2 stacks, not 100 (fewer arrays in and out of
    every step). Other rules, and the kernel turned off, keep large parameters alone."""
    m = {f"w{i}": jnp.full((128, 128), float(i)) for i in range(100)}
    assert [len(g) for g in optim.setup(optim.AdamW(0.1), m).layout.stacks] == [64, 36]
    assert len(optim.setup(optim.AdaGrad(0.1), m).layout.stacks) == 100
    split = optim.adjust(optim.setup(optim.Adam(0.1), m), "w1", lr=0.5)     # w1's own rule: adjust restacks
    assert sorted(len(g) for g in split.layout.stacks) == [1, 35, 64]
    monkeypatch.setattr(_fused, "ENABLED", False)
    assert len(optim.setup(optim.Adam(0.1), m).layout.stacks) == 100


def test_in_place_and_beside_agree():
    """Eagerly without donation the kernel writes beside its inputs (rows that do not step are copied over);
    donating, or inside a jit, it updates in place. Same kernel, same numbers: bitwise."""
    def run(mode):
        m = model()
        state = optim.freeze(optim.setup(optim.Adam(0.01), m), "big.2")
        step = jax.jit(lambda s, m, g: optim.update(s, m, g)) if mode == "jit" else functools.partial(
            optim.update, donate=mode == "donate")
        for t in range(3):
            state, m = step(state, m, grads_at(t, m))
        return optim.state_dict(state), m

    want = run("beside")
    for mode in ("donate", "jit"):
        for a, b in zip(jax.tree.leaves(run(mode)), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


_ISA_RUN = r"""
import sys, numpy as np, jax, jax.numpy as jnp, optim
from optim._engine import fused
assert fused.AVAILABLE, fused.WHY
rules = {
    "adamw": optim.AdamW(0.01, weight_decay=0.1),
    "adam bf16": optim.Adam(0.01, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
    "nadam": optim.NAdam(0.01),
    "adabelief bf16": optim.AdaBelief(0.01, mu_dtype=jnp.bfloat16),
    "rmsprop centred": optim.RMSProp(0.01, centred=True),
    "amsgrad bf16 nu": optim.AMSGrad(0.01, nu_dtype=jnp.bfloat16),
    "radam": optim.RAdam(0.01, beta=(0.9, 0.9)),
    "adopt nesterov": optim.ADOPT(0.01, nesterov=True),
    "ademamix": optim.AdEMAMix(0.01, weight_decay=0.1),
    "lion": optim.Lion(0.01),
    "ema(momentum)": optim.EMA(optim.Momentum(0.01, mu_dtype=jnp.bfloat16), decay=0.9),
    "clip adamw scale": optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(0.01, weight_decay=0.1, couple=False),
                                    optim.Scale(0.5)),
}
rng = np.random.default_rng(0)
# Sizes that are not multiples of any vector width (the loops' tails), and gradients from 1e-22 to 1e3 (the
# smallest square below float32's normal range).
shapes = [(37,), (5, 41), (3, 999)]
out = {}
for name, rule in rules.items():
    for dtype in (jnp.float32, jnp.bfloat16):
        m = {f"p{i}": jnp.asarray(rng.standard_normal(s), dtype) for i, s in enumerate(shapes)}
        state = optim.setup(rule, m)
        step = jax.jit(lambda s, m, g: optim.update(s, m, g))
        scale = {k: 10.0 ** rng.integers(-22, 4, v.shape) for k, v in m.items()}   # per element, every step
        for t in range(4):
            g = {k: jnp.asarray(rng.standard_normal(v.shape) * scale[k], dtype) for k, v in m.items()}
            state, m = step(state, m, g)
        leaves = jax.tree.leaves((m, optim.state_dict(state)))
        for j, a in enumerate(leaves):
            out[f"{name} {jnp.dtype(dtype).name} {j}"] = np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16
                                                                     else a)
# The one-pass step of quantised moments (fused_quantized.inc): float32 parameters of whole blocks, 8 and 4 bits.
quantised = {
    "adamw q8": optim.AdamW(0.01, weight_decay=0.1, mu_dtype=optim.q8, nu_dtype=optim.q8),
    "adam q4": optim.Adam(0.01, mu_dtype=optim.q4, nu_dtype=optim.q4),
    "clip adamw q8": optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(0.01, mu_dtype=optim.q8, nu_dtype=optim.q8)),
    "adamw uncoupled q4": optim.AdamW(0.01, weight_decay=0.1, couple=False, mu_dtype=optim.q4, nu_dtype=optim.q4),
}
for name, rule in quantised.items():
    m = {"w": jnp.asarray(rng.standard_normal((40, 256)), jnp.float32)}
    state = optim.setup(rule, m)
    step = jax.jit(lambda s, m, g: optim.update(s, m, g))
    scale = 10.0 ** rng.integers(-22, 4, (40, 256))
    for t in range(4):
        state, m = step(state, m, {"w": jnp.asarray(rng.standard_normal((40, 256)) * scale, jnp.float32)})
    for j, a in enumerate(jax.tree.leaves((m, optim.state_dict(state)))):
        out[f"{name} {j}"] = np.asarray(a)
np.savez(sys.argv[1], **out)
print(fused.WHY)
"""


def test_instruction_set_builds_compute_the_same_bits(tmp_path):
    """The kernel's element loops are compiled for the baseline x86-64, AVX2 and AVX-512 and the best the CPU has
    runs (`OPTIM_FUSED_ISA` caps it): each build, on sizes with loop tails and gradients from 1e-22 to 1e3, gives
    the same bits in every parameter and state array (no contracted multiply-add). Subnormals are flushed by all
    alike: the kernel runs on XLA's CPU threads, which set flush-to-zero, as XLA's own loops see it."""
    script = tmp_path / "run.py"
    script.write_text(_ISA_RUN)
    runs, names = {}, {}
    for isa in ("baseline", "avx2", "avx512"):
        # The work tree's optim first on the path: `make test-min-jax` runs this suite where optim is not installed.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, OPTIM_FUSED_ISA=isa, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        done = subprocess.run([sys.executable, str(script), str(tmp_path / f"{isa}.npz")], env=env,
                              capture_output=True, text=True, timeout=900, cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        names[isa] = done.stdout.strip().rsplit(", ", 1)[-1]
        runs[isa] = dict(np.load(tmp_path / f"{isa}.npz"))
    assert names["baseline"] == "baseline x86-64 loops", names
    ran = {n for n in names.values()}
    assert len(ran) >= 2 or names["avx2"] == "baseline x86-64 loops", names   # a CPU without AVX2 has one build
    base = runs["baseline"]
    for isa in ("avx2", "avx512"):
        assert runs[isa].keys() == base.keys()
        for k in base:
            np.testing.assert_array_equal(runs[isa][k], base[k], err_msg=f"{isa} {k}")


def test_instruction_set_builds_share_no_standard_template():
    """The loops are compiled once per instruction set in files of their own (fused.cc, fused_avx2.cc,
    fused_avx512.cc, each with its `#pragma GCC target`). A standard template they instantiated would be
    instantiated under each pragma, and the linker keeps one copy for all: the baseline build could then call
    AVX-512 code. So the loops call the standard library only for `std::memcpy` and `std::sqrt` (plain functions,
    defined before the pragma), and every build includes fused.h before its pragma."""
    engine = Path(optim.__file__).parent / "_engine"
    for loops in ("fused_loops.inc", "fused_quantized.inc"):     # the second: the one-pass quantised step's
        code = "\n".join(line.split("//")[0] for line in engine.joinpath(loops).read_text().splitlines())
        assert set(re.findall(r"std::\w+", code)) <= {"std::memcpy", "std::sqrt"}, loops
        assert "#include" not in code   # what the loops use comes from fused.h, before the pragma
    for name in ("fused_avx2.cc", "fused_avx512.cc"):
        text = engine.joinpath(name).read_text()
        assert (text.index('#include "fused.h"') < text.index("#pragma GCC target") < text.index('"fused_loops.inc"')
                < text.index('"fused_quantized.inc"'))
    base = engine.joinpath("fused.cc").read_text()
    assert "#pragma GCC target" not in base
    assert base.index('#include "fused.h"') < base.index('"fused_loops.inc"') < base.index('"fused_quantized.inc"')
