"""trainables and destructure: each tied array once; rebuild is differentiable and restores ties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim


def test_trainables_unique_in_flatten_order():
    s = jnp.ones(2)
    model = {"x": s, "y": s, "z": jnp.zeros(4), "n": 3, "i": jnp.arange(3)}
    ts = optim.trainables(model)
    assert len(ts) == 2 and ts[0] is s
    assert [p for p, _ in optim.trainables(model, path=True)] == ["x", "z"]


def test_destructure_length_and_ties_restored():
    s = jnp.array([1.0, 2.0])
    model = {"x": s, "y": s, "z": jnp.array([3.0, 4.0, 5.0, 6.0]), "f": "keep"}
    flat, rebuild = optim.destructure(model)
    np.testing.assert_array_equal(flat, [1, 2, 3, 4, 5, 6])          # x once (y is x), then z
    back = rebuild(flat * 2)
    assert back["x"] is back["y"] and back["f"] == "keep"
    np.testing.assert_allclose(back["z"], [6, 8, 10, 12])


def test_gradient_through_rebuild_sums_tied_copies():
    s, t = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    model = {"x": s, "y": t, "z": s}
    flat, rebuild = optim.destructure(model)
    g = jax.grad(lambda v: 3 * jnp.sum(rebuild(v)["x"]) + 13 * jnp.sum(rebuild(v)["z"]))(flat)
    np.testing.assert_allclose(g, [16, 16, 0, 0])
    g = jax.grad(lambda v: 4 * (jnp.sum(rebuild(v)["x"]) + jnp.sum(rebuild(v)["y"]))
                 + 13 * jnp.sum(rebuild(v)["z"]))(flat)
    np.testing.assert_allclose(g, [17, 17, 4, 4])


def test_rebuild_wrong_length_raises():
    _, rebuild = optim.destructure({"a": jnp.ones(3)})
    with pytest.raises(ValueError, match="length 3"):
        rebuild(jnp.ones(4))


def test_dtypes_kept_and_promoted():
    flat, rebuild = optim.destructure({"a": jnp.ones(2, jnp.float16)})
    assert flat.dtype == jnp.float16
    flat, rebuild = optim.destructure({"a": jnp.ones(2, jnp.float16), "b": jnp.ones(1, jnp.float32)})
    assert flat.dtype == jnp.float32
    back = rebuild(flat)
    assert back["a"].dtype == jnp.float16 and back["b"].dtype == jnp.float32


def test_rebuild_under_jit():
    model = {"a": jnp.ones(2), "b": [jnp.zeros((2, 2))]}
    flat, rebuild = optim.destructure(model)
    out = jax.jit(rebuild)(flat + 1)
    np.testing.assert_allclose(out["b"][0], np.ones((2, 2)))


# ----------------------------------------------------------------------------------------- with the state's tie map
def _tied():
    s = jnp.array([1.0, 2.0])
    return {"x": s, "y": s, "z": jnp.array([3.0, 4.0, 5.0, 6.0])}


def test_destructure_under_jit_and_grad_counts_a_tie_once_with_state():
    model = _tied()
    state = optim.setup(optim.Adam(), model)
    np.testing.assert_array_equal(optim.destructure(model)[0], [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(jax.jit(lambda m: optim.destructure(m, state)[0])(model), [1, 2, 3, 4, 5, 6])
    g = jax.grad(lambda m: jnp.sum(optim.destructure(m, state)[0] ** 2))(model)
    # the flat vector holds the canonical 'x' only: the tied position 'y' gets no gradient through it
    np.testing.assert_allclose(g["x"], [2.0, 4.0])
    np.testing.assert_allclose(g["y"], [0.0, 0.0])
    flat, rebuild = optim.destructure(model, state)
    back = rebuild(flat * 2)
    assert back["x"] is back["y"]


def test_trainables_under_jit_with_state():
    model = _tied()
    state = optim.setup(optim.Adam(), model)
    n = jax.jit(lambda m: sum(a.size for a in optim.trainables(m, state)))(model)
    assert int(n) == 6
    assert [p for p, _ in optim.trainables(model, state, path=True)] == ["x", "z"]
    assert [p for p, _ in optim.trainables(model, True)] == ["x", "z"]   # old positional path=True


def test_traced_model_without_state_warns():
    model = _tied()
    with pytest.warns(UserWarning, match="destructure\\(model, state\\)"):
        jax.eval_shape(lambda m: optim.destructure(m)[0], model)
    with pytest.warns(UserWarning, match="trainables\\(model, state\\)"):
        jax.eval_shape(lambda m: len(optim.trainables(m)), model)


def test_destructure_with_state_checks_structure_and_type():
    state = optim.setup(optim.Adam(), _tied())
    with pytest.raises(ValueError, match="does not have the structure.*missing 'z'"):
        optim.destructure({"x": jnp.ones(2), "y": jnp.ones(2)}, state)
    with pytest.raises(TypeError, match="second argument is the State from optim.setup, got dict"):
        optim.destructure(_tied(), {"x": 1})


def test_destructure_with_transformed_tie_rebuilds_the_function():
    a = jnp.arange(6.0).reshape(2, 3)
    model = {"a": a, "b": a.T}
    state = optim.setup(optim.Descent(), model, ties={"b": ("a", jnp.transpose)})
    flat, rebuild = optim.destructure(model, state)
    np.testing.assert_array_equal(flat, np.arange(6.0))               # a only: b is its transpose
    back = rebuild(flat + 1)
    np.testing.assert_allclose(back["b"], (a + 1).T)
