"""Training the model types JAX users already have, with ties where the library allows them.

Every test checks numbers against a reference that handles the tie by hand: the same network written with one
parameter used twice, trained by optax (whose gradient through the shared use is the summed gradient), or the
rule's formula applied to the summed gradient. Equinox is a test dependency; Flax is optional (skipped if absent).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from conftest import close

KEY = jax.random.PRNGKey(0)


def optax_train(params, loss, steps=3, lr=0.05):
    """The reference: optax.adam on a model that has no tie (one parameter used in two places)."""
    tx = optax.adam(lr)
    s = tx.init(params)

    @jax.jit
    def step(p, s):
        u, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    for _ in range(steps):
        params, s = step(params, s)
    return params


# ============================================================================================ (a) Equinox
def test_equinox_mlp_with_filter_grad_nones():
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=KEY)
    x = jnp.array([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]])
    loss = lambda m: jnp.sum(jax.vmap(m)(x) ** 2)
    state = optim.setup(optim.Adam(0.05), mlp)
    grad_fn = eqx.filter_jit(eqx.filter_grad(loss))
    m = mlp
    for _ in range(3):
        grads = grad_fn(m)                                    # None at the activation functions
        assert grads.activation is None
        state, m = optim.update(state, m, grads)
    ref = eqx.combine(optax_train(eqx.filter(mlp, eqx.is_array),
                                  lambda p: loss(eqx.combine(p, mlp))), mlp)
    for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(ref)):
        if eqx.is_array(a):
            close(a, b, rtol=2e-5)
        else:
            assert a is b                                     # functions carried through untouched


class TiedLM(eqx.Module):
    emb: jax.Array           # (vocab, dim)
    proj: eqx.nn.Linear
    head: jax.Array          # the same array as emb: logits = head @ h

    def __call__(self, tok):
        return self.head @ jnp.tanh(self.proj(self.emb[tok]))


class OneEmb(eqx.Module):
    """The same network with the embedding used twice by hand (no tie for optax to break)."""
    emb: jax.Array
    proj: eqx.nn.Linear

    def __call__(self, tok):
        return self.emb @ jnp.tanh(self.proj(self.emb[tok]))


def lm_loss(model):
    tok = jnp.arange(5)
    return jnp.sum((jax.vmap(model)(tok) - jax.nn.one_hot((tok + 1) % 5, 5)) ** 2)


def test_equinox_tied_embedding_built_by_reusing_one_array():
    k1, k2 = jax.random.split(KEY)
    w = jax.random.normal(k1, (5, 4))
    proj = eqx.nn.Linear(4, 4, key=k2)
    model = TiedLM(w, proj, w)
    state = optim.setup(optim.Adam(0.05), model)
    assert state.ties() == {"emb": ("head",)}

    @eqx.filter_jit
    def step(state, model):
        return optim.update(state, model, eqx.filter_grad(lm_loss)(model))

    m = model
    for _ in range(3):
        state, m = step(state, m)
    ref = optax_train(OneEmb(w, proj), lm_loss)
    close(m.emb, ref.emb, rtol=2e-5)
    close(m.proj.weight, ref.proj.weight, rtol=2e-5)
    np.testing.assert_array_equal(m.emb, m.head)             # inside jit: equal values, one parameter


class Twice(eqx.Module):
    first: eqx.nn.Linear
    second: eqx.nn.Linear    # the same Linear object: weight and bias tied

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


def test_equinox_same_layer_used_twice():
    lin = eqx.nn.Linear(3, 3, key=KEY)
    model = Twice(lin, lin)
    x = jnp.array([1.0, -2.0, 0.5])
    loss = lambda m: jnp.sum((m(x) - 1.0) ** 2)
    state = optim.setup(optim.Adam(0.05), model)
    assert state.ties() == {"first.weight": ("second.weight",), "first.bias": ("second.bias",)}
    grad_fn = eqx.filter_jit(eqx.filter_grad(loss))
    m = model
    for _ in range(3):
        state, m = optim.update(state, m, grad_fn(m))
    ref = optax_train(lin, lambda l: jnp.sum((l(jnp.tanh(l(x))) - 1.0) ** 2))
    close(m.first.weight, ref.weight, rtol=2e-5)
    close(m.second.bias, ref.bias, rtol=2e-5)
    assert m.first.weight is m.second.weight


class Odd(eqx.Module):
    w: jax.Array
    w_again: jax.Array       # tied to w
    scale: float             # a Python float: not trainable, carried through
    counts: jax.Array        # an integer array: not trainable
    act: Callable            # a function leaf
    name: str = eqx.field(static=True)

    def __call__(self, x):
        return self.act(self.scale * (self.w @ x) + self.w_again @ x) + jnp.sum(self.counts)


def test_equinox_non_array_and_static_fields_exact_step():
    w = jnp.array([[1.0, 2.0], [-1.0, 0.5]])
    model = Odd(w, w, 2.0, jnp.array([1, 2]), jnp.tanh, "odd")
    x = jnp.array([0.3, -0.7])
    loss = lambda m: jnp.sum(m(x))
    grads = eqx.filter_grad(loss)(model)
    assert grads.scale is None and grads.counts is None and grads.act is None
    state = optim.setup(optim.Descent(0.1), model)
    _, out = optim.update(state, model, grads)
    # By hand: d/dw of sum(tanh(3 w x)) = 3 (1 - tanh²) ⊗ x, the sum of the two positions' gradients.
    pre = 3.0 * (np.asarray(w) @ np.asarray(x))
    g = 3.0 * np.outer(1 - np.tanh(pre) ** 2, np.asarray(x))
    close(out.w, np.asarray(w) - 0.1 * g)
    assert out.w is out.w_again and out.scale == 2.0 and out.act is jnp.tanh and out.name == "odd"
    assert out.counts is model.counts


# ============================================================================================ (b) Flax linen
def test_flax_linen_param_dict_with_a_tied_kernel():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="d1")(jnp.tanh(nn.Dense(3, name="d0")(x)))

    net = MLP()
    x = jnp.array([[0.5, -1.0, 2.0]])
    variables = net.init(KEY, x)
    p = variables["params"]
    p["d1"]["kernel"] = p["d0"]["kernel"]                     # tie the two kernels: one array, two places
    loss = lambda v: jnp.sum((net.apply(v, x) - 1.0) ** 2)
    state = optim.setup(optim.Adam(0.05), variables)
    assert state.ties() == {"params.d0.kernel": ("params.d1.kernel",)}

    @jax.jit
    def step(state, v):
        return optim.update(state, v, jax.grad(loss)(v))

    v = variables
    for _ in range(3):
        state, v = step(state, v)
    # Reference: the kernel held once; optax's gradient through both uses is the summed one.
    untied = lambda q: {"params": {"d0": q["d0"], "d1": {"kernel": q["d0"]["kernel"], "bias": q["d1b"]}}}
    ref = optax_train({"d0": p["d0"], "d1b": p["d1"]["bias"]}, lambda q: loss(untied(q)))
    close(v["params"]["d0"]["kernel"], ref["d0"]["kernel"], rtol=2e-5)
    close(v["params"]["d1"]["kernel"], ref["d0"]["kernel"], rtol=2e-5)
    close(v["params"]["d1"]["bias"], ref["d1b"], rtol=2e-5)


def test_flax_linen_embedding_tied_to_a_transposed_head():
    nn = pytest.importorskip("flax.linen")

    class Separate(nn.Module):          # head kernel (dim, vocab) tied to embedding.T through optim
        @nn.compact
        def __call__(self, tok):
            h = jnp.tanh(nn.Embed(5, 4, name="embed")(tok))
            return nn.Dense(5, use_bias=False, name="head")(h)

    class Attend(nn.Module):            # flax's own weight tying: one parameter, used twice
        @nn.compact
        def __call__(self, tok):
            emb = nn.Embed(5, 4, name="embed")
            return emb.attend(jnp.tanh(emb(tok)))

    tok = jnp.arange(5)
    target = jax.nn.one_hot((tok + 1) % 5, 5)
    ref_vars = Attend().init(KEY, tok)
    emb = ref_vars["params"]["embed"]["embedding"]
    variables = {"params": {"embed": {"embedding": emb}, "head": {"kernel": emb.T}}}
    loss = lambda v: jnp.sum((Separate().apply(v, tok) - target) ** 2)
    state = optim.setup(optim.Adam(0.05), variables,
                        ties={"params.head.kernel": ("params.embed.embedding", jnp.transpose)})
    v = variables
    grad_fn = jax.jit(jax.grad(loss))
    for _ in range(3):
        state, v = optim.update(state, v, grad_fn(v))
    ref = optax_train(ref_vars, lambda r: jnp.sum((Attend().apply(r, tok) - target) ** 2))
    close(v["params"]["embed"]["embedding"], ref["params"]["embed"]["embedding"], rtol=2e-5)
    close(v["params"]["head"]["kernel"], ref["params"]["embed"]["embedding"].T, rtol=2e-5)


# ============================================================================================ (c) Flax NNX
def _nnx_models():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            lin = nnx.Linear(4, 4, rngs=rngs)
            self.a = lin
            self.b = lin                                     # NNX shares the Variables: one state entry
            self.emb = nnx.Embed(5, 4, rngs=rngs)
            self.head = nnx.Linear(4, 5, use_bias=False, rngs=rngs)
            self.head.kernel[...] = self.emb.embedding[...].T   # tied through optim (transpose)

        def __call__(self, tok):
            return self.head(jnp.tanh(self.b(jnp.tanh(self.a(self.emb(tok))))))

    class Ref(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.emb = nnx.Embed(5, 4, rngs=rngs)

        def __call__(self, tok):
            return self.emb.attend(jnp.tanh(self.lin(jnp.tanh(self.lin(self.emb(tok))))))

    return nnx, Net, Ref


TOK = jnp.arange(5)
TARGET = jax.nn.one_hot((jnp.arange(5) + 1) % 5, 5)
NNX_TIES = {"head.kernel.value": ("emb.embedding.value", jnp.transpose)}


def _nnx_reference(nnx, Ref):
    ref = Ref(nnx.Rngs(0))          # same initial values as Net(nnx.Rngs(0)) (same creation order)
    gd, params = nnx.split(ref, nnx.Param)
    out = optax_train(params, lambda p: jnp.sum((nnx.merge(gd, p)(TOK) - TARGET) ** 2))
    nnx.update(ref, out)
    return ref


def test_flax_nnx_split_merge_with_shared_layer_and_transposed_tie():
    nnx, Net, Ref = _nnx_models()
    model = Net(nnx.Rngs(0))
    gd, params, rest = nnx.split(model, nnx.Param, ...)
    state = optim.setup(optim.Adam(0.05), params, ties=NNX_TIES)
    assert "b.kernel.value" not in state                   # NNX itself holds the shared layer once

    @jax.jit
    def step(state, params):
        loss = lambda p: jnp.sum((nnx.merge(gd, p, rest)(TOK) - TARGET) ** 2)
        return optim.update(state, params, jax.grad(loss)(params))

    for _ in range(3):
        state, params = step(state, params)
    model = nnx.merge(gd, params, rest)
    ref = _nnx_reference(nnx, Ref)
    close(model.emb.embedding[...], ref.emb.embedding[...], rtol=2e-5)
    close(model.head.kernel[...], ref.emb.embedding[...].T, rtol=2e-5)
    close(model.a.kernel[...], ref.lin.kernel[...], rtol=2e-5)
    assert model.a is model.b


def test_flax_nnx_state_and_update_with_nnx_grad():
    nnx, Net, Ref = _nnx_models()
    model = Net(nnx.Rngs(0))
    state = optim.setup(optim.Adam(0.05), nnx.state(model, nnx.Param), ties=NNX_TIES)
    loss = lambda m: jnp.sum((m(TOK) - TARGET) ** 2)

    @nnx.jit
    def step(model, state):
        grads = nnx.grad(loss)(model)
        state, params = optim.update(state, nnx.state(model, nnx.Param), grads)
        nnx.update(model, params)
        return state

    for _ in range(3):
        state = step(model, state)
    ref = _nnx_reference(nnx, Ref)
    close(model.emb.embedding[...], ref.emb.embedding[...], rtol=2e-5)
    close(model.b.bias[...], ref.lin.bias[...], rtol=2e-5)


def test_flax_nnx_identity_tie_between_two_params():
    nnx = pytest.importorskip("flax.nnx")

    class Pair(nnx.Module):
        def __init__(self, w):
            self.u = nnx.Param(w)
            self.v = nnx.Param(w)            # two Variables holding one array: tied by identity

    w = jnp.array([1.0, -2.0])
    model = Pair(w)
    params = nnx.state(model, nnx.Param)
    state = optim.setup(optim.Descent(0.1), params)
    assert state.ties() == {"u.value": ("v.value",)}
    grads = nnx.grad(lambda m: jnp.sum(m.u[...] ** 2) + jnp.sum(3.0 * m.v[...]))(model)
    state, params = optim.update(state, params, grads)
    nnx.update(model, params)
    close(model.u[...], w - 0.1 * (2 * w + 3.0))
    close(model.v[...], model.u[...], rtol=0)


# ============================================================================================ (d) dataclasses
@chex.dataclass
class ChexParams:
    w: jax.Array
    w_tied: jax.Array
    b: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "w_tied", "b"], meta_fields=["tag"])
@dataclasses.dataclass
class DataParams:
    w: jax.Array
    w_tied: jax.Array
    b: jax.Array
    tag: str


def struct_loss(p):
    return jnp.sum(p.w ** 2) - 3.0 * jnp.sum(p.w_tied) + jnp.sum((p.b - 1.0) ** 2)


@pytest.mark.parametrize("kind", ["chex", "register_dataclass"])
def test_dataclass_structs_with_a_tie_exact_momentum(kind):
    w, b = jnp.array([1.0, 2.0]), jnp.array([0.5])
    model = ChexParams(w=w, w_tied=w, b=b) if kind == "chex" else DataParams(w, w, b, "x")
    state = optim.setup(optim.Momentum(0.1, 0.9), model)
    assert state.ties() == {"w": ("w_tied",)}
    m = model
    for _ in range(3):
        state, m = jax.jit(optim.update)(state, m, jax.grad(struct_loss)(m))
    # By hand in float64: v <- 0.9 v + 0.1 g with the summed gradient g = 2w - 3 for w, 2(b - 1) for b.
    rw, rb, vw, vb = np.array([1.0, 2.0]), np.array([0.5]), 0.0, 0.0
    for _ in range(3):
        vw = 0.9 * vw + 0.1 * (2 * rw - 3.0)
        vb = 0.9 * vb + 0.1 * 2 * (rb - 1.0)
        rw, rb = rw - vw, rb - vb
    close(m.w, rw)
    close(m.w_tied, rw)
    close(m.b, rb)
    assert type(m) is type(model)
    if kind == "register_dataclass":
        assert m.tag == "x"


# ============================================================================================ (e) float0
def test_allow_int_float0_gradients_are_accepted_as_they_come():
    model = {"w": jnp.array([1.0, 2.0]), "n": jnp.array([3, 4]), "k": 5, "flag": jnp.array(True)}
    loss = lambda m: jnp.sum(m["w"] ** 2 * m["n"]) + m["k"]
    grads = jax.grad(loss, allow_int=True)(model)
    assert grads["n"].dtype == jax.dtypes.float0 and grads["flag"].dtype == jax.dtypes.float0
    state = optim.setup(optim.Descent(0.1), model)
    for update in (optim.update, jax.jit(optim.update)):
        _, out = update(state, model, grads)
        close(out["w"], [1.0 - 0.1 * 6.0, 2.0 - 0.1 * 16.0])
        assert out["k"] == 5 and out["n"].tolist() == [3, 4] and bool(out["flag"])
