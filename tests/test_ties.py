"""Ties: identity-derived and explicit tie groups (Optimisers.jl F11, F12, F14, F19 and more)."""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from conftest import arr, close


@pytest.mark.parametrize("grads, tied, copy", [
    ((arr(3, 3), (arr(10, 10), arr(7, 7))), [0, 1], [0, 1]),
    ((arr(3, 3), None), [.7, 1.7], [1, 2]),
    ((None, (arr(5, 5), arr(7, 7))), [.3, 1.3], [.5, 1.5]),
])
def test_tied_positions_step_together_and_a_copy_alone(grads, tied, copy):
    """Optimisers.jl F11: w=[1,2], m=(w, (copy(w), w)), Momentum(.1), a fresh state for each case: the tied
    positions share one summed step and stay one array; the copy steps on its own."""
    w = arr(1, 2)
    model = (w, (jnp.array(w), w))
    state = optim.setup(optim.Momentum(0.1), model)
    assert len(state) == 2 and state.ties() == {"0": ("1.1",)}
    _, new = optim.update(state, model, grads)
    close(new[0], tied)
    close(new[1][1], tied)
    close(new[1][0], copy)
    assert new[0] is new[1][1]


def test_scalar_array_tied_at_three_depths():
    """Optimisers.jl F12: one [3] array tied at three depths, Momentum(.1, .9); the tie survives, also when a
    branch has a None gradient."""
    s = jnp.array([3.0], jnp.float32)
    model = {"a": s, "b": {"c": s}, "d": [[s, 1]]}
    state = optim.setup(optim.Momentum(0.1, 0.9), model)
    g = jnp.array([48.0])
    _, new = optim.update(state, model, {"a": g, "b": {"c": g}, "d": [[g, None]]})
    close(new["a"], [-11.4])
    assert new["a"] is new["b"]["c"] is new["d"][0][0]
    _, new = optim.update(state, model, {"a": g / 2, "b": None, "d": [[g / 2, None]]})
    close(new["b"]["c"], [-1.8])
    assert new["a"] is new["b"]["c"] is new["d"][0][0]


def test_explicit_tie_two_steps():
    """Optimisers.jl F14 (a hand-made shared Leaf, here ties=): a=b tied, Momentum(.1), two steps."""
    a, b, c, d = (arr(1, 2) for _ in range(4))
    model = {"a": a, "b": b, "c": c, "d": d}
    state = optim.setup(optim.Momentum(0.1), model, ties={"b": "a"})
    assert state.ties() == {"a": ("b",)}
    assert state.layout.param("b") == state.layout.param("a")
    g = {"a": arr(3, 3), "b": arr(7, 7), "c": arr(3, 3), "d": arr(10, 10)}
    for _ in range(2):
        state, model = optim.update(state, model, g)
    for k in "abd":
        close(model[k], [-1.9, -0.9])
    close(model["c"], [.13, 1.13])
    assert model["a"] is model["b"]


def test_explicit_tie_canonical_is_target_and_value_comes_from_it():
    model = {"emb": arr(1, 1), "head": arr(5, 5)}
    state = optim.setup(optim.Descent(1.0), model, ties={"emb": "head"})
    assert state.paths() == ["head"] and state.ties() == {"head": ("emb",)}
    _, new = optim.update(state, model, {"emb": arr(1, 1), "head": arr(1, 1)})
    close(new["emb"], [3, 3])           # the canonical value (head) minus the summed gradient
    assert new["emb"] is new["head"]


def test_explicit_and_identity_ties_merge():
    w = arr(1, 2)
    model = {"a": w, "b": w, "c": arr(1, 2)}
    state = optim.setup(optim.Descent(0.1), model, ties={"c": "b"})
    assert len(state) == 1
    _, new = optim.update(state, model, {"a": arr(1, 1), "b": arr(1, 1), "c": arr(1, 1)})
    close(new["a"], [.7, 1.7])
    assert new["a"] is new["b"] is new["c"]


def test_chained_explicit_ties_resolve_to_the_final_target():
    model = {"a": arr(1.), "b": arr(2.), "c": arr(3.)}
    state = optim.setup(optim.Descent(0.1), model, ties={"a": "b", "b": "c"})
    assert state.paths() == ["c"] and set(state.ties()["c"]) == {"a", "b"}


@pytest.mark.parametrize("ties, match", [
    ({"x": "b"}, "'x' is not a leaf"),
    ({"a": "n"}, "'n' is not trainable"),
    ({"a": "v"}, "same shape and dtype"),
    ({"a": "h"}, "same shape and dtype"),
])
def test_bad_explicit_ties(ties, match):
    model = {"a": arr(1, 2), "b": arr(1, 2), "n": 3, "v": arr(1, 2, 3), "h": jnp.ones(2, jnp.float16)}
    with pytest.raises(ValueError, match=match):
        optim.setup(optim.Descent(0.1), model, ties=ties)


def test_transformed_tie_matches_the_exact_gradient():
    # head = emb.T: the model computes the copy inside the loss, which gives the exact gradient to compare with.
    emb = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    x = jnp.array([1.0, 0.1])
    loss_tied = lambda m: jnp.sum((m["emb"] @ jnp.log(m["head"] @ x + 7.0)) ** 2)
    exact = lambda e: loss_tied({"emb": e, "head": e.T})
    model = {"emb": emb, "head": emb.T}
    state = optim.setup(optim.Descent(0.01), model, ties={"head": ("emb", jnp.transpose)})
    assert state.ties() == {"emb": ("head",)} and len(state) == 1
    e = emb
    for _ in range(3):
        state, model = optim.update(state, model, jax.grad(loss_tied)(model))
        e = e - 0.01 * jax.grad(exact)(e)
    close(model["emb"], e)
    np.testing.assert_array_equal(model["head"], model["emb"].T)
    # the same under jit
    s2 = optim.setup(optim.Descent(0.01), {"emb": emb, "head": emb.T}, ties={"head": ("emb", jnp.transpose)})
    m2 = {"emb": emb, "head": emb.T}
    for _ in range(3):
        s2, m2 = jax.jit(optim.update)(s2, m2, jax.grad(loss_tied)(m2))
    close(m2["emb"], e)


def test_transformed_tie_errors():
    model = {"a": jnp.ones((2, 3)), "b": jnp.ones((3, 2)), "c": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="'c' is float32\\[2, 2\\] but transpose\\('a'\\) is float32\\[3, 2\\]"):
        optim.setup(optim.Descent(), model, ties={"c": ("a", jnp.transpose)})
    with pytest.raises(TypeError, match="must be a canonical path \\(str\\) or \\(path, function\\)"):
        optim.setup(optim.Descent(), model, ties={"b": ("a",)})
    with pytest.raises(ValueError, match="'z' is not a leaf"):
        optim.setup(optim.Descent(), model, ties={"b": ("z", jnp.transpose)})


def test_already_summed_gradient_goes_at_the_canonical_path():
    """Optimisers.jl F19 (#193): a gradient given at every tied position is summed (one per position, as
    jax.grad produces); a gradient that is already summed goes at the canonical path with None elsewhere."""
    s = arr(1.0)
    model = {"x": s, "y": s}
    state = optim.setup(optim.Descent(0.1), model)
    g = arr(1.0)
    _, new = optim.update(state, model, {"x": g, "y": g})
    close(new["x"], [.8])
    _, new = optim.update(state, model, {"x": g, "y": None})
    close(new["y"], [.9])


def test_same_subtree_object_twice_ties_all_its_leaves():
    layer = {"w": arr(1, 2), "b": arr(0.5)}
    model = {"l1": layer, "l2": layer}
    state = optim.setup(optim.Adam(0.1), model)
    assert len(state) == 2
    assert state.ties() == {"l1.b": ("l2.b",), "l1.w": ("l2.w",)}


def test_numpy_leaves_tie_by_identity():
    w = np.ones(3, np.float32)
    state = optim.setup(optim.Descent(0.1), [w, w, np.ones(3, np.float32)])
    assert len(state) == 2


def test_tied_adam_matches_untied_with_summed_gradient():
    # The anchors' case from jax-ecosystem.md: loss sum(enc^2) - 10 sum(dec), adam(0.1), 3 steps.
    w = arr(1, 2, 3)
    model = {"enc": w, "dec": w}
    loss = lambda m: jnp.sum(m["enc"] ** 2) - 10 * jnp.sum(m["dec"])
    state = optim.setup(optim.Adam(0.1), model)
    for _ in range(3):
        state, model = optim.update(state, model, jax.grad(loss)(model))
    np.testing.assert_allclose(model["dec"], [1.2997, 2.2996, 3.2994], atol=1e-4)
    assert model["enc"] is model["dec"]


def test_ties_survive_jit_via_static_tie_map():
    w = arr(1, 2)
    model = {"a": w, "b": w}
    state = optim.setup(optim.Momentum(0.1), model)
    step = jax.jit(optim.update)
    for _ in range(3):
        state, model = step(state, model, {"a": arr(1, 1), "b": arr(2, 0)})
    assert model["a"] is not model["b"]        # jit returns separate buffers ...
    close(model["a"], model["b"])               # ... that stay equal, because the state knows the tie
    eager_state = optim.setup(optim.Momentum(0.1), {"a": w, "b": w})
    m = {"a": w, "b": w}
    for _ in range(3):
        eager_state, m = optim.update(eager_state, m, {"a": arr(1, 1), "b": arr(2, 0)})
    close(model["a"], m["a"])


@pytest.fixture
def fresh_trace_warning(monkeypatch):
    """`setup` warns about possible ties under a trace once per model structure in a process: each test that
    checks the warning starts from none given."""
    from optim._base.cache import LRU
    monkeypatch.setattr(sys.modules["optim._core.setup"], "_WARNED_TRACED", LRU(64), raising=False)


def _trace_warnings(record):
    return [r for r in record if issubclass(r.category, UserWarning) and "inside a traced function" in str(r.message)]


def test_setup_inside_jit_with_a_possible_lost_tie_warns_once_and_keeps_the_leaves_apart(fresh_trace_warning):
    """Inside jit each array argument is its own tracer: one array at two positions of a model passed in
    arrives as two objects, so identity cannot find the tie. Two distinct traced leaves of one shape and dtype
    (a possible tie) without `ties=` are separate parameters, with one `UserWarning` naming them (as
    Optimisers.jl's suite expects a warning for setup under a compiler's trace), not an error: `jax.jit(tx.init)`
    and `jax.eval_shape(tx.init, params)` are everyday optax idioms."""
    w = jnp.array([1.0, 2.0, 3.0])
    model = {"emb": w, "head": w, "b": jnp.zeros(2)}
    with pytest.warns(UserWarning, match=r"setup: called inside a traced function .* identity cannot be seen .* "
                                         r"leaves 'emb' and 'head' \(float32\[3\]\) could be one array passed in "
                                         r"twice .* treated as separate parameters. .* ties=\{'head': 'emb'\}") as rec:
        state = jax.jit(lambda m: optim.setup(optim.Descent(0.5), m))(model)
    assert len(_trace_warnings(rec)) == 1
    assert state.ties() == {} and len(state) == 3                      # untied: three parameters
    grads = {"emb": jnp.ones(3), "head": jnp.zeros(3), "b": jnp.ones(2)}
    _, new = optim.update(state, model, grads)
    close(new["emb"], [0.5, 1.5, 2.5])                                 # each position its own gradient
    close(new["head"], w)
    with warnings.catch_warnings(record=True) as again:                # once per model structure
        warnings.simplefilter("always")
        jax.jit(lambda m: optim.setup(optim.Adam(0.1), m).step)(model)
        jax.eval_shape(lambda m: optim.setup(optim.Adam(0.1), m), model)
    assert _trace_warnings(again) == []
    with pytest.warns(UserWarning, match=r"leaves 'a' and 'b' \(float32\[1, 3\]\) could be one array"):   # vmap too
        jax.vmap(lambda m: optim.setup(optim.Adam(0.1), m).step)({"a": jnp.ones((2, 1, 3)), "b": jnp.ones((2, 1, 3))})


def test_setup_inside_jit_with_ties_given_does_not_warn(fresh_trace_warning):
    """`ties=` (`{}`: none) says what a trace cannot see: no warning, and the stated ties are kept; without it
    the same model warns."""
    w = jnp.ones(3)
    model = {"emb": w, "head": w, "b": jnp.zeros(2)}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        tied = jax.jit(lambda m: optim.setup(optim.Adam(0.1), m, ties={"head": "emb"}))(model)
        untied = jax.jit(lambda m: optim.setup(optim.Adam(0.1), m, ties={}))(model)
    assert _trace_warnings(rec) == []
    assert tied.ties() == {"emb": ("head",)} and untied.ties() == {}
    with pytest.warns(UserWarning, match="inside a traced function"):
        jax.jit(lambda m: optim.setup(optim.Adam(0.1), m).step)(model)


def test_setup_inside_jit_with_explicit_ties_keeps_them_and_trains_the_tie_as_one():
    """`ties=` inside jit says which traced leaves are tied (`{}`: none): the explicit tie is kept, and a step
    inside the same jit writes one value to both positions."""
    w = jnp.array([1.0, 2.0, 3.0])
    model = {"emb": w, "head": w, "b": jnp.zeros(2)}
    grads = {"emb": jnp.ones(3), "head": jnp.ones(3), "b": jnp.ones(2)}

    def train(m, g):
        state = optim.setup(optim.Descent(0.5), m, ties={"head": "emb"})
        assert state.ties() == {"emb": ("head",)}         # seen while tracing
        _, new = optim.update(state, m, g)
        return new

    new = jax.jit(train)(model, grads)
    close(new["emb"], [0.0, 1.0, 2.0])                     # the tie's gradients summed: 1 - 0.5 * 2
    close(new["head"], new["emb"], rtol=0, atol=0)
    untied = jax.jit(lambda m: len(optim.setup(optim.Descent(0.5), m, ties={})))(model)
    assert untied == 3                                     # ties={}: no ties, as stated


def test_setup_inside_jit_on_a_model_built_there_finds_ties_by_identity():
    """A model built inside the trace from one tracer holds that tracer object at both positions: identity still
    finds the tie, and leaves that cannot be tied (other shapes or dtypes) need no `ties=`."""
    def build(v):
        m = {"emb": v, "head": v, "b": v[:2] * 0}
        state = optim.setup(optim.Adam(0.1), m)
        assert state.ties() == {"emb": ("head",)}
        return state.step

    assert int(jax.jit(build)(jnp.ones(3))) == 0
    assert int(jax.jit(lambda m: optim.setup(optim.Adam(0.1), m).step)({"a": jnp.ones(3), "b": jnp.ones(2)})) == 0
