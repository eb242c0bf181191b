"""Data-parallel and sharded training on 8 simulated CPU devices: pmap, sharded jit, shard_map, FSDP / ZeRO.

JAX fixes its device count when the backend starts, so the cases run once in a subprocess
(`tests/parallel_cases.py`, with XLA_FLAGS=--xla_force_host_platform_device_count=8) and each test here checks
one case's record. Every case trains a model whose embedding is tied to its output projection and compares it
with single-device training on the whole batch (rtol 1e-5); tied positions must stay identical.
"""

from __future__ import annotations

import pathlib

import pytest

from conftest import background_cases, case_record

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    # started in the background after collection when this file is collected (see conftest.background_cases)
    return background_cases("parallel_cases.py", tmp_path_factory.mktemp("parallel"))


_check = case_record


def test_pmap_pmean_replicated_state_tied_model(cases):
    rec = _check(cases, "pmap")
    assert rec["replicas_equal"]


def test_jit_named_sharding_batch_sharded(cases):
    rec = _check(cases, "jit_sharded")
    assert rec["replicated"]
    assert rec["compiles"] == 1      # a fresh state's scalars and specs placed as the step returns them


def test_shard_map_explicit_pmean(cases):
    _check(cases, "shard_map")


def test_shard_map_with_vma_checking(cases):
    _check(cases, "shard_map_vma")


def test_fsdp_update_keeps_sharding_without_gathering_state(cases):
    rec = _check(cases, "fsdp")
    assert rec["update_all_gathers"] == 0
    assert rec["step_all_gathers"] <= rec["grad_all_gathers"]
    assert rec["param_specs"]["mlp.w"] == "P('data',)" and rec["param_specs"]["gain"] == "P()"


def test_checkpoint_of_sharded_state_loads_onto_the_same_shardings(cases):
    _check(cases, "checkpoint_sharded")


def test_fsdp_setup_places_state_like_params(cases):
    rec = _check(cases, "fsdp")
    assert rec["setup_unsharded"] == []
    assert rec["step_spec"] == ["P()", True]          # the step counter: replicated over the parameters' mesh


def test_parallel_cases_are_quick(cases):
    # CPU time, not wall time: the latter depends on what else the machine runs
    assert sum(r["cpu_seconds"] for r in cases.values()) < 60


def test_readme_tie_preserving_put_block():
    import re

    import jax
    import jax.numpy as jnp

    text = (HERE.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "def put(" in b)
    scope = {"jax": jax}
    exec(block, scope)
    w = jnp.ones(3)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = scope["put"]({"a": w, "b": w, "c": jnp.zeros(2)}, {"a": dev, "b": dev, "c": dev})
    assert out["a"] is out["b"] and out["a"] is not out["c"]
