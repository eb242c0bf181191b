"""The matrix rules' per-matrix work split across 8 simulated CPU devices (`optim._rules.split`).

As in test_parallel.py, the cases run once in a subprocess (`tests/split_cases.py`, with
XLA_FLAGS=--xla_force_host_platform_device_count=8) and each test here checks one case's record: the parameters
after 3 steps equal single-device training to rounding (rtol 1e-5), and the per-device compiled program does
1/8 of the matrix products of the same program with the split off (16 same-shaped matrices, 2 a device).
"""

from __future__ import annotations

import pytest

from conftest import background_cases

N, N_DEV, N_LARGE = 16, 8, 3       # as in split_cases.py
KINDS = ("replicated", "zero1_auto", "zero1_explicit")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    # started in the background after collection when this file is collected (see conftest.background_cases)
    return background_cases("split_cases.py", tmp_path_factory.mktemp("split"))


def _record(cases: dict, name: str) -> dict:
    rec = cases[name]
    assert rec["ok"], f"{name}: {rec.get('error')}\n{rec.get('traceback', '')}"
    assert rec["on"]["close"], f"{name}: split differs from one device by {rec['on']['max_abs_diff']}"
    return rec


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rule", ["normuon", "soap"])
def test_batched_rules_do_an_eighth_of_the_products_per_device(cases, rule, kind):
    rec = _record(cases, f"{rule}_{kind}")
    assert rec["off"]["dots"] == N_DEV * rec["on"]["dots"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_muon_splits_a_stack_and_pads_one_shorter_than_the_devices(cases, kind):
    """16 small matrices, 2 a device, and 3 large ones (stacked because they live on a mesh), padded to 8: one a
    device."""
    rec = _record(cases, f"muon_{kind}")
    each = rec["off"]["dots"] // (N + N_LARGE)         # a matrix's products (Newton-Schulz: 3 a step)
    assert rec["off"]["dots"] == each * (N + N_LARGE)
    assert rec["on"]["dots"] == each * (N // N_DEV + 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rule", ["shampoo", "kron"])
def test_member_loops_run_an_eighth_of_the_members_per_device(cases, rule, kind):
    """Shampoo and Kron step a stack's members one at a time (`jax.lax.map`): the loop's trip count."""
    rec = _record(cases, f"{rule}_{kind}")
    assert max(rec["off"]["loops"]) == N
    assert N not in rec["on"]["loops"] and N // N_DEV in rec["on"]["loops"]


@pytest.mark.parametrize("kind", ["fsdp", "fsdp_explicit"])
def test_muon_fsdp(cases, kind):
    rec = _record(cases, f"muon_{kind}")
    assert rec["on"]["dots"] < rec["off"]["dots"] / 6


def test_nothing_is_split_inside_shard_map(cases):
    _record(cases, "muon_shard_map")


def test_muon_split_under_vmap_export_and_grad(cases):
    """The split step under `jax.vmap` (two models at once), `jax.export` and `jax.grad` (the loss after a step, by
    the learning rate): each equal to the same transformation on one device; vmapped, each device still does the
    products of its share of the matrices, for both models."""
    rec = cases["muon_transformed"]
    assert rec["ok"], f"{rec.get('error')}\n{rec.get('traceback', '')}"
    for how in ("vmap", "export", "grad"):
        assert rec[how]["close"], f"{how}: differs from one device by {rec[how]['max_abs_diff']}"
    plain = _record(cases, "muon_replicated")
    each = plain["off"]["dots"] // (N + N_LARGE)
    assert rec["vmap"]["dots"] == 2 * each * (N // N_DEV + 1)
