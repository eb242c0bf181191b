"""optax interop: `from_optax` (any per-parameter optax transformation, tie-aware) and `to_optax` (an optim rule
in an unmodified optax loop).

The reference for "tie-aware" throughout: optax itself run on the *deduplicated* tree (each tied array once)
fed the summed gradient of its tied positions; optim must give exactly that, and write it to every position.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from optim import WholeTreeError, from_optax, to_optax, with_extra_args
from conftest import close


def tied_model():
    w = jnp.array([[1.0, -2.0, 0.5], [0.3, 0.8, -1.2]])
    return {"emb": w, "head": w, "b": jnp.array([0.1, -0.4, 0.2]), "step": 3}


def loss(m):
    h = jnp.tanh(m["emb"] @ jnp.array([0.5, -1.0, 2.0]))
    return jnp.sum((m["head"].T @ h + m["b"] - jnp.array([1.0, 0.0, -1.0])) ** 2) + 0.1 * jnp.sum(m["emb"] ** 2)


def dedup(m):
    return {"emb": m["emb"], "b": m["b"]}


def summed(g):
    return {"emb": g["emb"] + g["head"], "b": g["b"]}


def run_optim(rule, steps=3, model=None):
    m = tied_model() if model is None else model
    state = optim.setup(rule, m)
    for _ in range(steps):
        state, m = optim.update(state, m, jax.grad(loss, allow_int=True)(m))
    return state, m


def run_reference(tx, steps=3):
    """optax on the deduplicated tree, fed the summed gradient: what a tie-aware optimiser must do."""
    m = tied_model()

    @jax.jit
    def step(p, s):
        full = {**m, "emb": p["emb"], "head": p["emb"], "b": p["b"]}
        u, s = tx.update(summed(jax.grad(loss, allow_int=True)(full)), s, p)
        return optax.apply_updates(p, u), s

    p = dedup(m)
    s = tx.init(p)
    for _ in range(steps):
        p, s = step(p, s)
    return p


# ------------------------------------------------------------------------------------------ from_optax
PER_LEAF = {
    "adam": lambda: optax.adam(0.05),
    "lion": lambda: optax.lion(0.01),
    "adafactor": lambda: optax.adafactor(0.05),
    "lamb": lambda: optax.lamb(0.05),
    "muon": lambda: optax.contrib.muon(0.05),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(0.05),
    "multisteps": lambda: optax.MultiSteps(optax.adam(0.05), every_k_schedule=2),
    "masked_callable": lambda: optax.chain(optax.masked(optax.add_decayed_weights(0.1),
                                                      lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
                                         optax.adam(0.05)),
    "schedule": lambda: optax.adamw(optax.linear_schedule(0.05, 0.01, 3), weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(PER_LEAF))
def test_from_optax_is_tie_aware_for_many_optax_optimisers(name):
    state, m = run_optim(from_optax(PER_LEAF[name]()))
    ref = run_reference(PER_LEAF[name]())
    close(m["emb"], ref["emb"], rtol=2e-5)
    close(m["b"], ref["b"], rtol=2e-5)
    assert m["head"] is m["emb"] and m["step"] == 3
    assert state.ties() == {"emb": ("head",)}


def test_sign_convention_and_exact_step():
    m = {"w": jnp.array([1.0, 2.0])}
    state = optim.setup(from_optax(optax.sgd(0.1)), m)
    _, out = optim.update(state, m, {"w": jnp.array([1.0, -3.0])})
    close(out["w"], [0.9, 2.3], atol=1e-7)            # optax adds -0.1 g; optim subtracts the step 0.1 g


def test_none_gradient_and_freeze_do_not_advance_optax_state():
    m = tied_model()
    state = optim.setup(from_optax(optax.adam(0.1)), m)
    g = jax.grad(loss, allow_int=True)(m)
    s1, m1 = optim.update(state, m, {**g, "b": None})
    close(m1["b"], m["b"], atol=1e-7)
    assert int(s1["b"].state[0].count) == 0 and int(s1["emb"].state[0].count) == 1
    s2, m2 = optim.update(optim.freeze(s1, "head"), m1, g)       # freezing a member freezes the group
    close(m2["emb"], m1["emb"], atol=1e-7)
    assert m2["emb"] is m2["head"]
    assert int(s2["emb"].state[0].count) == 1 and int(s2["b"].state[0].count) == 1


def test_complex_parameter_descends_like_optim_descent():
    m = {"z": jnp.array([1.0 + 2.0j, -0.5j])}
    lossc = lambda p: jnp.sum(jnp.abs(p["z"] - (0.3 + 0.1j)) ** 2)
    a = optim.setup(from_optax(optax.sgd(0.1)), m)
    b = optim.setup(optim.Descent(0.1), m)
    ma = mb = m
    for _ in range(3):
        a, ma = optim.update(a, ma, jax.grad(lossc)(ma))
        b, mb = optim.update(b, mb, jax.grad(lossc)(mb))
    close(ma["z"], mb["z"], atol=1e-7)
    assert lossc(ma) < lossc(m)


def test_chain_with_clip_global_norm_counts_the_tie_once():
    m = {"enc": jnp.zeros(2), "dec": None}
    m["dec"] = m["enc"]
    g = {"enc": jnp.array([3.0, 4.0]), "dec": jnp.array([3.0, 4.0])}
    state = optim.setup(optim.chain(optim.ClipGlobalNorm(1.0), from_optax(optax.sgd(1.0))), m)
    _, out = optim.update(state, m, g)
    close(out["enc"], [-0.6, -0.8], atol=1e-7)        # the summed gradient [6, 8] clipped to norm 1
    assert out["enc"] is out["dec"]


def test_gradient_like_stage_inside_an_optim_chain():
    m = {"w": jnp.array([1.0, -1.0, 0.0])}
    g = {"w": jnp.array([3.0, -0.2, 0.7])}
    a = optim.setup(optim.chain(from_optax(optax.clip(0.5), gradient_like=True), optim.Descent(1.0)), m)
    b = optim.setup(optim.chain(optim.ClipGrad(0.5), optim.Descent(1.0)), m)
    close(optim.update(a, m, g)[1]["w"], optim.update(b, m, g)[1]["w"], atol=1e-7)
    with pytest.raises(TypeError, match="point along the gradient.*gradient_like=True"):
        optim.setup(from_optax(optax.scale_by_adam()), m)
    with pytest.raises(TypeError, match="point against the gradient.*drop gradient_like"):
        optim.setup(from_optax(optax.adam(0.1), gradient_like=True), m)


# ------------------------------------------------------------------------------------------ whole-tree
def _global_scale():
    """A user-written whole-tree transformation that no name list knows: scales by 1 / global norm."""
    def update(u, s, params=None):
        n = optax.tree.norm(u)
        return jax.tree.map(lambda g: -g / n, u), s
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


WHOLE_TREE = {
    "clip_by_global_norm": (lambda: optax.clip_by_global_norm(1.0), "optim.ClipGlobalNorm"),
    "clip_in_chain": (lambda: optax.chain(optax.clip_by_global_norm(1e9), optax.adam(1e-3)), "optim.ClipGlobalNorm"),
    "lbfgs": (lambda: optax.lbfgs(), "scale_by_lbfgs.*optim.destructure"),
    "apply_if_finite": (lambda: optax.apply_if_finite(optax.adam(1e-3), 3), "optim.SkipNonFinite"),
    "polyak_sgd": (lambda: optax.polyak_sgd(), "scale_by_polyak"),
    "normalize_by_update_norm": (lambda: optax.chain(optax.normalize_by_update_norm(), optax.scale(-1.0)),
                                 "normalize_by_update_norm"),
    "prodigy": (lambda: optax.contrib.prodigy(), "prodigy"),
    "multisteps_skip": (lambda: optax.MultiSteps(optax.adam(1e-3), 2, should_skip_update_fn=optax.skip_not_finite),
                        "skip_not_finite"),
    "dog_by_probe": (lambda: optax.contrib.dog(), "scale_by_dog .inside chain.* combines the arrays"),
    "custom_by_probe": (_global_scale, "_global_scale.* combines the arrays"),
}


@pytest.mark.parametrize("name", sorted(WHOLE_TREE))
def test_whole_tree_transformations_are_refused_with_a_clear_error(name):
    make, pattern = WHOLE_TREE[name]
    with pytest.raises(WholeTreeError, match=pattern) as info:
        optim.setup(from_optax(make()), {"w": jnp.ones((2, 3)), "b": jnp.ones(3)})
    assert isinstance(info.value, TypeError) and "setup: at " in str(info.value)


def _transform(update):
    return optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (update(u), s))


PROBE = {   # name: (transformation, whole-tree?) -- the dependency probe looks through control flow
    "fori_loop": (_transform(lambda u: jax.tree.map(
        lambda g: -jax.lax.fori_loop(0, 3, lambda i, v: 0.5 * v + g, g), u)), False),
    "scan": (_transform(lambda u: jax.tree.map(
        lambda g: -jax.lax.scan(lambda c, _: (c * 0.9, None), g, None, length=2)[0], u)), False),
    "cond_per_leaf": (_transform(lambda u: jax.tree.map(
        lambda g: jax.lax.cond(jnp.sum(g) > 0, lambda: -g, lambda: -2.0 * g), u)), False),
    "jit_and_custom_jvp": (_transform(lambda u: jax.tree.map(lambda g: -jax.jit(jax.nn.relu)(g) - g, u)), False),
    "cond_on_global_sum": (_transform(lambda u: jax.tree.map(lambda g: jax.lax.cond(
        sum(jnp.sum(x) for x in jax.tree.leaves(u)) > 0, lambda: -g, lambda: -2.0 * g), u)), True),
    "while_global_norm": (_transform(lambda u: jax.tree.map(lambda g: -g / jax.lax.while_loop(
        lambda n: n < 1.0, lambda n: n * 2.0, optax.tree.norm(u) + 0.1), u)), True),
}


@pytest.mark.parametrize("name", sorted(PROBE))
def test_dependency_probe_through_control_flow(name):
    tx, whole = PROBE[name]
    m = {"w": jnp.array([[1.0, -2.0]]), "b": jnp.array([0.5, 0.5])}
    if whole:
        with pytest.raises(WholeTreeError, match="combines the arrays"):
            optim.setup(from_optax(tx), m)
    else:
        optim.setup(from_optax(tx), m)


def test_unhashable_transformation_is_refused():
    class Tx:
        __hash__ = None
        init = staticmethod(lambda p: ())
        update = staticmethod(lambda u, s, p=None: (u, s))

    with pytest.raises(TypeError, match="not hashable"):
        from_optax(Tx())


def test_check_false_skips_the_probe_and_gives_per_parameter_results():
    m = {"a": jnp.zeros(2), "b": jnp.zeros(1)}
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([2.0])}
    state = optim.setup(from_optax(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), check=False), m)
    _, out = optim.update(state, m, g)
    close(out["a"], [-0.6, -0.8], atol=1e-7)          # per parameter: each clipped to norm 1 (like ClipNorm)
    close(out["b"], [-1.0], atol=1e-7)


def test_transformation_needing_extra_args_or_a_tree_mask_explains():
    with pytest.raises(TypeError, match="could not run reduce_on_plateau.*extra_args"):
        optim.setup(from_optax(optax.contrib.reduce_on_plateau()), {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="could not run masked"):
        optim.setup(from_optax(optax.masked(optax.adam(0.1), {"w": True})), {"w": jnp.ones(2)})


def test_bad_arguments():
    with pytest.raises(TypeError, match="expected an optax GradientTransformation"):
        from_optax(3)
    with pytest.raises(TypeError, match="go with a factory"):
        from_optax(optax.adam(0.1), lr=0.1)
    with pytest.raises(TypeError, match="does not take these arguments"):
        from_optax(optax.adam, lr=0.1, bogus=2.0)
    with pytest.raises(TypeError, match="missing 1 required"):
        from_optax(optax.adam)
    with pytest.raises(TypeError, match="neither a number nor hashable"):
        from_optax(optax.adam, lr=0.1, mu_dtype=[1])
    with pytest.raises(TypeError, match="extra_args must be a dict"):
        from_optax(optax.adam(0.1), extra_args=[("value", 1.0)])


def test_repr():
    assert repr(from_optax(optax.adam(1e-3))) == "from_optax(chain(scale_by_adam, scale))"
    assert repr(from_optax(optax.adam, lr=0.1, nesterov=True)) == "from_optax(adam, lr=0.1, nesterov=True)"


# ------------------------------------------------------------------------------------------ hyperparameters
def test_factory_form_is_adjustable_without_retracing():
    m = tied_model()
    g = jax.grad(loss, allow_int=True)(m)
    traces = []

    @jax.jit
    def step(state, m):
        traces.append(1)
        return optim.update(state, m, g)

    state = optim.setup(from_optax(optax.adam, lr=0.1, b1=0.9), m)
    s1, m1 = step(state, m)
    s2, m2 = step(optim.adjust(s1, lr=0.01, b1=0.5), m1)
    assert len(traces) == 1
    # Same as running optax.adam(0.01, b1=0.5) from the first step's optax state:
    tx = optax.adam(0.01, b1=0.5)
    u, _ = tx.update(summed(g)["emb"], s1["emb"].state, m1["emb"])
    close(m2["emb"], m1["emb"] + u, atol=1e-7)
    assert float(s2["emb"].rule.lr) == pytest.approx(0.01)


def test_factory_form_takes_an_optim_schedule_at_optims_step():
    m = {"w": jnp.array([1.0, 2.0])}
    g = {"w": jnp.array([1.0, 1.0])}
    a = optim.setup(from_optax(optax.sgd, lr=optim.Linear(0.1, 0.0, 4)), m)
    b = optim.setup(optim.Descent(optim.Linear(0.1, 0.0, 4)), m)
    ma = mb = m
    for _ in range(3):
        a, ma = optim.update(a, ma, g)
        b, mb = optim.update(b, mb, g)
    close(ma["w"], mb["w"], atol=1e-7)
    close(ma["w"], [1.0 - 0.1 - 0.075 - 0.05, 2.0 - 0.225], atol=1e-7)


def test_inject_hyperparams_keeps_values_in_each_parameters_state():
    m = tied_model()
    state = optim.setup(from_optax(optax.inject_hyperparams(optax.adam)(learning_rate=0.1)), m)
    assert float(state["head"].state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    # Changing them means rewriting every parameter's state (the factory form is the easy way):
    # (states are stacked per group of parameters: one learning rate per member)
    stacks = tuple(s._replace(hyperparams={**s.hyperparams, "learning_rate": np.full_like(
        s.hyperparams["learning_rate"], 0.01)}) for s in state.stacks)
    state = optim.State(state.layout, state.rules, stacks, state.step)
    _, m1 = optim.update(state, m, jax.grad(loss, allow_int=True)(m))
    close(m1["emb"], run_reference(optax.adam(0.01), steps=1)["emb"], atol=1e-7)


# ------------------------------------------------------------------------------------------ extra args
def test_extra_args_reach_the_optax_update():
    tx = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
    rule = from_optax(tx, extra_args={"value": 0.0})
    m = {"w": jnp.array([1.0, 2.0])}
    g = {"w": jnp.array([1.0, 1.0])}
    state = optim.setup(rule, m)
    p, s = m, tx.init(m)
    tx_update = jax.jit(tx.update)
    for value in (3.0, 2.0, 2.5, 2.6):                 # no improvement after the second: lr halves
        state = with_extra_args(state, value=value)
        state, m = optim.update(state, m, g)
        u, s = tx_update(g, s, p, value=value)
        p = optax.apply_updates(p, u)
        close(m["w"], p["w"], atol=1e-7)
    assert float(state["w"].state[1].scale) == pytest.approx(0.25)
    with pytest.raises(TypeError, match="no from_optax rule"):
        with_extra_args(optim.setup(optim.Adam(), m), value=1.0)


def _scaled_sgd():
    """A per-parameter optax transformation with a tree-shaped extra argument `scale`."""
    def update(u, s, params=None, *, scale):
        return jax.tree.map(lambda g, c: -g * c, u, scale), s
    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def test_tree_args_are_summed_over_ties_like_gradients():
    rule = from_optax(_scaled_sgd(), tree_args=("scale",))
    m = tied_model()
    g = jax.tree.map(jnp.ones_like, {k: v for k, v in m.items() if k != "step"}) | {"step": None}
    c = {"emb": jnp.full((2, 3), 0.5), "head": jnp.full((2, 3), 0.25), "b": jnp.full(3, 2.0), "step": None}
    state = optim.setup(rule, m)
    _, out = optim.update(state, m, g, c)
    close(out["emb"], m["emb"] - 2.0 * 0.75, atol=1e-7)  # summed gradient 2, summed scale 0.75
    close(out["b"], m["b"] - 2.0, atol=1e-7)
    with pytest.raises(TypeError, match="tree_args"):
        optim.update(state, m, g)


# ------------------------------------------------------------------------------------------ to_optax
def optax_loop(tx, params, steps=3, grad_fn=None, jit=True, **extra):
    """An unmodified optax training loop."""
    grad_fn = grad_fn or jax.grad(loss, allow_int=True)

    def train_step(params, opt_state):
        grads = grad_fn(params)
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    if jit:
        train_step = jax.jit(train_step)
    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state = train_step(params, opt_state)
    return params, opt_state


@pytest.mark.parametrize("jit", [True, False])
def test_to_optax_in_an_unmodified_optax_loop_is_tie_correct(jit):
    params, opt_state = optax_loop(to_optax(optim.Adam(0.05)), tied_model(), jit=jit)
    _, m = run_optim(optim.Adam(0.05))
    close(params["emb"], m["emb"], rtol=1e-5, atol=1e-7)
    close(params["head"], m["emb"], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(params["emb"], params["head"])   # tied positions stay equal
    close(params["b"], m["b"], rtol=1e-5, atol=1e-7)
    assert int(params["step"]) == 3
    assert isinstance(opt_state, optim.State) and opt_state.ties() == {"emb": ("head",)}


def test_to_optax_of_from_optax_matches_optax_on_the_deduplicated_tree():
    params, _ = optax_loop(to_optax(from_optax(optax.adam(0.05))), tied_model())
    ref = run_reference(optax.adam(0.05))
    close(params["emb"], ref["emb"], rtol=1e-5, atol=1e-7)
    close(params["head"], ref["emb"], rtol=1e-5, atol=1e-7)


def test_to_optax_extra_args_are_per_call_and_keep_the_state_structure():
    inner = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
    tx = to_optax(from_optax(inner, extra_args={"value": 0.0}))
    m = {"w": jnp.array([1.0, 2.0])}
    g = {"w": jnp.array([1.0, 1.0])}
    traces = []

    @jax.jit
    def train_step(p, s, value):
        traces.append(1)
        u, s = tx.update(g, s, p, value=value)
        return optax.apply_updates(p, u), s

    s0 = tx.init(m)
    p, s = m, s0
    rp, rs = m, inner.init(m)
    inner_update = jax.jit(inner.update)
    for value in (3.0, 2.0, 2.5, 2.6):
        p, s = train_step(p, s, value)
        u, rs = inner_update(g, rs, rp, value=value)
        rp = optax.apply_updates(rp, u)
        close(p["w"], rp["w"], atol=1e-7)
    assert len(traces) == 1
    assert jax.tree.structure(s) == jax.tree.structure(s0)

    # ... so the optax state can be a lax.scan carry
    def body(carry, value):
        p, s = carry
        u, s = tx.update(g, s, p, value=value)
        return (optax.apply_updates(p, u), s), None

    (p2, _), _ = jax.lax.scan(body, (m, s0), jnp.array([3.0, 2.0, 2.5, 2.6]))
    close(p2["w"], rp["w"], atol=1e-7)


def test_to_optax_as_the_last_stage_of_an_optax_chain_and_errors():
    tx = optax.chain(optax.clip(0.5), to_optax(optim.Descent(1.0)))
    m = {"w": jnp.array([1.0, 1.0])}
    s = tx.init(m)
    u, s = tx.update({"w": jnp.array([3.0, -0.1])}, s, m)
    close(optax.apply_updates(m, u)["w"], [0.5, 1.1], atol=1e-7)
    t = to_optax(optim.Adam())
    with pytest.raises(ValueError, match="needs params"):
        t.update(m, t.init(m))
    with pytest.raises(TypeError, match="expected the state"):
        t.update(m, optax.adam(0.1).init(m), m)
    with pytest.raises(TypeError, match="not an optim rule"):
        to_optax(3)


def test_to_optax_explicit_transposed_tie():
    emb = jnp.array([[1.0, 2.0, 0.5], [0.0, -1.0, 1.0]])
    params = {"emb": emb, "head": emb.T}
    lossf = lambda p: jnp.sum((p["head"] @ jnp.array([1.0, -1.0]) - 1.0) ** 2) + jnp.sum(p["emb"][0] ** 2)
    tx = to_optax(optim.Descent(0.1), ties={"head": ("emb", jnp.transpose)})
    out, _ = optax_loop(tx, params, steps=2, grad_fn=jax.grad(lossf))
    ref = {"e": emb}
    for _ in range(2):
        ref = {"e": ref["e"] - 0.1 * jax.grad(lambda e: lossf({"emb": e, "head": e.T}))(ref["e"])}
    close(out["emb"], ref["e"], atol=1e-7)
    close(out["head"], ref["e"].T, atol=1e-7)


# ------------------------------------------------------------------------------------------ to_optax: traced init
# optax users write `jax.jit(tx.init)(params)` and `jax.eval_shape(tx.init, params)` (the target of an orbax
# restore); a trace cannot see identity, so these must work on a model of same-shaped leaves (every transformer).
@pytest.fixture
def fresh_trace_warning(monkeypatch):
    """`setup` warns about possible ties under a trace once per model structure in a process: start from none."""
    import sys

    from optim._base.cache import LRU
    monkeypatch.setattr(sys.modules["optim._core.setup"], "_WARNED_TRACED", LRU(64), raising=False)


def _two_same_shaped():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (3, 4), jnp.float32), "w2": jax.random.normal(k2, (3, 4), jnp.float32)}


def _trace_warnings(record):
    return [r for r in record if issubclass(r.category, UserWarning) and "inside a traced function" in str(r.message)]


def test_to_optax_init_under_jit_and_eval_shape_works_and_steps_as_an_eager_init(fresh_trace_warning):
    params = _two_same_shaped()
    grads = {"w1": jnp.full((3, 4), 0.5), "w2": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)}
    tx = to_optax(optim.Adam(1e-3))
    with pytest.warns(UserWarning, match=r"inside a traced function .* leaves 'w1' and 'w2' \(float32\[3, 4\]\) "
                                         r"could be one array .* to_optax\(rule, ties=\.\.\.\)") as rec:
        traced = jax.jit(tx.init)(params)
    assert len(_trace_warnings(rec)) == 1                      # once, not again for eval_shape on this structure
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        abstract = jax.eval_shape(tx.init, params)
    assert _trace_warnings(again) == []
    eager = tx.init(params)
    assert traced.ties() == {} and len(traced) == 2
    assert jax.tree.structure(abstract) == jax.tree.structure(eager)           # an orbax restore target
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(abstract)] == \
        [(a.shape, a.dtype) for a in jax.tree.leaves(eager)]
    step = jax.jit(tx.update)
    u_traced, s_traced = step(grads, traced, params)
    u_eager, s_eager = step(grads, eager, params)
    for k in params:
        close(u_traced[k], u_eager[k], rtol=0, atol=0)
    close(s_traced["w2"].state[0], s_eager["w2"].state[0], rtol=0, atol=0)


def test_to_optax_traced_init_uses_given_or_eagerly_found_ties_without_warning(fresh_trace_warning):
    w = jnp.array([1.0, 2.0, 3.0])
    tied = {"emb": w, "head": w, "b": jnp.zeros(3)}
    given = to_optax(optim.Adam(1e-3), ties={"head": "emb"})
    seen = to_optax(optim.Adam(1e-3))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert jax.jit(given.init)(tied).ties() == {"emb": ("head",)}
        assert jax.eval_shape(given.init, tied).ties() == {"emb": ("head",)}
        assert seen.init(tied).ties() == {"emb": ("head",)}              # eager: found by identity ...
        assert jax.jit(seen.init)(tied).ties() == {"emb": ("head",)}     # ... and reused under a trace
        assert jax.eval_shape(seen.init, tied).ties() == {"emb": ("head",)}
        untied = {"emb": w, "head": jnp.array(w), "b": jnp.zeros(3)}
        assert seen.init(untied).ties() == {}                            # the last eager init's ties count
        assert jax.jit(lambda p: seen.init(p))(untied).ties() == {}     # (jit(seen.init) keeps its trace)
    assert _trace_warnings(rec) == []
    # a model of other shapes is not the one the eager init saw: treated as untied, with the warning
    with pytest.warns(UserWarning, match="inside a traced function"):
        assert jax.jit(seen.init)({"emb": jnp.ones(2), "head": jnp.ones(2), "b": jnp.zeros(3)}).ties() == {}


def test_to_optax_jitted_init_and_update_match_optax_adam():
    # optax's transform_test pattern (`state = jax.jit(tx.init)(params)`, then `jax.jit(tx.update)`), ported onto
    # to_optax for a params dict of two equal-shaped leaves, which a traced init cannot tell from a tie
    params = _two_same_shaped()
    lossf = lambda p: jnp.sum(jnp.sin(p["w1"]) * p["w2"]) + jnp.sum(p["w2"] ** 2)
    ours, ref = to_optax(optim.Adam(1e-3)), optax.adam(1e-3)

    def run(tx):
        p = params
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            state = jax.jit(tx.init)(p)

        @jax.jit
        def step(p, state):
            updates, state = tx.update(jax.grad(lossf)(p), state, p)
            return optax.apply_updates(p, updates), state, updates

        out = []
        for _ in range(5):
            p, state, updates = step(p, state)
            out.append((p, updates))
        return out

    mine, theirs = run(ours), run(ref)
    for (p, u), (rp, ru) in zip(mine, theirs):
        for k in params:
            close(u[k], ru[k], rtol=1e-4, atol=1e-7)     # optax rounds 1 - b2 from Python's 0.001 (see below)
            close(p[k], rp[k], rtol=1e-6, atol=1e-6)
    assert not np.allclose(mine[-1][0]["w1"], mine[-1][0]["w2"])       # two parameters, not one


# ------------------------------------------------------------------------------------------ to_optax in flax NNX
# `nnx.Optimizer(model, tx, wrt=nnx.Param)` calls `tx.init(nnx.state(model, wrt))` (a `nnx.State` of Variables),
# then, in `optimizer.update(model, grads)`, `tx.update` on `nnx.as_pure` trees of plain arrays.
def _nnx_mlp(nnx):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 8, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)
            self.count = nnx.Variable(jnp.array(0))          # not a Param: not in the optimiser's state

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    return MLP


def _nnx_train(nnx, tx, steps=5, jit=False, graph=None):
    model = _nnx_mlp(nnx)(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param, graph=graph)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    y = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.5, -0.5], [-1.0, 2.0]])

    def step(model, optimizer):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    step = nnx.jit(step) if jit else step
    for _ in range(steps):
        step(model, optimizer)
    return model, optimizer


@pytest.mark.parametrize("jit, graph", [(False, None), (True, None), (True, False)])
def test_to_optax_in_nnx_optimizer_matches_optax_adam(jit, graph):
    nnx = pytest.importorskip("flax.nnx")
    model, opt = _nnx_train(nnx, to_optax(optim.Adam(1e-2)), jit=jit, graph=graph)
    ref, _ = _nnx_train(nnx, optax.adam(1e-2), jit=True, graph=graph)     # (jitted: faster to compile)
    ours, theirs = nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(nnx.state(ref, nnx.Param))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    # optax rounds 1 - b2 from Python's 0.001, optim from float32(0.999) (0.00099998713): v differs by 1.3e-5
    # relative, the step by ~6e-6; measured up to 7.1e-6 here after 5 steps.
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        close(a, b, rtol=2e-5, atol=1e-7)
    first = nnx.as_pure(nnx.state(_nnx_mlp(nnx)(nnx.Rngs(0)), nnx.Param))
    assert all(np.max(np.abs(a - b)) > 0.04 for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(first)))

    # ... and it is exactly optim.update on the same (pure) parameter tree
    graphdef, params, rest = nnx.split(_nnx_mlp(nnx)(nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.as_pure(params)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    y = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.5, -0.5], [-1.0, 2.0]])
    grad = jax.jit(jax.grad(lambda p: jnp.mean((nnx.merge(graphdef, p, rest)(x) - y) ** 2)))
    state = optim.setup(optim.Adam(1e-2), params)
    for _ in range(5):
        state, params = optim.update(state, params, grad(params))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params)):
        close(a, b, atol=1e-8)

    assert int(opt.step[...]) == 5 and int(model.count[...]) == 0
    # nnx keeps optim's State (each leaf wrapped in an nnx OptArray), with nnx's paths: no ".value"
    opt_state = nnx.as_pure(opt.opt_state)
    assert isinstance(opt_state, optim.State) and int(opt_state.step) == 5
    assert sorted(opt_state.paths()) == ["l1.bias", "l1.kernel", "l2.bias", "l2.kernel"]
    m, v, _ = opt_state["l2.kernel"].state
    assert m.shape == v.shape == (8, 2)
    want_m, want_v, _ = state["l2.kernel"].state               # the moments of the pure optim run above
    close(m, want_m, atol=1e-8)
    close(v, want_v, atol=1e-8)


def test_to_optax_in_nnx_optimizer_counts_a_shared_param_once():
    # One nnx.Param referenced from two attributes: nnx's graph-mode state lists it once (at "emb", the
    # alphabetically first path) and nnx.grad sums both uses, so the tie is one parameter with one Adam state.
    nnx = pytest.importorskip("flax.nnx")
    start = tied_model()

    class Tied(nnx.Module):
        def __init__(self):
            self.emb = nnx.Param(start["emb"])
            self.head = self.emb                          # the same Variable object
            self.b = nnx.Param(start["b"])

    def nnx_loss(m):
        return loss({"emb": m.emb[...], "head": m.head[...], "b": m.b[...]})

    @nnx.jit
    def train_step(model, optimizer):
        optimizer.update(model, nnx.grad(nnx_loss)(model))

    model = Tied()
    optimizer = nnx.Optimizer(model, to_optax(optim.Adam(0.05)), wrt=nnx.Param)
    for _ in range(3):
        train_step(model, optimizer)
    assert model.head is model.emb
    state = nnx.as_pure(optimizer.opt_state)
    assert state.paths() == ["b", "emb"] and state.ties() == {}    # the tie is one parameter, one Adam state

    _, m = run_optim(optim.Adam(0.05))                      # optim on the dict model with emb and head tied
    close(model.emb[...], m["emb"], rtol=1e-5, atol=1e-7)
    close(model.b[...], m["b"], rtol=1e-5, atol=1e-7)


def test_to_optax_init_unwraps_variables_and_ties_a_repeated_variable():
    # A tree built by hand that holds one Variable at two positions: one parameter, as for a repeated array.
    nnx = pytest.importorskip("flax.nnx")
    v = nnx.Param(jnp.array([1.0, -2.0, 3.0]))
    tx = to_optax(optim.Adam(0.1))
    s = tx.init({"a": v, "b": v, "c": nnx.Param(jnp.array([0.5, 0.5, 0.5])), "n": nnx.Variable(jnp.array(2))})
    assert s.ties() == {"a": ("b",)}
    assert s.paths() == ["a", "c"] and s["b"].state[0].shape == (3,)
    close(s["b"].state[0], np.zeros(3), rtol=0, atol=0)          # Adam's first moment starts at zero
    # the update then takes plain arrays (what nnx.as_pure gives) and keeps the tie
    p = {"a": v[...], "b": v[...] + 0.0, "c": jnp.array([0.5, 0.5, 0.5]), "n": jnp.array(2)}
    g = {"a": jnp.array([1.0, 1.0, 1.0]), "b": jnp.array([2.0, -4.0, 1.0]), "c": jnp.ones(3), "n": None}
    u, s = tx.update(g, s, p)
    new = optax.apply_updates(p, u)
    ref_state = optim.setup(optim.Adam(0.1), {"a": v[...], "b": v[...]})
    _, ref = optim.update(ref_state, {"a": v[...], "b": v[...]}, {"a": g["a"], "b": g["b"]})
    close(new["a"], ref["a"], atol=1e-7)
    np.testing.assert_array_equal(new["a"], new["b"])
    assert int(new["n"]) == 2


# ----------------------------------------------------------------------------------------- to_optax in optax's protocol
def _abs_sq(z):
    return (z.conj() * z).real


def _parabola(dtype):
    """optax's `alias_test._setup_parabola`."""
    start = jnp.array([-1.0, 10.0, 1.0], dtype=dtype)
    target = jnp.array([1.0, -1.0, 1.0], dtype=dtype) * (1 + 1j if jnp.iscomplexobj(start) else 1)
    return start, target, lambda p: jnp.sum(_abs_sq(p - target))


def _rosenbrock(dtype):
    """optax's `alias_test._setup_rosenbrock`."""
    a, b = (1.0 + 1.0j if jnp.iscomplexobj(jnp.zeros((), dtype)) else 1.0), 100.0
    return (jnp.array([0.0, 0.0], dtype=dtype), jnp.array([a, a ** 2], dtype=dtype),
            lambda p: _abs_sq(a - p[0]) + b * _abs_sq(p[1] - p[0] ** 2))


def _optax_test_loop(opt, start, objective, steps):
    """The loop of optax's `alias_test.test_optimization`, which conjugates complex gradients itself; every
    iterate."""
    @jax.jit
    def step(params, state):
        updates = jax.grad(objective)(params)
        updates = jax.tree.map(lambda x: x.conj(), updates)
        updates, state = opt.update(updates, state, params)
        return optax.apply_updates(params, updates), state

    params, state = start, opt.init(start)
    state = optax.tree.map_params(opt, lambda v: v, state)      # optax's no-op map_params subtest
    out = []
    for _ in range(steps):
        params, state = step(params, state)
        out.append(params)
    return np.array(out)


@pytest.mark.parametrize("target", [_parabola, _rosenbrock])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex64])
def test_to_optax_converges_in_optax_test_optimization_loop_like_optax_adam(target, dtype):
    start, final, objective = target(dtype)
    ours = _optax_test_loop(to_optax(optim.Adam(1e-1)), start, objective, 10000)
    theirs = _optax_test_loop(optax.adam(1e-1), start, objective, 100)
    # Step by step as optax.adam to rounding: optax rounds 1 - b2 from Python's 0.001, optim from
    # float32(0.999), a relative 1.3e-5 in v (measured up to 3.7e-5 apart after 100 steps). Further on,
    # Rosenbrock's valley amplifies rounding, so after that only where both end is compared (optax's tolerance).
    close(ours[:100], theirs, rtol=1e-4, atol=1e-4)
    close(ours[-1], final, rtol=3e-2, atol=3e-2)


def test_to_optax_of_from_optax_matches_optax_on_complex_parameters():
    start, _, objective = _parabola(jnp.complex64)
    ours = _optax_test_loop(to_optax(from_optax(optax.adam(1e-1))), start, objective, 50)
    theirs = _optax_test_loop(optax.adam(1e-1), start, objective, 50)
    close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_to_optax_under_inject_hyperparams_steps_with_the_injected_value():
    # optax's schedules/_inject_test.py test_overriding_hyperparam, with an optim rule inside
    tx = optax.inject_hyperparams(lambda max_norm: to_optax(optim.ClipNorm(max_norm)))(0.1)
    params = jnp.zeros((3, 5, 7))
    state = tx.init(params)
    update_fn = jax.jit(tx.update)
    for i in range(5):
        state.hyperparams["max_norm"] = i
        updates, state = update_fn(jnp.ones_like(params), state, params)
        assert np.isclose(jnp.linalg.norm(updates.ravel()), i, rtol=1e-6)

    # a learning rate changed mid-run, against optax.inject_hyperparams(optax.adam) on the deduplicated tree
    schedule = (0.05, 0.05, 0.2, 0.001)
    tx = optax.inject_hyperparams(lambda learning_rate: to_optax(optim.Adam(learning_rate)))(0.05)
    p = tied_model()
    s = tx.init(p)
    step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(jax.grad(loss, allow_int=True)(p), s, p)))
    ref_tx = optax.inject_hyperparams(optax.adam)(0.05)
    r = dedup(tied_model())
    rs = ref_tx.init(r)
    for lr in schedule:
        s.hyperparams["learning_rate"] = rs.hyperparams["learning_rate"] = lr
        p, s = step(p, s)
        full = {**tied_model(), "emb": r["emb"], "head": r["emb"], "b": r["b"]}
        u, rs = ref_tx.update(summed(jax.grad(loss, allow_int=True)(full)), rs, r)
        r = optax.apply_updates(r, u)
    close(p["emb"], r["emb"], rtol=2e-5, atol=1e-6)
    close(p["b"], r["b"], rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(p["emb"], p["head"])
    # the inner state keeps the rule it was set up with: the injected value lives in the optax state
    assert float(s.inner_state.rule.lr) == pytest.approx(0.05)


@pytest.mark.parametrize("form", ["by_path", "function"])
def test_to_optax_under_inject_hyperparams_with_a_rule_per_leaf(form):
    def make(lr):
        if form == "by_path":
            return to_optax(optim.by_path({"a*": optim.Descent(lr), "*": optim.Adam(0.1)}))
        return to_optax(lambda path, x: optim.Descent(lr) if path.startswith("a") else optim.Adam(0.1))

    m = {"a1": jnp.ones(2), "b1": jnp.ones(3)}
    tx = optax.inject_hyperparams(make)(0.5)
    s = tx.init(m)
    s.hyperparams["lr"] = 2.0
    u, s = jax.jit(tx.update)({"a1": jnp.ones(2), "b1": jnp.ones(3)}, s, m)
    close(u["a1"], [-2.0, -2.0], atol=1e-7)            # the injected lr, in the Descent entry only
    close(u["b1"], np.full(3, -0.1), atol=1e-6)        # Adam's first step: -lr * sign


def test_to_optax_adjust_and_freeze_on_its_state_take_effect():
    tx = to_optax(optim.Adam(0.05))
    m0 = tied_model()
    g = jax.grad(loss, allow_int=True)
    step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g(p), s, p)))
    p, s = step(m0, tx.init(m0))
    p, s = step(p, optim.adjust(s, lr=0.01))
    p, s = step(p, optim.freeze(s, "b"))
    assert float(s.rule.lr) == pytest.approx(0.01)
    ref = optim.setup(optim.Adam(0.05), m0)
    r = m0
    ref, r = optim.update(ref, r, g(r))
    ref, r = optim.update(optim.adjust(ref, lr=0.01), r, g(r))
    ref, r = optim.update(optim.freeze(ref, "b"), r, g(r))
    close(p["emb"], r["emb"], rtol=1e-5, atol=1e-7)
    close(p["b"], r["b"], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(p["head"], p["emb"])


def test_to_optax_rebuilt_with_another_kind_of_rule_is_refused():
    m = {"w": jnp.ones(2)}
    state = to_optax(optim.Adam(0.1)).init(m)
    with pytest.raises(ValueError, match="rule for 'w' is Descent.*set up with Adam"):
        to_optax(optim.Descent(0.1)).update(m, state, m)


def test_map_params_over_a_to_optax_state_maps_the_parameter_shaped_leaves():
    tx = to_optax(optim.Adam(0.05))
    p, s = optax_loop(tx, tied_model(), steps=2)
    same = optax.tree.map_params(tx, lambda v: v, s)
    assert jax.tree.structure(same) == jax.tree.structure(s)
    out = optax.tree.map_params(tx, lambda v: jnp.full_like(v, 7.0), s)
    assert jax.tree.structure(out) == jax.tree.structure(s)
    for path in ("emb", "head", "b"):
        mu, nu, bt = out[path].state
        close(mu, np.full(mu.shape, 7.0), rtol=0, atol=0)
        close(nu, np.full(nu.shape, 7.0), rtol=0, atol=0)
        close(bt, s[path].state[2], rtol=0, atol=0)     # the beta powers: not parameter-shaped
    assert int(out.step) == 2 and float(out.rule.lr) == pytest.approx(0.05)
    # freeze gives the state a new layout (its static part): map_params follows the state stepped last
    u, s = tx.update(jax.grad(loss, allow_int=True)(p), optim.freeze(s, "b"), p)
    out = optax.tree.map_params(tx, lambda v: jnp.zeros_like(v), s)
    assert jax.tree.structure(out) == jax.tree.structure(s) and out["b"].frozen
    close(out["emb"].state[0], np.zeros((2, 3)), rtol=0, atol=0)
    with pytest.raises(TypeError, match="map_params needs the optimiser state's structure.*tx.init"):
        optax.tree.map_params(to_optax(optim.Adam(0.05)), lambda v: v, s)


def test_map_params_builds_shardings_for_a_to_optax_state_as_flax_does():
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    # A stacked state array is (members, *parameter shape): shard the parameter's first axis, never the members'
    moments, replicated = NamedSharding(mesh, P(None, "data")), NamedSharding(mesh, P())
    tx = to_optax(optim.Adam(0.05))
    params = tied_model()
    state = tx.init(params)
    shardings = optax.tree.map_params(tx, lambda _: moments, state, transform_non_params=lambda _: replicated)
    assert jax.tree.structure(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)) == \
        jax.tree.structure(state)
    placed = jax.device_put(state, shardings)
    given = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    assert [a.sharding for a in jax.tree.leaves(placed)] == given
    assert given.count(moments) == 4          # m and v of the two stacks: the (2, 3) tie and the (3,) bias
    out, _ = optax_loop(tx, params, steps=3)
    p = params
    step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(jax.grad(loss, allow_int=True)(p), s, p)), out_shardings=(None, shardings))
    for _ in range(3):
        p, placed = step(p, placed)
    close(p["emb"], out["emb"], rtol=1e-6, atol=1e-7)      # another compiled program: an ulp may differ
    assert [a.sharding for a in jax.tree.leaves(placed)] == given


def _partition_params():
    """The tree of optax's `PartitionTest.test_partition` (as vectors), labelled by the first letter of its key."""
    params = {"a1": jnp.array([1.0, -1.0]), "b1": jnp.array([2.0, 0.5]),
              "z1": {"a2": jnp.array([3.0, 1.0]), "z2": {"c1": jnp.array([4.0, -2.0])}}}
    labels = {"a1": "adam", "b1": "sgd", "z1": {"a2": "adam", "z2": {"c1": "sgd"}}}
    return params, labels


def test_to_optax_takes_a_by_path_table_like_optax_multi_transform():
    params, labels = _partition_params()
    lossf = lambda p: sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree.leaves(p))
    rule = optim.by_path({"*a[0-9]": optim.Adam(0.1), "*": optim.Descent(0.05)})
    ours, s = optax_loop(to_optax(rule), params, steps=4, grad_fn=jax.grad(lossf))
    theirs, _ = optax_loop(optax.multi_transform({"adam": optax.adam(0.1), "sgd": optax.sgd(0.05)}, labels),
                           params, steps=4, grad_fn=jax.grad(lossf))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        close(a, b, rtol=2e-5, atol=1e-6)
    assert {p: type(leaf.rule).__name__ for p, leaf in s.items()} == {
        "a1": "Adam", "b1": "Descent", "z1.a2": "Adam", "z1.z2.c1": "Descent"}
    # and a rule function, as setup takes it
    fn = lambda path, x: optim.Adam(0.1) if path.split(".")[-1].startswith("a") else optim.Descent(0.05)
    ours_fn, _ = optax_loop(to_optax(fn), params, steps=4, grad_fn=jax.grad(lossf))
    for a, b in zip(jax.tree.leaves(ours_fn), jax.tree.leaves(ours)):
        close(a, b, rtol=0, atol=0)
