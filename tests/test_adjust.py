"""adjust (Optimisers.jl F7): hyperparameters change as data, through chains and MixedPrecision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim


def hyper(x):
    return float(np.asarray(x))


def test_f7_adjust_lr_keeps_state_and_other_fields():
    m = {"g": jnp.ones((4, 3, 2), jnp.float32)}
    state = optim.setup(optim.Momentum(0.1, 0.9), m)
    s2 = optim.adjust(state, 0.2)
    assert hyper(s2.rule.lr) == pytest.approx(0.2) and hyper(s2.rule.rho) == pytest.approx(0.9)
    assert s2.stacks is state.stacks
    s3 = optim.adjust(state, lr=0.3, rho=0.7)
    assert hyper(s3.rule.lr) == pytest.approx(0.3) and hyper(s3.rule.rho) == pytest.approx(0.7)
    assert hyper(state.rule.lr) == pytest.approx(0.1)           # the input is not modified


def test_adjust_reaches_into_chains_and_mixed_precision():
    rule = optim.MixedPrecision(jnp.float32, optim.OptimiserChain(optim.ClipGrad(2.0), optim.Adam(1e-3)))
    state = optim.setup(rule, {"w": jnp.ones(3, jnp.float16)})
    s = optim.adjust(state, 0.2)
    inner = s.rule.rule.rules
    assert hyper(inner[1].lr) == pytest.approx(0.2) and hyper(inner[0].delta) == 2.0
    s = optim.adjust(state, delta=2.5)
    assert hyper(s.rule.rule.rules[0].delta) == 2.5 and hyper(s.rule.rule.rules[1].lr) == pytest.approx(1e-3)


def test_adjust_keeps_abstract_types():
    state = optim.setup(optim.Adam(1e-3), {"w": jnp.ones(2)})
    before = jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", None)), state.rules)
    after = jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", None)),
                         optim.adjust(state, lr=1, beta=[0.5, 0.6], eps=np.float64(1e-5)).rules)
    assert before == after


def test_adjust_bare_rule_and_beta_pair():
    r = optim.adjust(optim.Adam(0.1), beta=(0.8, 0.9))
    assert r.beta == (0.8, 0.9) and r.lr == 0.1


def test_adjust_errors():
    state = optim.setup(optim.OptimiserChain(optim.ClipGrad(2.0), optim.Adam()), {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="no rule here has lrr; adjustable: beta, delta, eps, lr"):
        optim.adjust(state, lrr=0.1)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        optim.adjust(state, -1.0)
    with pytest.raises(TypeError, match="at least one"):
        optim.adjust(state)
    with pytest.raises(ValueError, match="structural"):
        optim.adjust(optim.setup(optim.RMSProp(centred=True), {"w": jnp.ones(2)}), centred=False)
    with pytest.raises(ValueError, match="tuple of 2"):
        optim.adjust(state, beta=0.9)


def test_adjust_inside_jit_with_traced_value():
    m = {"w": jnp.ones(2)}
    state = optim.setup(optim.Descent(1.0), m)

    @jax.jit
    def step(state, m, lr):
        state = optim.adjust(state, lr)
        return optim.update(state, m, {"w": jnp.ones(2)})

    _, out = step(state, m, 0.25)
    np.testing.assert_allclose(out["w"], [0.75, 0.75])
