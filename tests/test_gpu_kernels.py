"""Kernel counts and bytes moved of a jitted update step compiled for an H100 by XLA's deviceless compile (no GPU:
`bench.kernels`), with XLA's path grouping large parameters (optim._engine.group; `OPTIM_GROUP=all`, since this
process has no GPU backend). Needs jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 of the installed
jax's version: `make test-gpu-kernels` installs them in `.venv-gpu` and runs this file (CI does, after `make test`);
elsewhere it is skipped.

The bounds are what the engine reaches now, so that a change that gives kernels or bytes back fails; issue 38's
targets (at most 12 kernels for every workload below on both sizes, Muon 40) are not all met: see `bench/NOTES.md`;
nor are the bytes' (optax's + 2%: `test_step_bytes_target`, an expected failure)."""

import functools
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="the CUDA plugin (make test-gpu-kernels) is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import optim  # noqa: E402
from optim._engine import group as _group  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kernels as K  # noqa: E402

ADAMW = dict(weight_decay=0.1)
# workload: (rule, bound on 100 leaves of 400x400, bound on 1000 leaves of 128x128); before grouping the first
# were 93, 94, 103, 296, 300, 302 (and 985 on 1000 leaves for Adam); the 1000-leaf Muon and Adafactor were not
# measured. SkipNonFinite(AdamW) and EMA(AdamW) before they were grouped: in the comments.
CASES = {
    # One Pallas kernel a group (optim._engine.multitensor), groups of at most 4M elements: four of 25 on 100 leaves
    # (one of 100 were 7 kernels, and compiled in 5x the time).
    "Adam": (lambda: optim.Adam(1e-3), 13, 49),
    "Adam bf16 moments": (lambda: optim.Adam(1e-3, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16), 15, None),
    "Lion": (lambda: optim.Lion(1e-4), 12, 100),
    "clip+Adam": (lambda: optim.chain(optim.ClipGlobalNorm(1.0), optim.Adam(1e-3)), 21, 100),
    "clip+AdamW": (lambda: optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-3, **ADAMW)), 21, 81),
    "SkipNonFinite(Adam)": (lambda: optim.SkipNonFinite(optim.Adam(1e-3)), 25, None),
    "SkipNonFinite(AdamW)": (lambda: optim.SkipNonFinite(optim.AdamW(1e-3, **ADAMW)), 25, 221),   # 308, 1985
    "EMA(AdamW)": (lambda: optim.EMA(optim.AdamW(1e-3, **ADAMW), 0.999), 13, 83),                   # 19, 160
    "Muon": (lambda: optim.Muon(1e-3), 61, None),                   # one parameter a stack: 3111
    "Adafactor": (lambda: optim.Adafactor(1e-3), 31, None),         # 803
}
# None: not yet. On 1000 leaves of 128x128 (16 groups of 64) Adam with bfloat16 moments compiles to 997 kernels and
# SkipNonFinite(Adam) to 1047 with 16 parameter copies: XLA does not fuse those groups' steps as it does Adam's.


@pytest.fixture(autouse=True)
def _grouped(monkeypatch):
    monkeypatch.setattr(_group, "MODE", "all")
    assert os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"


@pytest.mark.parametrize("size", ["100x400x400", "1000x128x128"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_grouped_step_kernels(name, size):
    make, bound_100, bound_1000 = CASES[name]
    n, shape = K.SIZES[size]
    bound = bound_100 if n == 100 else bound_1000
    if bound is None:
        pytest.xfail("not grouped into a few kernels yet (see CASES)")
    params = {f"w{i:04d}": jnp.zeros(shape) for i in range(n)}
    state = optim.setup(make(), params)
    where = K.sharding()
    args = [K.abstract(a, where) for a in (state, params, params)]
    got = K.count(jax.jit(K.optim_step, donate_argnums=(0, 1)), *args)
    # Every new parameter written in place: no copy of a parameter's size (a small state pack read through a
    # barrier may be copied: optim._engine.hoist._filled_apart).
    assert got["largest_copy"] < math.prod(shape), got
    assert got["kernels"] <= bound, got


def test_the_rounding_of_a_bfloat16_parameter_survives_xla_gpu():
    """On an H200, `return_stats` reported the unrounded update of a bfloat16 parameter (XLA:GPU allows excess
    precision and dropped the float32 -> bfloat16 -> float32 round trip inside a fusion). The program rounds
    explicitly (`optim._rules.protocol.widened`); XLA:GPU's optimized program keeps that rounding."""
    params = {"w": jnp.ones((4096,), jnp.bfloat16)}
    state = optim.setup(optim.MixedPrecision(optim.Descent(1e-3)), params)
    where = K.sharding()
    args = [K.abstract(a, where) for a in (state, params, params)]
    text = jax.jit(lambda s, m, g: optim.update(s, m, g, return_stats=True)).lower(*args).compile().as_text()
    assert "reduce-precision(" in text and "exponent_bits=8, mantissa_bits=7" in text


# Quantised moments (optim.q8 / optim.q4 as AdamW's mu_dtype and nu_dtype): bounds on kernels and on whole-array
# copies. The copies are of the moments' uint8 codes (1 byte a number, read by the fusion that finds a block's
# scale and again by the one that writes the new codes into their donated buffer), never of a parameter.
QUANTIZED = {
    "q8": (lambda: optim.AdamW(1e-3, **ADAMW, mu_dtype=optim.q8, nu_dtype=optim.q8), (29, 2), (130, 0)),
    "q4": (lambda: optim.AdamW(1e-3, **ADAMW, mu_dtype=optim.q4, nu_dtype=optim.q4), (24, 0), (146, 0)),
}


@pytest.mark.parametrize("size", ["100x400x400", "1000x128x128"])
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_grouped_quantized_step_kernels(name, size):
    make, bound_100, bound_1000 = QUANTIZED[name]
    n, shape = K.SIZES[size]
    kernels, copies = bound_100 if n == 100 else bound_1000
    params = {f"w{i:04d}": jnp.zeros(shape) for i in range(n)}
    state = optim.setup(make(), params)
    where = K.sharding()
    args = [K.abstract(a, where) for a in (state, params, params)]
    text = jax.jit(K.optim_step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    got = K.entry_kernels(text)
    copied = [k.shape.split("[")[0] for k in K.module_kernels(text)     # the dtype of each copy of at least
              if k.op == "copy" and math.prod(K._dims(k.shape) or (0,)) >= math.prod(shape)]   # a parameter's size
    assert set(copied) <= {"u8"}, copied
    assert got["kernels"] <= kernels and len(copied) <= copies, (got, copied)


# Bytes a step moves (`bench.kernels`: the operands and outputs of every kernel, of a fused operand the elements
# its kernel demands), in MB: (tree, workload) -> (bound, optax). The bound is what the engine moves now
# (deviceless H100, jax 0.10.2), so that a change that gives bytes back fails. The target is optax's bytes (optax
# 0.2.8, on the untied tree) + 2%, and on the tied tree + 201 MB more: the head's gradient read and its output
# written, which the untied tree does not have (the floor: 29.8 bytes a parameter there against 28).
# Met (TARGET_MET) on the GPT-2 tree since its matrices step alone and each stack reads its own pack rows (before:
# Adam 3810 MB, AdamW 3811, SkipNonFinite(AdamW) 4027), and by Adam's and AdamW's groups since one Pallas kernel
# steps each group in one pass (optim._engine.multitensor; before: 577 MB on 100 x 400x400, 590 on 1000 x
# 128x128, two passes over the state). Not met: on the tied tree the new embedding is copied into the head's
# output (the read, 101 MB, is the part over the target); EMA(AdamW) on GPT-2, where XLA steps the 32768 x 768
# embedding in two kernels (with the average, four outputs: it splits them from about 13.4M elements on), the
# second reading back the moments the first wrote; the demo's stack on grouped leaves, which no one-pass kernel
# steps: its groups' moments are written and read back, and the average reads the new parameters back.
BYTES = {
    ("100x400x400", "Adam"): (449, 448),
    ("100x400x400", "AdamW"): (449, 448),
    ("1000x128x128", "Adam"): (460, 459),
    ("100x400x400", "clip+AdamW"): (513, 512),
    ("1000x128x128", "clip+AdamW"): (526, 524),
    ("gpt2", "Adam"): (3110, 3108),
    ("gpt2", "AdamW"): (3111, 3108),
    ("gpt2", "SkipNonFinite(AdamW)"): (3556, 3552),
    ("gpt2", "clip+AdamW"): (3555, 3553),
    ("gpt2", "EMA(AdamW)"): (4200, 3996),
    ("gpt2", "SkipNonFinite(EMA(clip+AdamW))"): (4443, 4441),
    ("100x400x400", "SkipNonFinite(EMA(clip+AdamW))"): (897, 640),
    ("gpt2-tied", "Adam"): (3412, 3108),
}
TARGET_MET = {("gpt2", "Adam"), ("gpt2", "AdamW"), ("gpt2", "SkipNonFinite(AdamW)"), ("100x400x400", "Adam"),
              ("100x400x400", "AdamW"), ("1000x128x128", "Adam"), ("100x400x400", "clip+AdamW"),
              ("1000x128x128", "clip+AdamW"), ("gpt2", "clip+AdamW"), ("gpt2", "SkipNonFinite(EMA(clip+AdamW))")}
TIE_MB = 201          # 2 x 32768 x 768 float32: the head's gradient read, its output written


@functools.lru_cache(maxsize=None)
def _measured(tree: str, workload: str) -> dict:
    rule, _ = K.workloads()[workload]
    return K.measure(tree, workload, "optim", rule)


def test_grouped_muon_peak_memory_is_within_optax():
    """Issue 49's memory bound: Muon's stacks run Newton-Schulz batched, whose iterates (X, X Xᵀ and its square)
    are temporaries as large as the stack. Compiled for an H100 on 100 x 400x400: optim's peak (arguments and
    temporaries) at most 1.1x optax's per-leaf Muon; measured 315 MB against optax's 588 MB (123 and 396 MB of
    temporaries)."""
    rule, tx = K.workloads()["Muon"]
    peaks = {who: K.measure("100x400x400", "Muon", who, rule, tx)["peak_bytes"] for who in ("optim", "optax")}
    assert peaks["optim"] <= 1.1 * peaks["optax"], peaks


@pytest.mark.parametrize("fmt, bound, target", [("q8", 1788, 0.65), ("q4", 1573, 0.6)])
def test_quantized_step_one_pass(fmt, bound, target):
    """AdamW with q8 or q4 moments (optim._engine.onepass): one Pallas kernel per quantised parameter, reading and
    writing each block once; on one 4096x4096 leaf the step moves its floor (16.06 and 14.13 bytes a parameter; on
    XLA's path q8 was 22.2 in 12 kernels), on the GPT-2 tree at most 0.65x (q8) and 0.6x (q4) float32 AdamW's bytes
    (issue 48's targets; XLA's path: 2746 and 5241 MB, 0.88x and 1.69x)."""
    one = _measured("1x4096x4096", f"AdamW {fmt}")
    assert one["custom_calls"] == 1 and one["bytes"] <= 1.0005 * one["floor"] * one["params"], one
    got, f32 = _measured("gpt2", f"AdamW {fmt}"), _measured("gpt2", "AdamW")
    assert got["custom_calls"] == 50, got      # the 2 embeddings and 4 matrices a block; the rest is not quantised
    assert got["bytes"] <= bound * 1e6 and got["bytes"] <= target * f32["bytes"], (got, f32)


# The GPT-2 tree's kernels: (workload) -> (bound, copies); optax's are 150, 350, 150, 352 and 405. Before its stacks
# of small parameters (biases, norms) were stepped member by member (optim._engine.members) AdamW read them through
# their concatenation and XLA copied 34 of the new parameters out: 166, 274 and 168 kernels. The demo's stack
# then copied 32 old parameters (520 kernels, 4831 MB), while its average read `x - step` ungated after the
# skip's select had overwritten `x`; now it reads the gated value (EMA.apply_tree's `ok`). Under the skip each
# stack sliced its rows of the shared packs before a barrier, a kernel a slice (104: 428 and 487 kernels); it now
# slices them after (hoist._filled_apart), and the 6 copies are of those packs (24 to 64 numbers each).
GPT2_KERNELS = {"AdamW": (131, 0), "clip+AdamW": (239, 0), "EMA(AdamW)": (137, 0),
                "SkipNonFinite(AdamW)": (328, 6), "SkipNonFinite(EMA(clip+AdamW))": (387, 6)}


@pytest.mark.parametrize("workload", sorted(GPT2_KERNELS))
def test_small_parameters_are_written_in_place(workload):
    got = _measured("gpt2", workload)
    kernels, copies = GPT2_KERNELS[workload]
    assert got["copies"] <= copies and got["kernels"] <= kernels, got


@pytest.mark.parametrize("case", sorted(BYTES), ids="-".join)
def test_step_bytes(case):
    got = _measured(*case)
    assert got["bytes"] <= BYTES[case][0] * 1e6, got


@pytest.mark.parametrize("case", sorted(BYTES), ids="-".join)
def test_step_bytes_target(case):
    """The target, reported as an expected failure while it is not met (see BYTES); met, it passes."""
    got = _measured(*case)["bytes"] / 1e6
    target = 1.02 * BYTES[case][1] + (TIE_MB if case[0] == "gpt2-tied" else 0)
    if case in TARGET_MET:
        assert got <= target, (got, target)
    elif got > target:
        pytest.xfail(f"not met: {got:.0f} MB against a target of {target:.0f} MB (optax's + 2%)")
