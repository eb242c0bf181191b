"""ZeRO-1 (`setup(rule, model, state_sharding=fn)`): replicated parameters, optimiser state sharded over the data
axis of 8 simulated CPU devices.

As in test_parallel.py, the cases run once in a subprocess (`tests/zero1_cases.py`, which sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts) and each test here checks one case's
record. Every training case compares 6 steps with single-device training on the whole batch (rtol 1e-5).
The errors that need no devices are tested in test_state.py.
"""

from __future__ import annotations

import re

import pytest

from conftest import background_cases, case_record

SHARDED = {"emb": [2, 8], "mlp.b": [1], "mlp.w": [1, 8]}      # each device's piece of m and v: 1/8 on axis 0


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    # started in the background after collection when this file is collected (see conftest.background_cases)
    return background_cases("zero1_cases.py", tmp_path_factory.mktemp("zero1"))


_check = case_record


def _moment_shards(rec: dict) -> dict:
    """Per path: the shard shapes of its state arrays of the parameter's shape (Adam's m and v)."""
    return {path: [r["shards"] for r in rows if "shards" in r] for path, rows in rec["shards"].items()}


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_zero1_jit_matches_one_device_and_each_device_holds_an_eighth_of_the_moments(cases, axes):
    rec = _check(cases, f"zero1_jit_{axes}")
    assert rec["state_specs_kept"] and rec["params_replicated"]
    assert rec["compiles"] == 1      # a fresh state's scalars and specs placed as the step returns them
    shards = _moment_shards(rec)
    for path, piece in SHARDED.items():
        assert shards[path] == [[piece], [piece]], (path, shards[path])     # m and v, the same piece on all 8
        assert all(r["n_shards"] == 8 for r in rec["shards"][path] if "shards" in r)
    assert shards["gain"] == [[[]], [[]]]                                   # a scalar: replicated
    # Adam's β powers are not parameter-shaped: replicated on the same mesh
    assert all(r["replicated"] for rows in rec["shards"].values() for r in rows if "replicated" in r)


def _gathers(col: dict) -> list[str]:
    return [op for op in col["ops"] if op.startswith("all-gather")]


def test_zero1_collectives_explicit_axes(cases):
    """Explicit mesh axes (jax.make_mesh's default): the data-parallel gradient all-reduce (one combined op, as
    without ZeRO-1) plus one all-gather per sharded parameter, of its new value, and nothing else."""
    rec = _check(cases, "zero1_jit_explicit")
    step, plain, update = rec["step_collectives"], rec["replicated_state_step_collectives"], rec["update_collectives"]
    assert _gathers(step) == ["all-gather f32[16,8]", "all-gather f32[8,8]", "all-gather f32[8]"], step["ops"]
    assert step["all-reduce"] == plain["all-reduce"] == rec["grad_collectives"]["all-reduce"] == 1
    assert plain["all-gather"] == 0
    assert update["all-gather"] == 3 and update["all-reduce"] == 0      # the update alone: just the gathers
    for col in (step, update):
        assert col["reduce-scatter"] == col["collective-permute"] == col["all-to-all"] == 0


def test_zero1_collectives_auto_axes(cases):
    """Auto mesh axes: the same all-gathers (of the sharded parameter update); XLA splits the gradient all-reduce
    into a few combined ops. The forward and backward passes stay data-parallel: no gather of the batch or of
    activations (update pins the gradients to the parameters' sharding so the state's does not leak into them)."""
    rec = _check(cases, "zero1_jit_auto")
    step = rec["step_collectives"]
    assert _gathers(step) == ["all-gather f32[16,8]", "all-gather f32[8,8]", "all-gather f32[8]"], step["ops"]
    assert 1 <= step["all-reduce"] <= 5
    assert step["reduce-scatter"] == step["collective-permute"] == step["all-to-all"] == 0
    reduced = " ".join(op for op in step["ops"] if op.startswith("all-reduce"))
    for grad in ("f32[16,8]", "f32[8,16]", "f32[8,8]", "f32[8]"):       # every gradient is all-reduced
        assert grad in reduced, step["ops"]


def test_zero1_eager_update_keeps_the_state_sharded_and_the_tie(cases):
    rec = _check(cases, "zero1_eager")
    assert rec["state_specs_kept"]


def test_zero1_state_dict_round_trip_keeps_shardings(cases):
    rec = _check(cases, "zero1_eager")
    assert rec["state_dict_roundtrip_specs"]
    assert rec["host_state_dict_then_update_specs"]          # a host copy: the next update puts it back


def test_zero1_freeze_reset_and_save_load(cases):
    checks = _check(cases, "zero1_eager")["surgery"]
    for k in ("freeze", "reset", "save_load_values", "save_load_specs", "save_load_update_specs"):
        assert checks[k], k


def test_zero1_save_load_keeps_the_requested_state_sharding(cases):
    checks = _check(cases, "zero1_eager")["surgery"]
    assert checks["save_load_layout_keeps_state_sharding"]
    assert checks["save_load_update_params_replicated"]


def test_zero1_stack_is_sharded_on_the_parameter_axes(cases):
    rec = _check(cases, "zero1_stacked")
    assert ["layers.0.w", "layers.1.w", "layers.2.w", "mlp.w"] in rec["stacked_members"]
    stacks = {tuple(s["members"]): s["arrays"] for s in rec["stacks"]}
    m, v, beta = stacks[("layers.0.w", "layers.1.w", "layers.2.w", "mlp.w")]
    for a in (m, v):       # (members, 8, 8) stacks: every member's rows split 8 ways, the member axis whole
        assert a["shape"] == [4, 8, 8] and a["spec"] == "P(None, 'data')" and a["shard"] == [4, 1, 8]
    assert beta["spec"] == "P()" and beta["shard"] == [4, 2]
    m, v, _ = stacks[("layers.0.b", "layers.1.b", "layers.2.b", "mlp.b")]
    assert m["shape"] == [4, 8] and m["shard"] == [4, 1]
    # one all-gather per sharded parameter (each parameter's new value is written on its own), one all-reduce
    col = rec["step_collectives"]
    assert col["all-gather"] == 9 and col["all-reduce"] == 1 and col["reduce-scatter"] == 0


def test_zero1_adjust_that_splits_a_stack_and_freeze_keep_the_sharding(cases):
    rec = _check(cases, "zero1_stacked")
    assert rec["adjust_split_stack"] and rec["adjust_placed"] and rec["adjust_after_steps_placed"]
    assert rec["freeze_placed"]
    assert ["layers.0.w"] in [s["members"] for s in rec["adjusted_stacks"]]


def test_zero1_members_with_different_state_shardings_are_stacked_apart(cases):
    rec = _check(cases, "zero1_mixed_specs")
    assert rec["apart"] and rec["unsharded_together"]
    assert rec["specs"] == {"layers.0.w": "P('data',)", "layers.1.w": "P(None, 'data')", "layers.2.w": "P()"}
    assert rec["shards"] == {"layers.0.w": [[1, 8]], "layers.1.w": [[8, 1]], "layers.2.w": [[8, 8]]}


def test_zero1_uneven_sharding_is_a_value_error_naming_the_path(cases):
    rec = _check(cases, "zero1_errors")
    assert re.search(r"state_sharding gives 'w' \(float32\[12, ?8\]\) .* cannot shard that shape", rec["message"])


def test_zero1_state_sharding_on_other_devices_is_a_value_error_naming_the_path(cases):
    """A state sharding on another device or on part of the parameter's mesh (or over another mesh of the same
    devices) is refused by setup, naming the path and both device sets; the same devices, or a parameter not
    committed to any, are accepted and update runs."""
    rec = cases["zero1_errors"]
    assert rec["ok"], rec.get("error")
    msgs = rec["devices"]
    assert re.fullmatch(r"setup: state_sharding gives 'enc\.w' a sharding on devices \[3\], but the parameter "
                        r"lives on devices \[0\];.*", msgs["other_device"])
    assert re.fullmatch(r"setup: state_sharding gives 'enc\.w' a sharding on devices \[0, 1, 2, 3\], but the "
                        r"parameter lives on devices \[0, 1, 2, 3, 4, 5, 6, 7\];.*", msgs["sub_mesh"])
    assert re.fullmatch(r"setup: state_sharding gives 'enc\.w' a sharding over the mesh .*'a': 2, 'b': 4.*, but the "
                        r"parameter is sharded over .*'data': 8.*", msgs["same_devices_other_mesh"])
    assert msgs["same_device"] == msgs["uncommitted"] == "accepted, update ran"


def test_zero1_every_rule_on_explicit_and_auto_axes_matches_one_device(cases):
    """Every exported rule (Muon's Newton-Schulz products, Rprop's and AccumGrad's selects, Adafactor's factored
    statistics included) with a sharded state on a mesh with Explicit axes and on one with Auto axes, eager and
    inside jit, equals the same training unsharded."""
    rec = cases["zero1_every_rule"]
    assert rec["ok"], f"{rec.get('error')}\n{rec.get('traceback', '')}"
    assert rec["runs"] == ["Explicit_eager", "Explicit_jit", "Auto_eager", "Auto_jit"]
    assert rec["missing"] == [], f"rules exported by optim in no `zero1` case of rule_cases.RULES: {rec['missing']}"
    assert {"Muon", "Rprop", "AccumGrad", "Adafactor", "Lamb", "Lars", "ScheduleFreeAdamW", "ClipGlobalNorm",
            "EMA", "SkipNonFinite"} <= set(rec["worst"])
    assert max(rec["worst"].values()) < 1e-4, rec["worst"]


def test_readme_zero1_block(cases):
    assert cases["readme_zero1"]["ok"], cases["readme_zero1"].get("traceback")
