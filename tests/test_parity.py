"""Parity with optax: 100 steps in float64, rtol 1e-6 (1e-10 for optax.contrib's ADOPT and AdEMAMix), for the
rules optax also has.

The cases come from the registry (`rule_cases.py`): each rule's `optax` cases (`Parity`) and its documented
differences (`optax_differs`, `Differs` with its reason). optim follows Optimisers.jl's conventions; where optax's
differ, optax is configured (or its primitives composed) to match in the `Parity` case, and the `Differs` case
pins the difference: optax's defaults do NOT match. A rule with no `optax` case says why in `no_optax` (or has
`x64_optax` cases, run by test_rules.py); `test_tables.py` checks that every rule says one or the other.

float64 is scoped to this module with `jax.enable_x64(True)` (a context manager in jax 0.10), so other test files
still see float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from rule_cases import PaperBeta3, table

STEPS = 100


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield
    assert jnp.zeros(1).dtype == jnp.float32        # nothing leaks into the other test files


def gradients(steps=STEPS, seed=0):
    """A fixed gradient stream with |g| in [0.5, 2] and random signs (away from 0, see AdaGrad above)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        g = {}
        for k, shape in (("a", (3, 4)), ("b", (5,))):
            mag = rng.uniform(0.5, 2.0, shape)
            g[k] = jnp.asarray(mag * rng.choice([-1.0, 1.0], shape), jnp.float64)
        out.append(g)
    return out


def params0():
    rng = np.random.default_rng(1)
    return {"a": jnp.asarray(rng.standard_normal((3, 4))), "b": jnp.asarray(rng.standard_normal(5))}


def run_optim(rule, grads):
    m = params0()
    assert m["a"].dtype == jnp.float64
    state = optim.setup(rule, m)
    step = jax.jit(optim.update)
    for g in grads:
        state, m = step(state, m, g)
    return m


def run_optax(tx, grads, init=None):
    p = params0()
    s = tx.init(p) if init is None else init(tx.init(p))

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for g in grads:
        p, s = step(p, s, g)
    return p


# (id, make, make_tx, init, rtol, atol) from the registry: every rule's `optax` cases.
PARITY = table("optax")


@pytest.mark.parametrize("case", PARITY, ids=[c.id for c in PARITY])
def test_parity_with_optax_100_steps_float64(case):
    grads = gradients()
    ours = run_optim(case.make(), grads)
    theirs = run_optax(case.make_tx(), grads, case.init)
    start = params0()
    for k in ("a", "b"):
        assert ours[k].dtype == jnp.float64
        np.testing.assert_allclose(ours[k], theirs[k], rtol=case.rtol, atol=0)
        # the displacement too, so that a small total step is compared as tightly as a large one
        np.testing.assert_allclose(ours[k] - start[k], theirs[k] - start[k], rtol=case.rtol, atol=case.atol)


def test_adopt_first_step_only_sets_the_second_moment():
    """optax's first ADOPT update is zero (v ← g², m unchanged), and so is optim's; clipping at t^¼ then
    starts at 1 (optax's `clip_value_fn(count)` with count 1)."""
    grads = gradients(1)
    ours, theirs = run_optim(optim.ADOPT(0.1), grads), run_optax(optax.contrib.adopt(0.1), grads)
    for k in ("a", "b"):
        np.testing.assert_array_equal(ours[k], params0()[k])
        np.testing.assert_array_equal(theirs[k], params0()[k])


def test_ademamix_warmups_change_the_steps():
    """The warmup schedules of the registry's "AdEMAMix warmups" case are used: without them (constant α and β₃)
    the run differs."""
    grads = gradients(20)
    warm = run_optim(optim.AdEMAMix(0.01, beta3=PaperBeta3(0.9, 0.999, 60), alpha=optim.Linear(0.0, 5.0, 80),
                                    weight_decay=0.1), grads)
    flat = run_optim(optim.AdEMAMix(0.01, beta3=0.999, alpha=5.0, weight_decay=0.1), grads)
    assert not np.allclose(warm["a"], flat["a"], rtol=1e-6, atol=0)


# Each documented difference (the registry's `optax_differs`, with its reason), pinned: optax's default convention
# does not match.
DIFFERS = table("optax_differs")


@pytest.mark.parametrize("case", DIFFERS, ids=[c.id for c in DIFFERS])
def test_optax_defaults_differ_where_documented(case):
    assert case.reason
    grads = gradients(10)
    ours, theirs = run_optim(case.make(), grads), run_optax(case.make_tx(), grads)
    assert not np.allclose(ours["a"], theirs["a"], rtol=1e-6, atol=0)


def test_from_optax_parity_in_float64():
    """The optax wrapper keeps float64 end to end and gives optax's numbers."""
    from optim import from_optax

    grads = gradients(20)
    ours = run_optim(from_optax(optax.nadam(0.01)), grads)
    theirs = run_optax(optax.nadam(0.01), grads)
    np.testing.assert_allclose(ours["a"], theirs["a"], rtol=1e-12)
    assert ours["a"].dtype == jnp.float64
