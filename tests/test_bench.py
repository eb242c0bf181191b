"""The benchmark suite runs (quick mode: tiny sizes, seconds), so it cannot rot. Speed is never asserted here."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from conftest import background_run

ROOT = Path(__file__).resolve().parents[1]
STEP_CANDIDATES = ["optim", "optax"] + (["torch"] if importlib.util.find_spec("torch") else [])
# The smoke runs start when collection ends and run beside the rest of the suite (tests/conftest.py): each is a
# subprocess doing its own compiles, which would otherwise leave the second core idle (~2 minutes of make test).
BACKGROUND_RUNS = {
    # --timeout: the benchmarks' per-process limits are hang guards here, generous (their quick defaults, 60 s and
    # 120 s, were passed on a loaded machine and the run reported a timeout instead of its rows)
    "test_bench_quick_mode_runs": (["-m", "bench", "--quick", "--no-torch", "--timeout", "900", "--out",
                                    "{out}/RESULTS.md"], {}),
    "test_bench_rules_quick_mode_runs": (["-m", "bench.rules", "--quick", "--only", "adafactor", "--timeout", "900",
                                          "--out", "{out}/RULES.md"], {}),
    "test_bench_step_quick_mode_runs": (["-m", "bench.step", "--quick", "--only", "char-lm", "--candidates",
                                         ",".join(STEP_CANDIDATES), "--timeout", "900", "--out", "{out}/RESULTS.md"],
                                        {}),
    "test_bench_lowmem_quick_mode_runs": (["-m", "bench.lowmem", "--quick", "--out", "{out}/LOWMEM.md"],
                                          {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}),
    "test_bench_gpu_quick_mode_runs": (["-m", "bench.gpu", "--quick", "--sizes", "100x160k", "--rounds", "1",
                                        "--target", "0.01", "--json", "{out}/GPU.json", "--md", "{out}/GPU.md"],
                                       {"OPTIM_FUSED": "0", "OPTIM_GROUP": "all"}),
    # XLA's optimisations off (here and for lowmem): the compiles (one per optimiser) dominate and the speed is
    # not what is checked.
    "test_bench_choosing_runs": (["-m", "bench.choosing", "--size", "test", "--steps", "40", "--rounds", "1",
                                  "--inner", "1", "--out", "{out}/CHOOSING.md"],
                                 {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}),
}


def test_bench_quick_mode_runs(request, tmp_path):
    code, stdout, stderr, folder = background_run(request, tmp_path)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    text = (folder / "RESULTS.md").read_text()
    for row in ("optim eager", "optim jit", "optax", "probe"):
        assert f"| {row} |" in text, row
    assert (folder / "RESULTS.json").exists()


def test_bench_step_quick_mode_runs(request, tmp_path):
    """`python -m bench.step --quick` on the demo's tied char LM at a tiny size (gpt12 runs the same code with 12
    layers): optim's production stack, optax's and, when torch is installed, torch's each take full training
    steps, and their loss trajectories agree (the check the benchmark makes before timing). No timing asserts."""
    import json

    cands = STEP_CANDIDATES
    code, stdout, stderr, folder = background_run(request, tmp_path)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    out = folder / "RESULTS.md"
    sec = json.loads((folder / "STEP.json").read_text())["sections"]["char-lm"]
    for c in cands:
        assert sec["rows"][c]["step_s"] > 0 and sec["first"][c]["first_s"] > 0, (c, sec["rows"][c])
    checks = {c["a"]: c for c in sec["raw"]["checks"]}
    assert set(checks) == set(cands) - {"optax"}, checks
    assert all(c["passed"] for c in checks.values()), checks
    assert len(sec["raw"]["losses"]["optim"]) >= 5
    text = out.read_text()
    assert "## Whole training step" in text and "| optim |" in text


def test_bench_rules_quick_mode_runs(request, tmp_path):
    """`python -m bench.rules --quick` on one of its sections (Adafactor; the Muon, bfloat16 and 1000x16k sections
    run the same code on other rules and sizes and add ~13 s each): every row, with finite numbers, and the
    numerical check (optim against optax, 3 steps on an untied model) passed."""
    import json
    import math

    code, stdout, stderr, folder = background_run(request, tmp_path)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    out = folder / "RULES.md"
    data = json.loads((folder / "RULES.json").read_text())
    assert set(data["sections"]) == {"adafactor"}

    def finite(v):
        if isinstance(v, (list, tuple)):
            return all(finite(x) for x in v)
        return isinstance(v, (int, float)) and math.isfinite(v)

    for name, sec in data["sections"].items():
        rows = sec["rows"]
        assert sorted(rows) == sorted(sec["expected_rows"]) and len(rows) >= 5, (name, sorted(rows))
        for cand, row in rows.items():
            assert "error" not in row, (name, cand, row)
            ratios = [k for k in row if k.startswith("vs_") and not k.endswith("_iqr")]
            assert ratios, (name, cand)
            need = ["step_s", "state_ratio", *ratios, *(f"{k}_iqr" for k in ratios)]
            if cand in sec["first_candidates"]:
                need += ["first_s", "peak_rss_mb"]
            for k in need:
                assert finite(row.get(k)), (name, cand, k, row.get(k))
        checks = sec["raw"]["checks"]
        assert checks, name
        for c in checks:
            assert finite(c["max_rel_update_diff"]) and c["passed"], (name, c)
    text = out.read_text()
    assert "| optim jit |" in text and "| optax |" in text


def test_bench_lowmem_quick_mode_runs(request, tmp_path):
    """`python -m bench.lowmem --quick`: every storage format and the bfloat16-parameter runs train a few steps
    of a tiny LM (finite held-out losses), the state bytes per parameter are what the formats store (float32
    moments 8, bfloat16 4; q8 and q4 less than float32 but more than their codes alone at this tiny size, where
    the biases keep float32 moments), and the step-time table has its rows. No timing asserts."""
    import json

    code, stdout, stderr, folder = background_run(request, tmp_path)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    res = json.loads((folder / "LOWMEM.json").read_text())["models"]["quick"]
    runs = res["runs"]
    assert all(math.isfinite(r["val"]) for r in runs.values())
    per = {k: r["bytes_per_param"] for k, r in runs.items()}
    assert per["AdamW float32"] == pytest.approx(8, abs=0.05)
    assert per["AdamW bfloat16 m, v"] == pytest.approx(4, abs=0.05)
    assert 2 < per["AdamW q8"] < 8 and 1 < per["AdamW q4"] < per["AdamW q8"]
    assert {"AdamW q8", "AdamW q4", "AdamW float32"} <= set(res["step_seconds"])
    assert "| AdamW q4 |" in (folder / "LOWMEM.md").read_text()


def test_bench_gpu_quick_mode_runs(request, tmp_path):
    """`python -m bench.gpu --quick` (the GPU benchmark, prepared for a machine with a GPU) on CPU, as a GPU
    process sets up (XLA's path, grouped): every candidate steps, ratios are to optax's Adam, and each jitted
    candidate reports its compiled program's kernels. optim's grouped Adam has fewer than optax's one loop
    per leaf. No timing asserts."""
    import json

    code, stdout, stderr, folder = background_run(request, tmp_path)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    rows = json.loads((folder / "GPU.json").read_text())["workloads"]["100x160k"]["rows"]
    assert rows["optax Adam"]["ratio"] == 1.0
    assert not [k for k, r in rows.items() if r["error"] or not r["step_ms"] > 0]
    assert {"optim Adam", "optim SkipNonFinite(AdamW)", "optim EMA(AdamW)", "probe p += g"} <= set(rows)
    assert rows["optim Adam"]["kernels"] < rows["optax Adam"]["kernels"]
    assert "| optim EMA(AdamW) |" in (folder / "GPU.md").read_text()
    # On the CPU the one-pass step lowers to XLA's operations: no kernel, the same numbers
    checks = json.loads((folder / "GPU.json").read_text())["checks"]
    assert checks == {f"AdamW {q}": {"kernel": False, "param_rel": 0.0, "code_max": 0} for q in ("q8", "q4")}


def test_bench_choosing_runs(request, tmp_path):
    """`python -m bench.choosing` (the docs' "Choosing an optimiser" table) at its `test` size for a few steps:
    every optimiser this optim has trains the demo LM (finite losses, lower at the end than at the start), and
    the state-bytes column matches a count made here from the shapes. No timing asserts."""
    import json
    import math

    sys.path.insert(0, str(ROOT))
    from bench import choosing

    code, stdout, stderr, folder = background_run(request, tmp_path)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    out = folder / "CHOOSING.md"
    res = json.loads(out.with_suffix(".json").read_text())
    rows = res["rows"]
    assert list(rows) == choosing.available()
    assert {"AdamW", "Muon+AdamW", "Adafactor", "Schedule-Free"} <= set(rows)
    for name, r in rows.items():
        losses = [r["initial_loss"], r["train_loss"], r["held_out_loss"], *r["losses"]]
        assert all(math.isfinite(v) for v in losses), name
        assert r["held_out_loss"] < r["initial_loss"] and r["train_loss"] < r["losses"][0], name
        assert r["step_s"] > 0 and r["first_s"] > 0 and math.isfinite(r["step_ratio"]), name
        assert f"| {name} |" in out.read_text()

    # The state column, counted from the model's shapes: the demo LM's parameters (the tied embedding once) are
    # float32, so AdamW holds two of each plus a few scalars; Muon+AdamW holds one of each block matrix (Muon's
    # momentum) and two of everything else.
    cfg, d, vocab = res["config"], res["config"]["d"], res["vocab"]
    per_block = {"qkv": d * 3 * d, "proj": d * d, "w1": d * 4 * d, "w2": 4 * d * d}
    matrices = cfg["layers"] * sum(per_block.values())
    vectors = cfg["layers"] * (4 * d + 4 * d + d) + 2 * d            # ln1, ln2 (g, b), b1, b2; ln_f
    n = vocab * d + cfg["ctx"] * d + matrices + vectors
    assert res["n_params"] == n and res["param_bytes"] == 4 * n
    scalars = 1024 / res["param_bytes"]               # counters and hyperparameters: under 1 KiB in all
    adamw = rows["AdamW"]["state_ratio"]
    assert 2.0 < adamw < 2.0 + scalars, adamw
    muon = rows["Muon+AdamW"]["state_ratio"]
    expected = (matrices + 2 * (n - matrices)) / n
    assert expected < muon < expected + scalars, (muon, expected)
    if "Prodigy" in rows:                             # m, v, s and the starting parameters
        assert 4.0 < rows["Prodigy"]["state_ratio"] < 4.0 + scalars


# `bench.kernels`' parser on a hand-written compiled module (no CUDA plugin needed): a multi-output fusion writing
# members 0 and 1 of a stack of 4 (it reads those rows of the stack only), a fusion reading two arrays through
# their concatenation of which it slices one, a reduction reading all of its operand, a copy of a parameter-sized
# array, and a while loop of 3 known trips (its condition runs 4 times). Tuple shapes with `/*index=*/` comments,
# metadata holding ` = `, parentheses and brackets.
KERNELS_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[4,8]{1,0}, f32[], f32[8]{0}, f32[8]{0})->(...)}

%fused_members (param_0: f32[4,8], param_1: f32[], param_2: f32[8], param_3: f32[8]) -> (f32[8], f32[8]) {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[] parameter(1)
  %broadcast.1 = f32[4,8]{1,0} broadcast(%param_1), dimensions={}
  %multiply.1 = f32[4,8]{1,0} multiply(%param_0, %broadcast.1), metadata={op_name="stacks[0].mu[1:2]"}
  %slice.0 = f32[1,8]{1,0} slice(%multiply.1), slice={[0:1], [0:8]}
  %bitcast.0 = f32[8]{0} bitcast(%slice.0)
  %param_2 = f32[8]{0} parameter(2)
  %subtract.0 = f32[8]{0} subtract(%param_2, %bitcast.0)
  %slice.1 = f32[1,8]{1,0} slice(%multiply.1), slice={[1:2], [0:8]}
  %bitcast.1 = f32[8]{0} bitcast(%slice.1)
  %param_3 = f32[8]{0} parameter(3)
  %subtract.1 = f32[8]{0} subtract(%param_3, %bitcast.1)
  ROOT %tuple.0 = (f32[8]{0}, f32[8]{0}) tuple(%subtract.0, %subtract.1)
}

%fused_concat (param_0.1: f32[8], param_1.1: f32[8]) -> f32[8] {
  %param_0.1 = f32[8]{0} parameter(0)
  %bitcast.2 = f32[1,8]{1,0} bitcast(%param_0.1)
  %param_1.1 = f32[8]{0} parameter(1)
  %bitcast.3 = f32[1,8]{1,0} bitcast(%param_1.1)
  %concatenate.0 = f32[2,8]{1,0} concatenate(%bitcast.2, %bitcast.3), dimensions={0}
  %slice.2 = f32[1,8]{1,0} slice(%concatenate.0), slice={[1:2], [0:8]}
  ROOT %bitcast.4 = f32[8]{0} bitcast(%slice.2)
}

%add_f32 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.0 = f32[] add(%x, %y)
}

%fused_norm (param_0.2: f32[4,8]) -> f32[] {
  %param_0.2 = f32[4,8]{1,0} parameter(0)
  %constant.0 = f32[] constant(0)
  ROOT %reduce.0 = f32[] reduce(%param_0.2, %constant.0), dimensions={0,1}, to_apply=%add_f32
}

%fused_body (param_0.3: s32[], param_1.3: f32[8]) -> (s32[], f32[8]) {
  %param_0.3 = s32[] parameter(0)
  %constant.1 = s32[] constant(1)
  %add.1 = s32[] add(%param_0.3, %constant.1)
  %param_1.3 = f32[8]{0} parameter(1)
  %add.2 = f32[8]{0} add(%param_1.3, %param_1.3)
  ROOT %tuple.1 = (s32[], f32[8]{0}) tuple(%add.1, %add.2)
}

%body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[8]{0} get-tuple-element(%state), index=1
  ROOT %next = (s32[], f32[8]{0}) fusion(%i, %x), kind=kLoop, calls=%fused_body
}

%cond (state.1: (s32[], f32[8])) -> pred[] {
  %state.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%state.1), index=0
  %limit = s32[] constant(3)
  ROOT %less = pred[] compare(%i.1, %limit), direction=LT
}

ENTRY %main.9 (stack: f32[4,8], lr: f32[], w0: f32[8], w1: f32[8]) -> (f32[8], f32[8], f32[8], f32[]) {
  %stack = f32[4,8]{1,0} parameter(0), metadata={op_name="state.stacks[0].mu"}
  %lr = f32[] parameter(1)
  %w0 = f32[8]{0} parameter(2)
  %w1 = f32[8]{0} parameter(3)
  %members = (f32[8]{0}, /*index=1*/f32[8]{0}) fusion(%stack, %lr, %w0, %w1), kind=kLoop, calls=%fused_members
  %new0 = f32[8]{0} get-tuple-element(%members), index=0
  %new1 = f32[8]{0} get-tuple-element(%members), index=1
  %concat = f32[8]{0} fusion(%new0, %new1), kind=kLoop, calls=%fused_concat, metadata={op_name="a = f(c[0])"}
  %norm = f32[] fusion(%stack), kind=kInput, calls=%fused_norm
  %copy.0 = f32[8]{0} copy(%new0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %concat)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[8]{0} get-tuple-element(%loop), index=1
  ROOT %result = (f32[8]{0}, f32[8]{0}, /*index=2*/f32[8]{0}, f32[]) tuple(%copy.0, %new1, %out, %norm)
}
"""


def test_bench_kernels_bytes_parser():
    """`bench.kernels.module_kernels` / `entry_kernels` on `KERNELS_HLO`: bytes read are the demanded elements of
    each fusion operand, written the outputs, each kernel times its executions."""
    sys.path.insert(0, str(ROOT))
    from bench import kernels

    got = {k.name: (k.op, k.read, k.written, k.times) for k in kernels.module_kernels(KERNELS_HLO)}
    assert got == {
        "members": ("fusion", 2 * 8 * 4 + 4 + 32 + 32, 64, 1),    # rows 0-1 of the stack, lr, w0, w1
        "concat": ("fusion", 32, 32, 1),                           # of new0 and new1, new1 only
        "norm": ("fusion", 128, 4, 1),                             # the whole stack
        "copy.0": ("copy", 32, 32, 1),
        "less": ("compare", 8, 1, 4),                              # i and the constant; 3 trips + 1
        "next": ("fusion", 36, 36, 3),
    }
    summary = kernels.entry_kernels(KERNELS_HLO)
    assert summary["bytes"] == 196 + 64 + 132 + 64 + 9 * 4 + 72 * 3
    assert summary["read"] + summary["written"] == summary["bytes"]
    assert {k: summary[k] for k in ("kernels", "fusions", "copies", "param_copies", "other", "other_ops")} == {
        "kernels": 11, "fusions": 6, "copies": 1, "param_copies": 1, "other": 4, "other_ops": ["compare"]}

    # The floor: gradients and parameters read, parameters written, the state read and written; a tied array's
    # position is read once as a parameter but has its own gradient and output.
    import numpy as np
    w = np.zeros(10, np.float32)
    state = {"m": np.zeros(10, np.float32), "v": np.zeros(10, np.float32)}
    assert kernels.floor_bytes(state, {"w": w}, {"w": w}) == 28 * 10
    assert kernels.floor_bytes(state, {"w": w}, {"w": w}, passes=1) == 32 * 10
    assert kernels.floor_bytes(state, {"a": w, "b": w}, {"a": w, "b": w.copy()}) == (8 + 4 + 8 + 16) * 10
