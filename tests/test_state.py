"""State: lookup, repr, pytree behaviour, and a hashable static layout that compares by value."""

import jax
import numpy as np
import jax.numpy as jnp

import optim


def model():
    w = jnp.ones((2, 3))
    return {"emb": w, "layers": [{"w": jnp.ones(3), "b": jnp.zeros(1)}], "head": w, "step": 0}


def test_getitem_any_member_returns_canonical_leaf():
    s = optim.setup(optim.Adam(1e-3), model())
    assert isinstance(s["head"], optim.Leaf)
    jax.tree.map(np.testing.assert_array_equal, s["head"].state, s["emb"].state)
    assert s.layout.param("head") == s.layout.param("emb") and s["layers.0.w"].frozen is False
    assert "head" in s and "step" not in s and "nope" not in s


def test_repr_lists_paths_rules_shapes_frozen_and_ties():
    s = optim.freeze(optim.setup(optim.Momentum(0.1), model()), "layers.0.b")
    text = repr(s)
    assert "State(3 parameters, 4 positions)" in text
    assert "emb: float32[2, 3] Momentum(lr=0.1, rho=0.9) state=float32[2, 3]  tied: head" in text
    assert "layers.0.b: float32[1]" in text and "frozen" in text


def test_layout_is_hashable_and_compares_by_value():
    a, b = optim.setup(optim.Adam(), model()), optim.setup(optim.Adam(), model())
    assert a.layout is not b.layout and a.layout == b.layout and hash(a.layout) == hash(b.layout)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert optim.freeze(a).layout != a.layout


def test_state_is_a_pytree_of_hyperparameters_and_states():
    s = optim.setup(optim.Adam(1e-3), {"w": jnp.ones(3)})
    leaves = jax.tree.leaves(s)
    assert len(leaves) == 4 + 3 + 1  # lr, b1, b2, eps + m, v, (bt1, bt2) + the step counter
    s2 = jax.tree.map(lambda x: x, s)
    assert s2.layout is s.layout


def test_paths_items_ties():
    s = optim.setup(optim.Descent(), model())
    assert s.paths() == ["emb", "layers.0.b", "layers.0.w"]
    assert dict(s.items())["emb"].rule is s.rule
    assert s.ties() == {"emb": ("head",)}


def test_rule_property_is_unambiguous_only():
    s = optim.setup(optim.Descent(), {"w": jnp.ones(1)})
    assert isinstance(s.rule, optim.Descent)
