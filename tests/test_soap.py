"""SOAP (optim/_rules/soap.py): against a float64 numpy reference written from the authors' algorithm, against
the authors' PyTorch soap.py (a stored fixture, and torch itself where it is installed), and through the
engine: ties, `None` gradients, freeze, stacking, save / load, adjust, jit with donation, bad arguments.

The problem (tests/soap_problem.py) keeps every Kronecker factor's null space out of the comparison (see there).
"""

from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

import optim
from soap_problem import CONFIGS, NSTEPS, REF_DEFAULTS, SHAPES, gradient, initial

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "soap_reference.npz")


# ------------------------------------------------------------------------------------------- numpy reference
class NumpySOAP:
    """SOAP for one parameter in float64, from the paper and the authors' soap.py (merge_dims=False): the first
    gradient only builds the factors and their eigh bases; later ones take an Adam step in the rotated basis,
    then project `exp_avg` back, update the factors, refresh the bases every `precondition_frequency` steps (sort
    by `diag(QᵀLQ)`, permute `exp_avg_sq`, one power iteration and QR) and project `exp_avg` in again."""

    def __init__(self, shape, lr, beta, shampoo_beta, eps, weight_decay, precondition_frequency,
                 max_precond_dim, precondition_1d, normalize_grads, correct_bias):
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, beta, eps, weight_decay
        self.sb = beta[1] if shampoo_beta is None else shampoo_beta
        self.freq, self.normalize, self.correct = precondition_frequency, normalize_grads, correct_bias
        one = len(shape) == 1
        self.axes = [i for i, n in enumerate(shape) if n <= max_precond_dim and (precondition_1d or not one)]
        self.gg = {i: np.zeros((shape[i], shape[i])) for i in self.axes}
        self.q = None
        self.m, self.v, self.step = np.zeros(shape), np.zeros(shape), 0

    def project(self, a, back=False):
        for i in self.axes:     # along axis i: Qᵀ a (into the basis) or Q a (back)
            a = np.moveaxis(np.tensordot(self.q[i] if back else self.q[i].T, a, axes=([1], [i])), 0, i)
        return a

    def precondition(self, g):
        if self.q is not None:
            self.m = self.project(self.m, back=True)
        for i in self.axes:
            gi = np.moveaxis(g, i, 0).reshape(g.shape[i], -1)
            self.gg[i] = self.sb * self.gg[i] + (1 - self.sb) * gi @ gi.T
        if self.q is None:
            self.q = {i: np.linalg.eigh(self.gg[i] + 1e-30 * np.eye(len(self.gg[i])))[1][:, ::-1]
                      for i in self.axes}
        elif self.step % self.freq == 0:
            for i in self.axes:
                est = np.diag(self.q[i].T @ self.gg[i] @ self.q[i])
                order = np.argsort(-est, kind="stable")
                self.v = np.take(self.v, order, axis=i)
                self.q[i] = np.linalg.qr(self.gg[i] @ self.q[i][:, order])[0]
        if self.step > 0:
            self.m = self.project(self.m)

    def __call__(self, x, g):
        if self.q is None:
            self.precondition(g)
            return x
        gp = self.project(g)
        self.step += 1
        self.m = self.b1 * self.m + (1 - self.b1) * gp
        self.v = self.b2 * self.v + (1 - self.b2) * gp ** 2
        size = self.lr
        if self.correct:
            size *= np.sqrt(1 - self.b2 ** self.step) / (1 - self.b1 ** self.step)
        n = self.project(self.m / (np.sqrt(self.v) + self.eps), back=True)
        if self.normalize:
            n = n / (1e-30 + np.sqrt(np.mean(n ** 2)))
        x = x - size * n
        x = x - self.lr * self.wd * x
        self.precondition(g)
        return x


def numpy_run(config: dict, nsteps: int = NSTEPS) -> dict:
    x = initial()
    rules = {k: NumpySOAP(SHAPES[k], **config) for k in x}
    out = {k: [] for k in x}
    for t in range(nsteps):
        g = gradient(x, t)
        x = {k: rules[k](x[k], g[k]) for k in x}
        for k in x:
            out[k].append(x[k])
    return {k: np.stack(v) for k, v in out.items()}


def optim_run(config: dict, nsteps: int = NSTEPS, jit: bool = True) -> dict:
    """optim's SOAP on the problem in float64 (the caller enables x64): the parameters after each step."""
    x = {k: jnp.asarray(v) for k, v in initial().items()}
    state = optim.setup(optim.SOAP(**config), x)
    update = jax.jit(optim.update) if jit else optim.update
    out = {k: [] for k in x}
    for t in range(nsteps):
        g = {k: jnp.asarray(v) for k, v in gradient({k: np.asarray(v) for k, v in x.items()}, t).items()}
        state, x = update(state, x, g)
        for k in x:
            out[k].append(np.asarray(x[k]))
    return {k: np.stack(v) for k, v in out.items()}


def _rel(a: dict, b: dict) -> float:
    """The largest error of `a` relative to `b`'s scale, per parameter and step."""
    return max(float(np.max(np.abs(a[k] - b[k]) / (np.abs(b[k]) + 1e-3))) for k in b)


def _moved(a: dict) -> float:
    x0 = initial()
    return min(float(np.max(np.abs(a[k][-1] - x0[k]))) for k in a)


SWITCHES = {
    "freq3": dict(lr=0.05, precondition_frequency=3),
    "precondition_1d": dict(lr=0.05, precondition_frequency=3, precondition_1d=True),
    "max_precond_dim": dict(lr=0.05, precondition_frequency=3, max_precond_dim=4),
    "normalize_grads": dict(lr=0.05, precondition_frequency=3, normalize_grads=True),
    "no_bias_correction": dict(lr=0.05, precondition_frequency=3, correct_bias=False),
    "weight_decay": dict(lr=0.05, precondition_frequency=3, weight_decay=0.5),
    "shampoo_beta": dict(lr=0.05, precondition_frequency=3, shampoo_beta=0.7, beta=(0.8, 0.9)),
}


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_matches_numpy_reference_float64(name):
    config = {**REF_DEFAULTS, **SWITCHES[name]}
    want = numpy_run(config)
    assert _moved(want) > 1e-2          # every parameter (the 3-D one, the scalar) moved visibly
    if name != "freq3":                 # and the switch changes the run
        assert _rel(want, numpy_run({**REF_DEFAULTS, **SWITCHES["freq3"]})) > 1e-4
    with jax.enable_x64(True):
        got = optim_run(config)
    assert _rel(got, want) < 1e-9, _rel(got, want)


def test_numpy_reference_matches_the_authors_fixture():
    """The reference above is the authors' algorithm: it reproduces their float64 run (so the checks against it
    check against theirs, for the switches the fixture does not cover)."""
    stored = np.load(FIXTURE)
    for name, config in CONFIGS.items():
        want = {k: stored[f"{name}/{k}"] for k in SHAPES}
        assert _rel(numpy_run(config), want) < 1e-9, name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_the_authors_soap_fixture_float64(name):
    stored = np.load(FIXTURE)
    want = {k: stored[f"{name}/{k}"] for k in SHAPES}
    with jax.enable_x64(True):
        got = optim_run(CONFIGS[name])
    assert _rel(got, want) < 1e-9, _rel(got, want)


def test_matches_the_authors_soap_in_torch_float64():
    """The fixture regenerated by the authors' soap.py itself (float32 casts removed), where torch and a copy of
    soap.py are at hand (SOAP_REFERENCE=path/to/soap.py; see tests/data/make_soap_reference.py)."""
    pytest.importorskip("torch")
    path = os.environ.get("SOAP_REFERENCE")
    if not path or not os.path.exists(path):
        pytest.skip("SOAP_REFERENCE does not name the authors' soap.py")
    import torch

    from data.make_soap_reference import float64_soap, run

    torch.set_default_dtype(torch.float64)
    try:
        cls = float64_soap(path)
        for name, config in CONFIGS.items():
            want = run(cls, config)
            with jax.enable_x64(True):
                got = optim_run(config)
            assert _rel(got, want) < 1e-9, (name, _rel(got, want))
    finally:
        torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------------------------- the engine
def _count(jaxpr, c):
    for e in jaxpr.eqns:
        c[e.primitive.name] += 1
        for sub in jaxprs_in_params(e.params):
            _count(sub, c)
    return c


def _layers(n=12, d=256, seed=0):
    rng = np.random.default_rng(seed)
    return {f"l{i}": {"w": jnp.asarray(rng.standard_normal((d, d)), jnp.float32),
                      "b": jnp.asarray(rng.standard_normal(d), jnp.float32)} for i in range(n)}


def test_same_shaped_matrices_are_one_stack_with_one_batched_eigh_and_qr_per_side():
    """12 layers of 256 x 256 (above the stacking size limit of other rules): one stack of matrices, so one
    update has 2 eigh (L and R, each batched over the 12) and 2 QR, not 24."""
    model = _layers()
    state = optim.setup(optim.SOAP(), model)
    assert sorted(len(s) for s in state.layout.stacks) == [12, 12]
    ops = _count(jax.make_jaxpr(optim.update)(state, model, model).jaxpr, collections.Counter())
    assert ops["eigh"] == 2 and ops["qr"] == 2, ops
    assert ops["cond"] == 2, ops      # the first-gradient eigh and the refresh, each skipped when no member needs it
    wrapped = optim.setup(optim.chain(optim.ClipGrad(1.0), optim.SOAP()), model)
    assert sorted(len(s) for s in wrapped.layout.stacks) == [12, 12]     # a chain with SOAP inside asks too
    per_leaf = optim.setup(optim.by_path({f"l{i}.*": optim.SOAP() for i in range(3)}), _layers(3))
    ops = _count(jax.make_jaxpr(optim.update)(per_leaf, _layers(3), _layers(3)).jaxpr, collections.Counter())
    assert ops["eigh"] == 6, ops      # a rule per layer: a stack per layer


def _linalg_chains(jaxpr, out):
    """Per (sub)jaxpr: whether each eigh / qr (or an equation holding some) depends on the one before it there."""
    def has(e):
        return e.primitive.name in ("eigh", "qr") or any(
            any(has(f) for f in sub.eqns) for sub in jaxprs_in_params(e.params))
    deps: dict = {}
    k = 0
    for e in jaxpr.eqns:
        d = set().union(*(deps.get(v, set()) for v in e.invars if not isinstance(v, jax.extend.core.Literal)))
        if has(e):
            out.append(k == 0 or (k - 1) in d)
            d = d | {k}
            k += 1
            for sub in jaxprs_in_params(e.params):
                _linalg_chains(sub, out)
        for v in e.outvars:
            deps[v] = d
    return out


def test_eigh_and_qr_run_one_at_a_time():
    """jaxlib 0.10's batched CPU eigh / qr wait for XLA's thread pool, and two running at once on a 2-thread pool
    wait for each other for ever (the 12 x 256 benchmark hung so): each of SOAP's depends on the one before,
    across stacks (two shapes here) and within a stack (L, then R)."""
    model = {"a": _layers(3, 16), "b": {f"v{i}": jnp.ones((8, 12)) for i in range(3)}}
    state = optim.setup(optim.SOAP(), model)
    chains = _linalg_chains(jax.make_jaxpr(optim.update)(state, model, model).jaxpr, [])
    assert len(chains) >= 2 + 2 + 2 * 4 and all(chains), chains


def _train(state, model, nsteps, seed=1, update=optim.update):
    rng = np.random.default_rng(seed)
    for _ in range(nsteps):
        g = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), model)
        state, model = update(state, model, g)
    return state, model


def test_stacked_equals_one_parameter_at_a_time():
    """5 matrices of 91 x 91 (large: stacked only because SOAP asks) and their biases, one stack each, against
    each parameter alone. One matrix misses a gradient on the second step, so the stack's members are at
    different counts: the first-gradient eigh and the refreshes pick per member."""
    with jax.enable_x64(True):
        _stacked_vs_alone()


def _stacked_vs_alone():
    rule = optim.SOAP(0.01, precondition_frequency=2)
    model = jax.tree.map(lambda a: a.astype(jnp.float64), _layers(5, 91))
    rng = np.random.default_rng(1)
    grads = [jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), model) for _ in range(4)]
    grads[1]["l3"]["w"] = None
    state = optim.setup(rule, model)
    assert sorted(len(s) for s in state.layout.stacks) == [5, 5]
    stacked = model
    for g in grads:
        state, stacked = optim.update(state, stacked, g)
    assert int(state["l3.w"].state.count) == 3 and int(state["l2.w"].state.count) == 4
    for k in model:
        for name, x in model[k].items():
            s = optim.setup(rule, x)
            for g in grads:
                if g[k][name] is not None:
                    s, x = optim.update(s, x, g[k][name])
            np.testing.assert_allclose(stacked[k][name], x, rtol=1e-10, atol=1e-12, err_msg=f"{k}.{name}")


def test_a_tie_is_one_parameter_with_one_set_of_factors_and_the_summed_gradient():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((5, 5)), jnp.float32)
    state = optim.setup(optim.SOAP(0.05, precondition_frequency=2), {"emb": w, "head": w})
    assert len(list(state.items())) == 1
    leaf = state["emb"].state
    assert len(leaf.factors) == 2 and leaf.factors[0].shape == (5, 5)
    one = optim.setup(optim.SOAP(0.05, precondition_frequency=2), w)
    x, model = w, {"emb": w, "head": w}
    for _ in range(4):
        a, b = (jnp.asarray(rng.standard_normal((5, 5)), jnp.float32) for _ in range(2))
        state, model = optim.update(state, model, {"emb": a, "head": b})
        one, x = optim.update(one, x, a + b)
    assert model["emb"] is model["head"]
    np.testing.assert_allclose(model["emb"], x, rtol=1e-6, atol=1e-7)


def test_none_gradient_takes_no_step_and_keeps_the_state():
    model = {"a": jnp.ones((3, 3)), "b": jnp.ones((3, 3))}
    state = optim.setup(optim.SOAP(0.1), model)
    g = {"a": jnp.eye(3) + 0.1, "b": jnp.eye(3) * 2}
    state, model = optim.update(state, model, g)
    state, model = optim.update(state, model, g)
    before = state["b"].state
    state, new = optim.update(state, model, {"a": g["a"], "b": None})
    assert int(state["b"].state.count) == 2 and int(state["a"].state.count) == 3
    np.testing.assert_array_equal(new["b"], model["b"])
    for u, v in zip(jax.tree.leaves(state["b"].state), jax.tree.leaves(before)):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(new["a"], model["a"])


def test_frozen_parameter_does_not_move_or_advance():
    model = {"a": jnp.ones((3, 3)), "b": jnp.ones(4)}
    state = optim.freeze(optim.setup(optim.SOAP(0.1), model), "a")
    g = {"a": jnp.eye(3), "b": jnp.arange(4.0)}
    for _ in range(3):
        state, model = optim.update(state, model, g)
    assert int(state["a"].state.count) == 0 and int(state["b"].state.count) == 3
    np.testing.assert_array_equal(model["a"], jnp.ones((3, 3)))


def test_first_gradient_only_builds_the_bases_and_a_vector_is_adam():
    x = jnp.array([1.0, 2.0, 3.0])
    state = optim.setup(optim.SOAP(0.1, weight_decay=0.5), x)
    state, y = optim.update(state, x, jnp.array([1.0, -2.0, 3.0]))
    np.testing.assert_array_equal(y, x)                          # no step, no weight decay
    assert int(state[""].state.count) == 1 and state[""].state.factors == ()
    state, y = optim.update(state, y, jnp.array([1.0, -2.0, 3.0]))
    # Adam's first step (bias-corrected: ±η), then the decay of the updated parameter
    want = (x - 0.1 * np.sign([1.0, -2.0, 3.0])) * (1 - 0.1 * 0.5)
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_state_shapes_follow_max_precond_dim_and_precondition_1d():
    st = optim.setup(optim.SOAP(max_precond_dim=5, precondition_1d=True),
                     {"m": jnp.zeros((4, 8)), "v": jnp.zeros(3), "t": jnp.zeros((2, 6, 3)), "s": jnp.zeros(())})
    shapes = {k: [f.shape for f in st[k].state.factors] for k in ("m", "v", "t", "s")}
    assert shapes == {"m": [(4, 4)], "v": [(3, 3)], "t": [(2, 2), (3, 3)], "s": []}
    assert st["m"].state.bases[0].shape == (4, 4)


def test_save_load_and_state_dict_round_trips(tmp_path):
    model = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    state, model = _train(optim.setup(optim.SOAP(0.05, precondition_frequency=2), model), model, 3)
    optim.save(tmp_path / "soap.ckpt", state)
    back = optim.load(tmp_path / "soap.ckpt", like=optim.setup(optim.SOAP(0.05, precondition_frequency=2), model))
    d = optim.state_dict(state)
    assert d["params"]["w"]._fields == ("exp_avg", "exp_avg_sq", "factors", "bases", "count")
    again = optim.load_state_dict(optim.setup(optim.SOAP(0.05, precondition_frequency=2), model), d)
    for s in (back, again):
        for u, v in zip(jax.tree.leaves(s), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    a, _ = _train(state, model, 3, seed=2)
    b, _ = _train(back, model, 3, seed=2)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_adjust_hyperparameters_and_frequency_without_retracing():
    from conftest import counted_update

    step, traces = counted_update()
    model = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    state = optim.setup(optim.SOAP(0.05), model)
    state, model = _train(state, model, 2, update=step)
    for change in (dict(lr=0.01), dict(beta=(0.9, 0.99)), dict(eps=1e-6), dict(weight_decay=0.0),
                   dict(precondition_frequency=3)):
        state = optim.adjust(state, **change)
        state, model = _train(state, model, 1, update=step)
    assert len(traces) == 1
    assert state.rule.lr == 0.01 and state.rule.precondition_frequency == 3


def test_a_schedule_and_jit_with_donation_match_eager():
    rule = optim.SOAP(optim.Linear(0.05, 0.01, 6), precondition_frequency=2)
    model = {"w": jnp.ones((4, 4)) + jnp.eye(4), "b": jnp.ones(4)}
    eager, m1 = _train(optim.setup(rule, model), model, 6)
    donated = jax.jit(optim.update, donate_argnums=(0, 1))
    jitted, m2 = _train(optim.setup(rule, jax.tree.map(jnp.copy, model)), jax.tree.map(jnp.copy, model), 6,
                        update=donated)
    for k in model:
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-6, atol=1e-7)
    assert int(jitted["w"].state.count) == 6


@pytest.mark.parametrize("make, err, match", [
    (lambda: optim.SOAP(-1.0), ValueError, "SOAP: lr must be >= 0"),
    (lambda: optim.SOAP(beta=(0.9, 1.0)), ValueError, r"SOAP: beta\[1\] must be in \[0, 1\)"),
    (lambda: optim.SOAP(shampoo_beta=1.5), ValueError, r"SOAP: shampoo_beta must be in \[0, 1\)"),
    (lambda: optim.SOAP(eps=-1e-8), ValueError, "SOAP: eps must be >= 0"),
    (lambda: optim.SOAP(weight_decay=-0.1), ValueError, "SOAP: weight_decay must be >= 0"),
    (lambda: optim.SOAP(precondition_frequency=0), ValueError, "SOAP: precondition_frequency must be an integer >= 1"),
    (lambda: optim.SOAP(precondition_frequency=2.5), ValueError, "SOAP: precondition_frequency must be an integer"),
    (lambda: optim.SOAP(max_precond_dim=-1), ValueError, "SOAP: max_precond_dim must be >= 0"),
    (lambda: optim.SOAP(max_precond_dim=1.5), TypeError, "SOAP: max_precond_dim must be an integer"),
    (lambda: optim.SOAP(precondition_1d="no"), TypeError, "SOAP: precondition_1d must be True or False"),
    (lambda: optim.SOAP(normalize_grads=1), TypeError, "SOAP: normalize_grads must be True or False"),
    (lambda: optim.SOAP(beta=0.9), TypeError, "SOAP: beta must be a pair of numbers"),
])
def test_bad_hyperparameters_name_the_rule_and_argument(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_complex_parameters_and_structural_adjust_are_refused():
    with pytest.raises(TypeError, match="SOAP needs real parameters"):
        optim.setup(optim.SOAP(), jnp.ones((2, 2), jnp.complex64))
    state = optim.setup(optim.SOAP(), jnp.ones((2, 2)))
    with pytest.raises((TypeError, ValueError), match="max_precond_dim"):
        optim.adjust(state, max_precond_dim=1)


def test_bfloat16_parameters_keep_their_dtype_and_factors_are_float32():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 4)), jnp.bfloat16)
    state = optim.setup(optim.SOAP(0.1), x)
    for _ in range(3):
        state, x = optim.update(state, x, x.astype(jnp.float32) + 0.5)
    leaf = state[""].state
    assert x.dtype == jnp.bfloat16 and leaf.exp_avg.dtype == jnp.bfloat16
    assert leaf.factors[0].dtype == leaf.bases[0].dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
