"""Prodigy and DoG (`optim/_rules/lr_free.py`): whole-model learning-rate-free rules.

1. Against optax in float64 (`optax.contrib.prodigy`, `optax.contrib.dog`), 100 steps on an untied model whose
   same-shaped parameters optim stacks, rtol 1e-10, for the defaults and each option.
2. Ties: optim counts a tied weight once with its summed gradient (optax on the model without the copy);
   optax on the tied model differs.
3. The global numbers kept per parameter: `None` gradients and frozen parameters (stale copies), stacks,
   `by_path`, save / load / state_dict, `adjust` without retracing, a user's jit with donation.
4. Bad hyperparameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from conftest import close, counted_update

STEPS = 100
SHAPES = {"w1": (3, 4), "w2": (3, 4), "b": (5,), "c": ()}


def _model(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s).astype(dtype)) for k, s in SHAPES.items()}


def _grad(model, target, rng):
    """The gradient of ½ Σ (x - target)² plus noise: the distance to the solution is what both rules estimate."""
    return {k: (x - target[k]) + 0.1 * jnp.asarray(rng.standard_normal(np.shape(x)), x.dtype)
            for k, x in model.items()}


def _ostep(tx):
    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step


def _dev(tree):
    """`tree` committed to the device, as every later output is: the next step then does not trace again."""
    return jax.device_put(tree, jax.devices()[0])


def _relerr(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


def _linear64(start, end, steps):
    """optax's own schedules return float32 even under x64: a float64 function of the count instead."""
    return lambda count: start + (end - start) * jnp.minimum(jnp.asarray(count, jnp.float64) / steps, 1.0)


# ----------------------------------------------------------------------------------------------- 1. optax
PRODIGY = [
    ("defaults", lambda: optim.Prodigy(), lambda: optax.contrib.prodigy()),
    ("beta,beta3", lambda: optim.Prodigy(beta=(0.8, 0.99), beta3=0.9),
     lambda: optax.contrib.prodigy(betas=(0.8, 0.99), beta3=0.9)),
    ("weight_decay,lr schedule", lambda: optim.Prodigy(optim.Linear(3.0, 0.5, 60), weight_decay=0.1),
     lambda: optax.contrib.prodigy(_linear64(3.0, 0.5, 60), weight_decay=0.1)),
    ("safeguard_warmup", lambda: optim.Prodigy(safeguard_warmup=True),
     lambda: optax.contrib.prodigy(safeguard_warmup=True)),
    ("estim_lr_coef,estim_lr0,eps", lambda: optim.Prodigy(estim_lr0=1e-3, estim_lr_coef=0.5, eps=1e-4),
     lambda: optax.contrib.prodigy(estim_lr0=1e-3, estim_lr_coef=0.5, eps=1e-4)),
]
DOG = [
    ("defaults", lambda: optim.DoG(), lambda: optax.contrib.dog()),
    ("reps_rel", lambda: optim.DoG(reps_rel=1e-3, eps=1e-6),
     lambda: optax.contrib.dog(init_step=("heuristic", 1e-3), eps=1e-6)),
    ("init_learning_rate,lr schedule", lambda: optim.DoG(optim.Linear(2.0, 0.5, 60), init_learning_rate=0.01),
     lambda: optax.contrib.dog(_linear64(2.0, 0.5, 60), init_step=("learning_rate", 0.01))),
]
OPTAX = [("Prodigy " + n, m, t) for n, m, t in PRODIGY] + [("DoG " + n, m, t) for n, m, t in DOG]
WORST: dict = {}     # name -> the largest relative error over the steps and parameters (see the report)


@pytest.mark.parametrize("name, make, make_tx", OPTAX, ids=[c[0] for c in OPTAX])
def test_matches_optax_float64_untied(name, make, make_tx):
    with jax.enable_x64(True):
        model = start = _dev(_model())
        target = _model(1)
        state = _dev(optim.setup(make(), model))
        assert len(state.stacks) < len(model)                 # w1 and w2 are stacked
        tx = make_tx()
        p, s = dict(model), _dev(tx.init(model))
        step, ostep = jax.jit(optim.update), _ostep(tx)
        rng, worst = np.random.default_rng(2), 0.0
        for t in range(STEPS):
            g = _grad(model, target, rng)
            state, model = step(state, model, g)
            p, s = ostep(p, s, g)
            for k in model:
                assert model[k].dtype == jnp.float64
                close(model[k], p[k], rtol=1e-10, atol=1e-13, err_msg=f"{name}: step {t + 1}, {k}")
                # the displacement too, so that small steps are compared as well
                close(model[k] - start[k], p[k] - start[k], rtol=1e-10, atol=1e-15, err_msg=f"{name}: step {t + 1}")
                worst = max(worst, _relerr(model[k] - start[k], p[k] - start[k]))
        WORST[name] = worst
        # it trained: ½ Σ (x - target)² fell by more than 10x (each option changes the trajectory)
        loss = lambda m: sum(float(jnp.sum((m[k] - target[k]) ** 2)) for k in m)     # noqa: E731
        assert loss(model) < 0.1 * loss(start), (loss(model), loss(start))
        if name.startswith("Prodigy"):     # the estimate of d really moved (the test checks that part too)
            d = float(state["b"].state.d)
            close(d, float(s.estim_lr), rtol=1e-10, atol=0)
            assert d > 100 * make().estim_lr0
        else:
            close(float(state["b"].state.r), float(s[1].max_dist), rtol=1e-10, atol=0)
        assert int(state["c"].state.t) == STEPS
    assert jnp.zeros(1).dtype == jnp.float32


# ----------------------------------------------------------------------------------------------- 2. ties
@pytest.mark.parametrize("which", ["Prodigy", "DoG"])
def test_tied_weight_counts_once_with_its_summed_gradient(which):
    make, make_tx = ((lambda: optim.Prodigy(estim_lr0=1e-3), lambda: optax.contrib.prodigy(estim_lr0=1e-3))
                     if which == "Prodigy" else (lambda: optim.DoG(reps_rel=1e-3),
                                                 lambda: optax.contrib.dog(init_step=("heuristic", 1e-3))))
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        w = _dev(jnp.asarray(rng.standard_normal((3, 4))))
        model = {"emb": w, "head": w, "b": _dev(jnp.asarray(rng.standard_normal(5)))}
        state = _dev(optim.setup(make(), model))
        assert len(state.paths()) == 2
        tx = make_tx()
        dedup = {"emb": model["emb"], "b": model["b"]}
        tied = dict(model)
        s, s2 = _dev(tx.init(dedup)), _dev(tx.init(tied))
        step, ostep = jax.jit(optim.update), _ostep(tx)
        bias = {k: jnp.asarray(rng.standard_normal(np.shape(v))) for k, v in model.items()}
        for t in range(30):      # a fixed direction plus noise: d grows (with noise alone it stays d₀)
            g = {k: bias[k] + 0.3 * jnp.asarray(rng.standard_normal(np.shape(v))) for k, v in model.items()}
            state, model = step(state, model, g)
            dedup, s = ostep(dedup, s, {"emb": g["emb"] + g["head"], "b": g["b"]})
            tied, s2 = ostep(tied, s2, g)
            for k in ("emb", "b"):
                close(model[k], dedup[k], rtol=1e-10, atol=0, err_msg=f"{which}: step {t + 1}, {k}")
            close(model["head"], model["emb"], rtol=0, atol=0)
        # optax on the tied model counts the weight twice, each copy with its own gradient: another trajectory
        assert _relerr(tied["b"], model["b"]) > 1e-3


# ----------------------------------------------------------------------------------------------- 3. state
SMALL = {"w1": (3, 4), "w2": (3, 4), "head": {"b": (5,)}, "c": ()}
_STEP = jax.jit(optim.update)     # one jitted update for the tests below: traced once per structure


def _small(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s).astype(np.float32)), SMALL,
                        is_leaf=lambda v: isinstance(v, tuple))


def _grads(n, model, seed=3):
    """`n` gradients: a fixed direction per parameter plus noise, so that Prodigy's d grows (with pure noise
    it stays d₀ and every estimate would look alike)."""
    rng = np.random.default_rng(seed)
    bias = jax.tree.map(lambda x: rng.standard_normal(np.shape(x)).astype(np.float32), model)
    return [jax.tree.map(lambda b: jnp.asarray(b + 0.3 * rng.standard_normal(np.shape(b)).astype(np.float32)), bias)
            for _ in range(n)]


def _runs(make, model, grads, state=None):
    state, model = _dev(optim.setup(make(), model) if state is None else state), _dev(model)
    for g in grads:
        state, model = _STEP(state, model, g)
    return state, model


RULES = [("Prodigy", lambda: optim.Prodigy(estim_lr0=1e-2, weight_decay=0.01)),
         ("DoG", lambda: optim.DoG(reps_rel=1e-2))]


def _by_hand(rule, model, grads, skip):
    """The rule's `apply_tree` on one stack per parameter (nothing stacked), with `skip[t]` the parameters that
    do not step at step t: the straightforward model of what `update` must do (on a flat dict)."""
    from optim._rules.protocol import apply_all, apply_step
    lead = lambda a: jax.tree.map(lambda v: v[None], a)      # noqa: E731
    states = {k: rule.init(x) for k, x in model.items()}
    for t, g in enumerate(grads):
        live = [k for k in model if k not in skip[t]]
        new, steps = apply_all(rule, [lead(states[k]) for k in live], [lead(model[k]) for k in live],
                               [(lead(g[k]),) for k in live])
        for k, st, d in zip(live, new, steps):
            states[k] = jax.tree.map(lambda v: v[0], st)
            model = {**model, k: apply_step(model[k], d[0])}
    return states, model


def _flat(tree):
    return {"w1": tree["w1"], "w2": tree["w2"], "b": tree["head"]["b"], "c": tree["c"]}


@pytest.mark.parametrize("name, make", RULES, ids=[r[0] for r in RULES])
def test_none_gradients_and_frozen_parameters_keep_stale_copies(name, make):
    """A `None` gradient (a whole subtree, and a member of a stack) and a frozen parameter neither step nor
    count; their copies of the global numbers go stale, and when they step again the freshest copy is used."""
    model = _small()
    grads = _grads(5, model)
    grads[1] = {**grads[1], "w1": None, "head": None}
    grads[2] = {**grads[2], "w1": None}
    state, m = _runs(make, model, grads[:1])
    state = optim.freeze(state, "c")
    state, m = _runs(make, m, grads[1:3], state)
    t = {k: int(state[k].state.t) for k in ("w1", "w2", "head.b", "c")}
    assert t == {"w1": 1, "w2": 3, "head.b": 3, "c": 1}
    state = optim.thaw(state, "c")
    state, m = _runs(make, m, grads[3:], state)
    assert {int(state[k].state.t) for k in ("w1", "w2", "head.b", "c")} == {5}
    skip = [set(), {"w1", "b", "c"}, {"w1", "c"}, set(), set()]
    flat_grads = [{k: (v if v is not None else jnp.zeros(np.shape(_flat(model)[k]))) for k, v in
                   ({"w1": g["w1"], "w2": g["w2"], "b": (g["head"] or {}).get("b"), "c": g["c"]}).items()}
                  for g in grads]
    want_states, want = _by_hand(make(), _flat(model), flat_grads, skip)
    got, got_states = _flat(m), {k: state[p].state for k, p in zip(("w1", "w2", "b", "c"),
                                                                     ("w1", "w2", "head.b", "c"))}
    for k in want:
        close(got[k], want[k], rtol=2e-6, atol=1e-7, err_msg=f"{name}: {k}")
        jax.tree.map(lambda a, b: close(a, b, rtol=2e-6, atol=1e-7, err_msg=f"{name}: state of {k}"),
                     got_states[k], want_states[k])


def test_a_stale_copy_is_not_read_while_a_fresher_one_steps():
    """`a` misses a step; its copy of d is older than `b`'s. The next step must be the one taken from the fresh
    copy (what `apply_tree` gives when both rows hold `b`'s), not from `a`'s, and writes it back to both."""
    from optim._rules.protocol import apply_all
    model = {"a": jnp.ones(3), "b": jnp.full(4, 2.0)}
    g = {"a": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([0.5, 1.0, -1.0, 0.3])}
    rule = optim.Prodigy(estim_lr0=0.1)
    state = optim.setup(rule, model)
    for _ in range(5):
        state, model = optim.update(state, model, g)
    state, model = optim.update(state, model, {"a": None, "b": g["b"]})
    sa, sb = state["a"].state, state["b"].state
    assert float(sb.d) > float(sa.d) and int(sb.t) == 6 and int(sa.t) == 5
    new_state, new = optim.update(state, model, g)
    lead = lambda a: jax.tree.map(lambda v: v[None], a)      # noqa: E731
    fresh_a = sa._replace(d=sb.d, numerator=sb.numerator, t=sb.t)
    stale_b = sb._replace(d=sa.d, numerator=sa.numerator, t=sa.t)
    for rows, same in (((fresh_a, sb), True), ((sa, stale_b), False)):    # from the stale copy: another step
        got, steps = apply_all(rule, [lead(r) for r in rows], [lead(model["a"]), lead(model["b"])],
                               [(lead(g["a"]),), (lead(g["b"]),)])
        ok = np.allclose(new["a"], model["a"] - steps[0][0], rtol=1e-6, atol=0)
        assert ok == same and (not same or np.allclose(new_state["a"].state.d, got[0].d[0], rtol=1e-6))
    close(new_state["a"].state.d, new_state["b"].state.d, rtol=0, atol=0)
    assert int(new_state["a"].state.t) == int(new_state["b"].state.t) == 7


@pytest.mark.parametrize("name, make", RULES, ids=[r[0] for r in RULES])
def test_stacked_model_equals_unstacked(name, make):
    """Six same-shaped parameters in one stack give the numbers of the same parameters each alone (the global
    sums run over the stack's members), and of the model reshaped so that nothing stacks."""
    rng = np.random.default_rng(9)
    model = {f"p{i}": jnp.asarray(rng.standard_normal(4).astype(np.float32)) for i in range(6)}
    state = optim.setup(make(), model)
    assert len(state.stacks) == 1
    grads = _grads(5, model)
    state, got = _runs(make, model, grads, state)
    _, want = _by_hand(make(), model, grads, [set()] * 5)
    shapes = [(4,), (2, 2), (4, 1), (1, 4), (1, 1, 4), (2, 1, 2)]
    flat = {k: x.reshape(sh) for (k, x), sh in zip(model.items(), shapes)}
    fstate, fgot = _runs(make, flat, [{k: g[k].reshape(flat[k].shape) for k in g} for g in grads])
    assert len(fstate.stacks) == 6
    for k in model:
        close(got[k], want[k], rtol=2e-6, atol=1e-7, err_msg=f"{name}: {k} by hand")
        close(got[k], fgot[k].reshape(4), rtol=2e-6, atol=1e-7, err_msg=f"{name}: {k} unstacked")
    assert int(state["p3"].state.t) == 5


@pytest.mark.parametrize("name, make", RULES, ids=[r[0] for r in RULES])
def test_save_load_and_state_dict_mid_training_continue_identically(name, make, tmp_path):
    model = _small()
    grads = _grads(6, model)
    state, m = _runs(make, model, grads[:3])
    optim.save(tmp_path / "ck", state)
    back = optim.load(tmp_path / "ck", optim.setup(make(), m))
    again = optim.load_state_dict(optim.setup(make(), m), optim.state_dict(state))
    _, want = _runs(make, m, grads[3:], state)
    for other in (back, again):
        assert int(other.step) == 3 and int(other["w1"].state.t) == 3
        _, got = _runs(make, m, grads[3:], other)
        jax.tree.map(lambda a, b: close(a, b, rtol=0, atol=0, err_msg=name), got, want)


ADJUST = [("Prodigy", lambda: optim.Prodigy(0.5), [{"lr": 0.25}, {"beta": (0.8, 0.99), "estim_lr_coef": 2.0,
                                                                   "weight_decay": 0.1, "estim_lr0": 1e-2}]),
          ("Prodigy beta3", lambda: optim.Prodigy(beta3=0.9), [{"beta3": 0.5, "lr": 2.0}]),
          ("DoG", lambda: optim.DoG(0.5), [{"lr": 0.25}, {"reps_rel": 1e-2, "eps": 1e-4}]),
          ("DoG init_learning_rate", lambda: optim.DoG(init_learning_rate=0.1), [{"init_learning_rate": 0.2}])]


@pytest.mark.parametrize("name, make, changes", ADJUST, ids=[a[0] for a in ADJUST])
def test_adjust_without_retracing(name, make, changes):
    step, traces = counted_update()
    model = {"w": jnp.ones((2, 3)), "b": jnp.array([0.5, -0.5])}
    grads = _grads(1 + len(changes), model)
    state = optim.setup(make(), model)
    state, model = step(state, model, grads[0])
    for kw, g in zip(changes, grads[1:]):
        state = optim.adjust(state, **kw)
        new_state, new = step(state, model, g)
        _, want = optim.update(state, model, g)           # the adjusted values are the ones used
        jax.tree.map(lambda a, b: close(a, b, rtol=1e-6), new, want)
        state, model = new_state, new
    assert len(traces) == 1


def test_adjust_lr_scales_the_step_and_none_is_structural():
    model = {"a": jnp.array([1.0, 2.0])}
    g = {"a": jnp.array([1.0, -1.0])}
    for make in (lambda: optim.DoG(reps_rel=0.1), lambda: optim.Prodigy(estim_lr0=0.1)):
        s = optim.setup(make(), model)
        _, one = optim.update(s, model, g)
        _, half = optim.update(optim.adjust(s, lr=0.5), model, g)
        close(half["a"] - model["a"], 0.5 * (one["a"] - model["a"]), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="adjust: Prodigy.beta3: between None and a number is structural"):
        optim.adjust(optim.setup(optim.Prodigy(), model), beta3=0.9)
    with pytest.raises(ValueError, match="adjust: DoG.init_learning_rate: between None and a number"):
        optim.adjust(optim.setup(optim.DoG(), model), init_learning_rate=0.1)
    with pytest.raises(ValueError, match="adjust: Prodigy.safeguard_warmup is structural"):
        optim.adjust(optim.setup(optim.Prodigy(), model), safeguard_warmup=True)


@pytest.mark.parametrize("name, make", RULES, ids=[r[0] for r in RULES])
def test_user_jit_with_donation(name, make):
    model = _small()
    grads = _grads(4, model)
    _, want = _runs(make, model, grads)
    step = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))
    state, m = optim.setup(make(), model), jax.tree.map(jnp.copy, model)
    for g in grads:
        state, m = step(state, m, g)
    jax.tree.map(lambda a, b: close(a, b, rtol=0, atol=0, err_msg=name), m, want)
    close(state["head.b"].state.x0, model["head"]["b"], rtol=0, atol=0)    # x₀ survived the donations


@pytest.mark.parametrize("name, make", RULES, ids=[r[0] for r in RULES])
def test_by_path_part_of_the_model(name, make):
    """The rule on part of the model: its sums cover only its own parameters (the rest has Adam), so it steps
    them as it would step that part alone; two instances keep two sets of global numbers, one instance under
    two patterns one set; adjusting some of one instance's parameters is refused."""
    model = {k: v for k, v in _small().items() if k != "head"}
    model["b"] = jnp.linspace(-1.0, 1.0, 5)
    grads = _grads(6, model)
    sub = lambda tree, ks: [{k: g[k] for k in ks} for g in tree]     # noqa: E731
    two = optim.by_path({"w*": make(), "b": make(), "*": optim.Adam(1e-2)})
    _, got = _runs(None, model, grads, optim.setup(two, model))
    _, alone_w = _runs(make, {k: model[k] for k in ("w1", "w2")}, sub(grads, ("w1", "w2")))
    _, alone_b = _runs(make, {"b": model["b"]}, sub(grads, ("b",)))
    for k, want in (("w1", alone_w), ("w2", alone_w), ("b", alone_b)):
        close(got[k], want[k], rtol=2e-6, atol=1e-7, err_msg=f"{name}: {k}")
    shared = make()
    one_state = optim.setup(optim.by_path({"w*": shared, "b": shared, "*": optim.Adam(1e-2)}), model)
    _, one = _runs(None, model, grads, one_state)
    _, alone = _runs(make, {k: model[k] for k in ("w1", "w2", "b")}, sub(grads, ("w1", "w2", "b")))
    for k in ("w1", "w2", "b"):
        close(one[k], alone[k], rtol=2e-6, atol=1e-7, err_msg=f"{name}: shared, {k}")
    assert _relerr(one["b"] - model["b"], got["b"] - model["b"]) > 1e-2      # the sums really differ
    with pytest.raises(ValueError, match=f"looks across its parameters \\({name}\\)"):
        optim.adjust(one_state, "b", lr=0.1)


# ----------------------------------------------------------------------------------------------- 4. errors
BAD = [
    (lambda: optim.Prodigy(-1.0), ValueError, "Prodigy: lr must be >= 0 and finite, got -1.0"),
    (lambda: optim.Prodigy(beta=(0.9, 1.0)), ValueError, r"Prodigy: beta\[1\] must be in \[0, 1\) and finite, got 1.0"),
    (lambda: optim.Prodigy(beta3=1.5), ValueError, r"Prodigy: beta3 must be in \[0, 1\) and finite, got 1.5"),
    (lambda: optim.Prodigy(beta3="0.9"), TypeError,
     "Prodigy: beta3 must be a real number, an array or an optim schedule, got str '0.9'"),
    (lambda: optim.Prodigy(eps=-1e-8), ValueError, "Prodigy: eps must be >= 0 and finite, got -1e-08"),
    (lambda: optim.Prodigy(estim_lr0=0.0), ValueError, "Prodigy: estim_lr0 must be > 0 and finite, got 0.0"),
    (lambda: optim.Prodigy(estim_lr_coef=float("nan")), ValueError,
     "Prodigy: estim_lr_coef must be >= 0 and finite, got nan"),
    (lambda: optim.Prodigy(weight_decay=-0.1), ValueError, "Prodigy: weight_decay must be >= 0 and finite, got -0.1"),
    (lambda: optim.Prodigy(safeguard_warmup="no"), TypeError,
     "Prodigy: safeguard_warmup must be True or False, got str 'no'"),
    (lambda: optim.Prodigy(optim.Linear(1.0, -1.0, 10)), ValueError, "Prodigy: lr must be >= 0 at every step"),
    (lambda: optim.DoG(-0.5), ValueError, "DoG: lr must be >= 0 and finite, got -0.5"),
    (lambda: optim.DoG(reps_rel=-1e-6), ValueError, "DoG: reps_rel must be >= 0 and finite, got -1e-06"),
    (lambda: optim.DoG(eps=float("inf")), ValueError, "DoG: eps must be >= 0 and finite, got inf"),
    (lambda: optim.DoG(init_learning_rate=-0.1), ValueError,
     "DoG: init_learning_rate must be >= 0 and finite, got -0.1"),
    (lambda: optim.DoG(init_learning_rate="0.1"), TypeError,
     "DoG: init_learning_rate must be a real number, an array or an optim schedule, got str '0.1'"),
]


@pytest.mark.parametrize("make, err, match", BAD, ids=[b[2].split(",")[0] for b in BAD])
def test_bad_hyperparameters(make, err, match):
    with pytest.raises(err, match="^" + match):
        make()


def test_defaults_and_complex_parameters():
    assert optim.Prodigy() == optim.Prodigy(1.0, (0.9, 0.999), None, 1e-8, 1e-6, 1.0, 0.0, False)
    assert optim.DoG() == optim.DoG(1.0, 1e-6, 1e-8, None)
    assert optim.Prodigy(beta3=0.9).beta3 == 0.9 and optim.DoG(init_learning_rate=1).init_learning_rate == 1.0
    for rule in (optim.Prodigy(), optim.DoG()):
        with pytest.raises(TypeError, match=f"setup: at 'z': {type(rule).__name__} needs real parameters"):
            optim.setup(rule, {"z": jnp.ones(2, jnp.complex64)})


def test_prodigy_keeps_d_where_the_sum_of_s_is_zero():
    """All gradients zero so far: Σ|s| = 0 and d's estimate would be 0 / 0; d is kept (optax gives NaN)."""
    model = {"a": jnp.array([1.0, 2.0])}
    zero = {"a": jnp.zeros(2)}
    state, new = optim.update(optim.setup(optim.Prodigy(), model), model, zero)
    assert float(state["a"].state.d) == np.float32(1e-6) and np.array_equal(new["a"], model["a"])
    tx = optax.contrib.prodigy()
    _, s = tx.update(zero, tx.init(model), model)
    assert np.isnan(float(s.estim_lr))
    state, new = optim.update(state, new, {"a": jnp.array([1.0, -1.0])})     # then it steps as usual
    assert np.isfinite(np.asarray(new["a"])).all() and not np.array_equal(new["a"], model["a"])
