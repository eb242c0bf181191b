"""Shampoo (optim/_rules/shampoo.py) on matrices: against the float64 numpy reference of `rule_refs.r_shampoo`
(written from precondition-opt's `distributed_shampoo`), against `distributed_shampoo` itself (a stored fixture,
tests/data/make_shampoo_reference.py), in float32, and its state's shapes. The registry (`rule_cases.py`) runs it
through everything else every rule goes through (stacking, None gradients, freeze, adjust, save / load, ZeRO-1).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from rule_refs import r_shampoo
from shampoo_problem import CONFIGS, NSTEPS, REFERENCE, SHAPES, gradient, initial

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shampoo_reference.npz")


def numpy_run(config: dict, cast=float) -> dict:
    x = initial()
    refs = {k: r_shampoo(**config, cast=cast) for k in x}
    states = {k: refs[k].init(x[k]) for k in x}
    out = {k: [] for k in x}
    for t in range(NSTEPS):
        g = gradient(x, t)
        for k in x:
            states[k], d = refs[k].apply(states[k], x[k], g[k])
            x[k] = x[k] - d
            out[k].append(x[k])
    return {k: np.stack(v) for k, v in out.items()}


def optim_run(config: dict, dtype=jnp.float64) -> dict:
    x = {k: jnp.asarray(v, dtype) for k, v in initial().items()}
    state = optim.setup(optim.Shampoo(**config), x)
    update = jax.jit(optim.update)
    out = {k: [] for k in x}
    for t in range(NSTEPS):
        g = {k: jnp.asarray(v, dtype) for k, v in gradient({k: np.asarray(v, np.float64) for k, v in x.items()},
                                                            t).items()}
        state, x = update(state, x, g)
        for k in x:
            out[k].append(np.asarray(x[k], np.float64))
    return {k: np.stack(v) for k, v in out.items()}


def _err(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in b)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_numpy_reference_float64(name):
    with jax.enable_x64(True):
        got = optim_run(CONFIGS[name])
    assert _err(got, numpy_run(CONFIGS[name])) < 1e-12      # measured: 1.3e-14


@pytest.mark.parametrize("name", REFERENCE)
def test_matches_precondition_opt_fixture_float64(name):
    """precondition-opt finds the largest eigenvalue (for the regularisation ε λ_max) by power iteration, optim
    and the numpy reference by eigh: 2.4e-8 apart after 12 steps (parameters of magnitude ~1)."""
    ref = np.load(FIXTURE)
    want = {k: ref[f"{name}/{k}"] for k in SHAPES}
    with jax.enable_x64(True):
        got = optim_run(CONFIGS[name])
    assert _err(got, want) < 1e-7
    assert _err(numpy_run(CONFIGS[name]), want) < 1e-7
    assert min(float(np.max(np.abs(want[k][-1] - initial()[k]))) for k in ("w", "r", "t")) > 0.05   # it moved


@pytest.mark.parametrize("name", ["adam", "rmsprop"])
def test_float32_tracks_the_float64_reference(name):
    """matrix_eps 1e-4 keeps the statistics' condition numbers below 1e4: float32 roots to ~1e-5."""
    got = optim_run(CONFIGS[name], jnp.float32)
    assert _err(got, numpy_run(CONFIGS[name], cast=lambda v: float(np.float32(v)))) < 1e-3


def test_state_holds_blocks_per_axis_and_vectors_have_none():
    x = {"w": jnp.zeros((5, 7)), "t": jnp.zeros((3, 4, 2)), "b": jnp.zeros(5), "c": jnp.zeros(())}
    state = optim.setup(optim.Shampoo(block_size=3), x)
    shapes = lambda k: [f.shape for f in state[k].state.factors]    # noqa: E731
    assert shapes("w") == [(6, 3, 3), (6, 3, 3)]                    # 2 x 3 blocks, the last ones padded
    assert shapes("t") == [(2, 3, 3), (2, 3, 3), (2, 2, 2)]
    assert shapes("b") == shapes("c") == []
    assert [r.shape for r in state["w"].state.roots] == shapes("w")


def test_vector_takes_the_adam_graft_step_with_nesterov_momentum():
    x = {"b": jnp.array([1.0, -2.0])}
    state = optim.setup(optim.Shampoo(0.1, start_preconditioning_step=0), x)
    g = jnp.array([0.5, 0.25])
    state, x = optim.update(state, x, {"b": g})
    # ν = 0.001 g², bias-corrected g²: A = sign(g); the Nesterov direction A + 0.9 A
    np.testing.assert_allclose(np.asarray(x["b"]), [1.0 - 0.19, -2.0 - 0.19], rtol=1e-6)


def _small_model():
    rng = np.random.default_rng(3)
    return {"w": jnp.asarray(rng.standard_normal((5, 7)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(5), jnp.float32)}


def _grads(m, t):
    rng = np.random.default_rng(10 + t)
    return {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in m.items()}


RULE = optim.Shampoo(0.05, block_size=4, precondition_every=2, start_preconditioning_step=1, matrix_eps=1e-3)


def test_export_round_trip_gives_the_numbers_of_update():
    from jax import export
    m = _small_model()
    state = optim.setup(RULE, m)
    state, m = optim.update(state, m, _grads(m, 0))
    g = _grads(m, 1)
    exp = export.export(jax.jit(optim.update), platforms=["cpu"])(state, m, g)
    got_state, got = exp.call(state, m, g)
    want_state, want = jax.jit(optim.update)(state, m, g)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    jax.tree.map(np.testing.assert_array_equal, optim.state_dict(got_state), optim.state_dict(want_state))


def test_to_optax_takes_the_steps_of_update():
    m = _small_model()
    tx = optim.to_optax(RULE)
    opt_state, params = tx.init(m), m
    state, model = optim.setup(RULE, m), m
    for t in range(4):
        updates, opt_state = tx.update(_grads(params, t), opt_state, params)
        params = jax.tree.map(lambda a, b: a + b, params, updates)
        state, model = optim.update(state, model, _grads(model, t))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, model)


def test_state_bytes_count_the_blocks_and_a_tie_is_one_parameter():
    w, u = jnp.ones((5, 7)), jnp.zeros((5, 7))
    one = optim.setup(RULE, {"w": w})
    # momenta and ν: 3 x 35 floats; per axis 2 x 2 blocks of 4 x 4, twice (statistics and roots); the count
    per_param = 3 * 35 * 4 + 2 * 2 * 4 * 16 * 4 + 4
    assert optim.state_bytes(optim.setup(RULE, {"w": w, "u": u})) - optim.state_bytes(one) == per_param
    assert optim.state_bytes(optim.setup(RULE, {"w": w, "v": w})) == optim.state_bytes(one)


def test_a_tie_is_one_parameter_with_the_summed_gradient():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((5, 7)), jnp.float32)
    state, model = optim.setup(RULE, {"emb": w, "head": w}), {"emb": w, "head": w}
    one, x = optim.setup(RULE, w), w
    for _ in range(4):
        a, b = (jnp.asarray(rng.standard_normal((5, 7)), jnp.float32) for _ in range(2))
        state, model = optim.update(state, model, {"emb": a, "head": b})
        one, x = optim.update(one, x, a + b)
    assert model["emb"] is model["head"]
    np.testing.assert_allclose(model["emb"], x, rtol=1e-5, atol=1e-6)
