"""Kron (optim/_rules/kron.py): against the float64 numpy reference of `rule_refs.r_kron` (written from
psgd-jax's `kron`) and against psgd-jax's `kron` itself (a stored fixture, tests/data/make_kron_reference.py),
on matrices, a 3-axis array, a vector and a scalar; its random numbers; its state. The registry
(`rule_cases.py`) runs it through everything else every rule goes through (stacking, None gradients, freeze,
adjust, save / load, ZeRO-1).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from kron_problem import CONFIGS, NSTEPS, SHAPES, gradient, initial
from rule_refs import r_kron

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "kron_reference.npz")


def numpy_run(config: dict, nsteps: int) -> dict:
    x = initial()
    refs = {k: r_kron(**config, cast=float, dtype=np.float64) for k in x}
    states = {k: refs[k].init(x[k]) for k in x}
    out = {k: [] for k in x}
    for t in range(nsteps):
        g = gradient(x, t)
        for k in x:
            states[k], d = refs[k].apply(states[k], x[k], g[k])
            x[k] = x[k] - d
            out[k].append(x[k])
    return {k: np.stack(v) for k, v in out.items()}


def optim_run(config: dict, nsteps: int) -> dict:
    x = {k: jnp.asarray(v) for k, v in initial().items()}
    state = optim.setup(optim.Kron(**config), x)
    update = jax.jit(optim.update)
    out = {k: [] for k in x}
    for t in range(nsteps):
        g = {k: jnp.asarray(v) for k, v in gradient({k: np.asarray(v) for k, v in x.items()}, t).items()}
        state, x = update(state, x, g)
        for k in x:
            out[k].append(np.asarray(x[k]))
    return {k: np.stack(v) for k, v in out.items()}


def _err(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k][:len(a[k])]))) for k in a)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_psgd_jax_fixture_float64(name):
    """To 5e-16 until the factors are first balanced (count 151), where psgd-jax computes the factors' norms in
    float32: 1.8e-8 after it (parameters of magnitude ~1)."""
    ref = np.load(FIXTURE)
    want = {k: ref[f"{name}/{k}"] for k in SHAPES}
    with jax.enable_x64(True):
        got = optim_run(CONFIGS[name], NSTEPS)
    assert _err({k: v[:150] for k, v in got.items()}, want) < 1e-13
    assert _err(got, want) < 1e-7
    assert min(float(np.max(np.abs(want[k][-1] - initial()[k]))) for k in SHAPES) > 0.05    # it moved


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_numpy_reference_float64(name):
    with jax.enable_x64(True):      # the numpy reference draws its random numbers in float64 too
        got, want = optim_run(CONFIGS[name], 30), numpy_run(CONFIGS[name], 30)
    assert _err(got, want) < 1e-12


def test_random_numbers_follow_the_seed_and_the_parameters_count():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((4, 4)), jnp.float32)
    g = jnp.asarray(np.random.default_rng(1).standard_normal((4, 4)), jnp.float32)

    def run(rule, model, grads):
        state = optim.setup(rule, model)
        for gr in grads:
            state, model = optim.update(state, model, gr)
        return model

    a = run(optim.Kron(0.1), {"w": w}, [{"w": g}] * 3)
    assert np.array_equal(a["w"], run(optim.Kron(0.1), {"w": w}, [{"w": g}] * 3)["w"])
    assert not np.array_equal(a["w"], run(optim.Kron(0.1, seed=1), {"w": w}, [{"w": g}] * 3)["w"])
    # a parameter that misses a step keeps its count: its steps are those of a model without that step (to
    # rounding: stacked with another parameter, its elementwise arithmetic is fused otherwise)
    b = run(optim.Kron(0.1), {"w": w, "v": w + 1}, [{"w": g, "v": g}, {"w": None, "v": g}, {"w": g, "v": g},
                                                    {"w": g, "v": g}])
    np.testing.assert_allclose(b["w"], a["w"], rtol=1e-6)


def test_state_has_a_factor_per_axis():
    x = {"w": jnp.zeros((5, 7)), "t": jnp.zeros((1, 4, 2)), "b": jnp.zeros(5), "c": jnp.zeros(())}
    state = optim.setup(optim.Kron(max_size_triangular=6), x)
    shapes = lambda k: [q.shape for q in state[k].state.Qs]    # noqa: E731
    assert shapes("w") == [(5, 5), (7,)]          # 7 > max_size_triangular: diagonal
    assert shapes("t") == [(1,), (4, 4), (2, 2)]  # an axis of length 1: diagonal
    assert shapes("b") == [(5,)] and shapes("c") == [(1,)]


def test_export_and_to_optax_give_the_steps_of_update():
    from jax import export
    rule = optim.Kron(0.05, preconditioner_update_probability=0.5)
    m = {"w": jnp.ones((3, 4)), "b": jnp.ones(3)}
    g = {"w": jnp.arange(12.0).reshape(3, 4) / 10, "b": jnp.ones(3)}
    state = optim.setup(rule, m)
    exp = export.export(jax.jit(optim.update), platforms=["cpu"])(state, m, g)
    got_state, got = exp.call(state, m, g)
    want_state, want = jax.jit(optim.update)(state, m, g)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    tx = optim.to_optax(rule)
    params, opt_state = m, tx.init(m)
    for _ in range(3):
        updates, opt_state = tx.update(g, opt_state, params)
        params = jax.tree.map(lambda a, b: a + b, params, updates)
        state, m = optim.update(state, m, g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, m)
