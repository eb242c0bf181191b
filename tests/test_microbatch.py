"""`optim.microbatch`: a gradient function over n slices of the batch by `lax.scan`, outputs averaged.

References: the full-batch `jax.value_and_grad` of a mean loss (float64 under `jax.enable_x64(True)`, rtol
1e-12; float32, rtol 1e-5), optax's own `optax.microbatching.microbatch` (MEAN accumulator), and a plain Python
loop over the contiguous slices averaged in numpy float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import close

import optim

MEAN, SUM = optax.microbatching.AccumulationType.MEAN, optax.microbatching.AccumulationType.SUM


def mlp_params(dtype=jnp.float32, d_in=6, hidden=16, seed=0):
    k = np.random.default_rng(seed)
    return {"w1": jnp.asarray(k.normal(size=(d_in, hidden)) / np.sqrt(d_in), dtype),
            "b1": jnp.asarray(k.normal(size=hidden) * 0.1, dtype),
            "w2": jnp.asarray(k.normal(size=(hidden, 1)) / np.sqrt(hidden), dtype)}


def mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"])[:, 0] - y) ** 2)


def data(b=24, d_in=6, dtype=jnp.float32, seed=1):
    k = np.random.default_rng(seed)
    return jnp.asarray(k.normal(size=(b, d_in)), dtype), jnp.asarray(k.normal(size=b), dtype)


def loop_reference(grad_fn, n, model, *batch):
    """Average of grad_fn over the n contiguous slices, in numpy float64 (an independent Python loop)."""
    b = jax.tree.leaves(batch)[0].shape[0] // n
    outs = [grad_fn(model, *jax.tree.map(lambda x: x[i * b:(i + 1) * b], batch)) for i in range(n)]
    return jax.tree.map(lambda *v: np.mean([np.asarray(u, np.float64) for u in v], axis=0), *outs)


def assert_tree_close(a, b, rtol, atol=0.0):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, (ta, tb)
    for u, v in zip(la, lb):
        close(u, v, rtol=rtol, atol=atol)


def same_dtypes(a, b):
    return jax.tree.map(lambda u: jnp.dtype(u.dtype), a) == jax.tree.map(lambda u: jnp.dtype(u.dtype), b)


# ------------------------------------------------------------------------------------------------ the numbers
@pytest.mark.parametrize("n", [2, 3, 4, 8, 24])
def test_float64_matches_full_batch(n):
    with jax.enable_x64(True):
        p, (x, y) = mlp_params(jnp.float64), data(dtype=jnp.float64)
        full = jax.value_and_grad(mlp_loss)
        got = optim.microbatch(full, n)(p, x, y)
        want = full(p, x, y)
        assert got[0].dtype == jnp.float64 and got[1]["w1"].dtype == jnp.float64
        assert_tree_close(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_float32_matches_full_batch(n):
    p, (x, y) = mlp_params(), data()
    full = jax.value_and_grad(mlp_loss)
    got = optim.microbatch(full, n)(p, x, y)
    assert same_dtypes(got, full(p, x, y))
    assert_tree_close(got, full(p, x, y), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [2, 4, 6])
def test_matches_optax_microbatch(n):
    with jax.enable_x64(True):
        p, (x, y) = mlp_params(jnp.float64), data(dtype=jnp.float64)
        full = jax.value_and_grad(mlp_loss)
        ref = optax.microbatching.microbatch(full, argnums=(1, 2), microbatch_size=x.shape[0] // n, accumulator=MEAN)
        assert_tree_close(optim.microbatch(full, n)(p, x, y), ref(p, x, y), rtol=1e-12, atol=1e-15)
    p, (x, y) = mlp_params(), data()
    ref = optax.microbatching.microbatch(full, argnums=(1, 2), microbatch_size=x.shape[0] // n, accumulator=MEAN)
    assert_tree_close(optim.microbatch(full, n)(p, x, y), ref(p, x, y), rtol=1e-5, atol=1e-7)


def test_has_aux_float_averaged_int_summed_matches_optax_and_full_batch():
    def loss(p, x, y):
        pred = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
        err = pred[:, 0] - y
        return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err)), "hits": jnp.sum(jnp.abs(err) < 1.0)}

    with jax.enable_x64(True):
        p, (x, y) = mlp_params(jnp.float64), data(dtype=jnp.float64)
        full = jax.value_and_grad(loss, has_aux=True)
        (l, aux), g = got = optim.microbatch(full, 4)(p, x, y)
        assert aux["hits"].dtype == jnp.int64 and aux["mae"].dtype == jnp.float64
        assert_tree_close(got, full(p, x, y), rtol=1e-12, atol=1e-15)     # the count is the full-batch count
        ref = optax.microbatching.microbatch(full, argnums=(1, 2), microbatch_size=6,
                                             accumulator=((MEAN, {"mae": MEAN, "hits": SUM}), MEAN))
        assert_tree_close(got, ref(p, x, y), rtol=1e-12, atol=1e-15)
        assert 0 < int(aux["hits"]) <= 24


def test_slices_are_contiguous_and_match_a_python_loop():
    def first_rows(p, x):                       # the mean of each slice's first row: tells slices apart
        return jnp.sum(p * x[0]), x[0] * p

    x = jnp.arange(12.0).reshape(6, 2)
    p = jnp.array([1.0, 10.0])
    got = optim.microbatch(first_rows, 3)(p, x)
    want = loop_reference(first_rows, 3, p, x)
    assert_tree_close(got, want, rtol=1e-7)
    close(got[1], np.mean([[0, 1], [4, 5], [8, 9]], axis=0) * np.array([1, 10]), rtol=0, atol=0)


def test_dict_batch_with_different_trailing_shapes_and_dtypes():
    def loss(p, batch):
        img = batch["img"].reshape(batch["img"].shape[0], -1)              # (B, 4, 3) -> (B, 12)
        emb = p["emb"][batch["tok"]].mean(axis=1)                          # int32 (B, 5) -> (B, 2)
        pred = img @ p["w"] + emb @ p["v"]
        return jnp.mean((pred - batch["y"]) ** 2)

    k = np.random.default_rng(3)
    batch = {"img": jnp.asarray(k.normal(size=(16, 4, 3)), jnp.float32),
             "tok": jnp.asarray(k.integers(0, 7, size=(16, 5)), jnp.int32),
             "y": jnp.asarray(k.normal(size=16), jnp.float32)}
    p = {"emb": jnp.asarray(k.normal(size=(7, 2)), jnp.float32), "w": jnp.asarray(k.normal(size=12), jnp.float32),
         "v": jnp.asarray(k.normal(size=2), jnp.float32)}
    full = jax.jit(jax.value_and_grad(loss))
    for n in (2, 8):
        got = optim.microbatch(full, n)(p, batch)
        assert_tree_close(got, full(p, batch), rtol=1e-5, atol=1e-6)
        assert_tree_close(got, loop_reference(full, n, p, batch), rtol=1e-5, atol=1e-6)


def test_two_batch_arguments_and_keywords_passed_whole():
    def loss(p, inputs, targets, *, scale, square=True):
        assert isinstance(square, bool)                                    # a Python flag stays a Python value
        r = (inputs["a"] @ p + inputs["b"]) * scale - targets[0] + targets[1]
        return jnp.mean(r ** 2 if square else jnp.abs(r))

    k = np.random.default_rng(4)
    inputs = {"a": jnp.asarray(k.normal(size=(12, 3)), jnp.float32), "b": jnp.asarray(k.normal(size=12), jnp.float32)}
    targets = (jnp.asarray(k.normal(size=12), jnp.float32), jnp.asarray(k.normal(size=12), jnp.float32))
    p = jnp.asarray(k.normal(size=3), jnp.float32)
    scale = jnp.float32(1.5)                                               # a 0-d array: passed whole, not split
    full = jax.value_and_grad(loss)
    for square in (True, False):
        got = optim.microbatch(full, 3)(p, inputs, targets, scale=scale, square=square)
        want = full(p, inputs, targets, scale=scale, square=square)
        assert_tree_close(got, want, rtol=1e-5, atol=1e-6)


def test_under_jit_equals_eager_and_traces_once():
    p, (x, y) = mlp_params(), data()
    traces = []

    def loss(p, x, y):
        traces.append(x.shape)
        return mlp_loss(p, x, y)

    f = optim.microbatch(jax.value_and_grad(loss), 4)
    jitted = jax.jit(f)
    got = jitted(p, x, y)
    assert_tree_close(got, f(p, x, y), rtol=1e-6, atol=1e-7)
    assert_tree_close(got, jax.value_and_grad(mlp_loss)(p, x, y), rtol=1e-5, atol=1e-7)
    assert all(s == (6, 6) for s in traces)                               # every trace sees one slice
    count = len(traces)
    jitted(p, x + 1.0, y)
    assert len(traces) == count                                            # same shapes: no retrace


def test_eager_calls_compile_once_per_structure():
    p, (x, y) = mlp_params(), data()
    traces = []

    def loss(p, x, y, *, flag, tags):
        traces.append(flag)
        return mlp_loss(p, x, y) * (2.0 if flag else 1.0)

    f = optim.microbatch(jax.value_and_grad(loss), 4)
    a = f(p, x, y, flag=True, tags="t")
    count = len(traces)
    b = f(jax.tree.map(lambda v: v * 1.0, p), x + 0.0, y, flag=True, tags="t")   # new arrays, same shapes
    assert len(traces) == count
    assert_tree_close(a, b, rtol=0)
    c = f(p, x, y, flag=False, tags="t")                                   # a new Python flag: a new program
    assert len(traces) > count
    assert_tree_close(c, jax.tree.map(lambda v: v / 2, a), rtol=1e-6, atol=1e-8)
    d = f(p, x, y, flag=False, tags={"t"})                                 # unhashable non-array leaf: still runs
    assert_tree_close(d, c, rtol=1e-6, atol=1e-8)


def test_n_equal_1_is_grad_fn_itself_without_scan():
    p, (x, y) = mlp_params(), data()
    full = jax.value_and_grad(mlp_loss)
    f = optim.microbatch(full, 1)
    assert_tree_close(f(p, x, y), full(p, x, y), rtol=0)
    assert "scan" not in str(jax.make_jaxpr(f)(p, x, y))
    assert "scan" in str(jax.make_jaxpr(optim.microbatch(full, 2))(p, x, y))


def test_accepts_numpy_and_leaves_inputs_unchanged():
    p, (x, y) = mlp_params(), data()
    xn, yn = np.asarray(x), np.asarray(y)
    xc, yc = xn.copy(), yn.copy()
    pn = jax.tree.map(np.asarray, p)
    got = optim.microbatch(jax.value_and_grad(mlp_loss), 4)(pn, xn, yn)
    assert_tree_close(got, jax.value_and_grad(mlp_loss)(p, x, y), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(xn, xc)
    np.testing.assert_array_equal(yn, yc)


def test_different_leading_sizes_are_split_each_into_n():
    def f(p, batch):
        return jnp.mean(batch["a"]) * p + jnp.mean(batch["b"])

    batch = {"a": jnp.arange(8.0), "b": jnp.arange(4.0)}
    close(optim.microbatch(f, 4)(jnp.float32(2.0), batch), 2 * 3.5 + 1.5, rtol=1e-6)


def test_sum_loss_gives_the_mean_of_slice_sums():
    sum_loss = lambda p, x, y: jnp.sum((x @ p - y) ** 2)
    x, y = data()
    p = jnp.ones(6)
    got = optim.microbatch(jax.value_and_grad(sum_loss), 4)(p, x, y)
    assert_tree_close(got, jax.tree.map(lambda v: v / 4, jax.value_and_grad(sum_loss)(p, x, y)), rtol=1e-5)


# ----------------------------------------------------------------------------------------- dtypes and leaves
def test_low_precision_accumulates_in_float32():
    def g(p, x):                              # one element per slice: the slice values themselves
        return x[0] * p

    x = jnp.array([256.0, 1.0, 1.0, 1.0], jnp.bfloat16)
    out = optim.microbatch(g, 4)(jnp.bfloat16(1.0), x)
    assert out.dtype == jnp.bfloat16
    want = np.float32(259.0 / 4)                                          # bfloat16 running sum would be 256 / 4
    assert float(out) == float(jnp.bfloat16(want))
    assert float(out) != 64.0
    with jax.enable_x64(True):                                            # float16 and float64 keep their dtypes
        for dt in (jnp.float16, jnp.float64):
            o = optim.microbatch(g, 4)(jnp.asarray(1.0, dt), x.astype(dt))
            assert o.dtype == dt


def test_complex_leaves_averaged():
    def g(p, x):
        return jnp.mean(x) * p, jnp.mean(jnp.abs(x))

    x = jnp.array([1 + 2j, 3 - 1j, -2 + 0.5j, 4j], jnp.complex64)
    got = optim.microbatch(g, 2)(jnp.complex64(1 - 1j), x)
    assert got[0].dtype == jnp.complex64
    assert_tree_close(got, g(jnp.complex64(1 - 1j), x), rtol=1e-6)


def test_float0_gradients_and_none_leaves():
    def loss(p, x):
        return jnp.mean(x @ p["w"]) * p["k"].astype(jnp.float32)

    p = {"w": jnp.ones(3), "k": jnp.int32(2)}
    x = jnp.arange(12.0).reshape(4, 3)
    full = jax.value_and_grad(loss, allow_int=True)
    (l, g) = optim.microbatch(full, 2)(p, x)
    (lf, gf) = full(p, x)
    assert g["k"].dtype == jax.dtypes.float0 and g["k"].shape == gf["k"].shape
    close(l, lf, rtol=1e-6)
    close(g["w"], gf["w"], rtol=1e-6)
    out = optim.microbatch(lambda p, x: (jnp.mean(x), {"a": p * jnp.mean(x), "b": None}), 2)(jnp.float32(1.0), x)
    assert out[1]["b"] is None
    close(out[1]["a"], 5.5, rtol=1e-6)


def test_bool_output_raises_naming_the_path():
    def g(p, x):
        return jnp.mean(x) * p, {"flag": jnp.any(x > 0)}

    with pytest.raises(TypeError, match=r"output leaf '1\.flag' is bool\[\]"):
        optim.microbatch(g, 2)(jnp.float32(1.0), jnp.arange(4.0))


# -------------------------------------------------------------------------------------------------- errors
def recording(grad_fn):
    calls = []

    def f(*a, **k):
        calls.append(1)
        return grad_fn(*a, **k)
    return f, calls


def test_not_divisible_names_the_path_and_sizes_before_computing():
    fn, calls = recording(lambda p, b: jnp.mean(b["x"]["img"]) * p)
    batch = {"x": {"img": jnp.ones((10, 3))}, "y": jnp.ones(12)}
    with pytest.raises(ValueError, match=r"batch leaf 'x\.img' of argument 1 \(float32\[10, 3\]\) has a leading "
                                         r"axis of size 10, not divisible by n=4 \(10 = 4 \* 2 \+ 2\)"):
        optim.microbatch(fn, 4)(jnp.float32(1.0), batch)
    with pytest.raises(ValueError, match=r"batch leaf '1' of argument 2 \(float32\[5\]\).*size 5.*n=4"):
        optim.microbatch(fn, 4)(jnp.float32(1.0), jnp.ones(8), (jnp.ones(8), jnp.ones(5)))
    with pytest.raises(ValueError, match=r"'x\.img'"):                  # inside jit too, at trace time
        jax.jit(optim.microbatch(fn, 4))(jnp.float32(1.0), batch)
    assert calls == []


def test_scalar_and_non_array_batch_leaves_raise_type_error_naming_the_path():
    fn, calls = recording(lambda p, b: p)
    with pytest.raises(TypeError, match=r"batch leaf 'lr' of argument 1 is a scalar \(float32\[\]\)"):
        optim.microbatch(fn, 2)(jnp.float32(1.0), {"x": jnp.ones(4), "lr": jnp.float32(0.1)})
    with pytest.raises(TypeError, match=r"batch leaf 'meta\.0' of argument 1 is float, not an array"):
        optim.microbatch(fn, 2)(jnp.float32(1.0), {"x": jnp.ones(4), "meta": [0.5]})
    with pytest.raises(TypeError, match=r"batch leaf <root> of argument 1 is a scalar"):
        optim.microbatch(fn, 1)(jnp.float32(1.0), jnp.float32(3.0))        # n == 1 checks the same
    with pytest.raises(TypeError, match=r"nothing to split"):
        optim.microbatch(fn, 2)(jnp.float32(1.0))
    assert calls == []


@pytest.mark.parametrize("n,err", [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("2", TypeError),
                                   (True, TypeError), (None, TypeError), (jnp.float32(2), TypeError)])
def test_bad_n_raises_when_microbatch_is_called(n, err):
    with pytest.raises(err, match="n must be a positive int"):
        optim.microbatch(lambda p, x: p, n)


def test_numpy_int_n_accepted_and_grad_fn_must_be_callable():
    f = optim.microbatch(lambda p, x: jnp.mean(x) * p, np.int64(2))
    close(f(jnp.float32(2.0), jnp.arange(4.0)), 3.0, rtol=1e-6)
    with pytest.raises(TypeError, match="grad_fn must be callable"):
        optim.microbatch("loss", 2)


# -------------------------------------------------------------------------------------- the compiled program
def test_compiled_scan_uses_less_temp_memory_than_the_full_batch():
    """Activations dominate (batch 2048, hidden 256, ~70k parameters): the scan program holds one slice's
    activations and one gradient-sized running sum, not n gradients or the full batch's activations."""
    k = np.random.default_rng(5)
    p = {"w1": jnp.asarray(k.normal(size=(16, 256)) / 4, jnp.float32),
         "w2": jnp.asarray(k.normal(size=(256, 256)) / 16, jnp.float32),
         "w3": jnp.asarray(k.normal(size=(256, 1)) / 16, jnp.float32)}
    x = jnp.asarray(k.normal(size=(2048, 16)), jnp.float32)
    y = jnp.asarray(k.normal(size=(2048, 1)), jnp.float32)

    def loss(p, x, y):
        h = jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"])
        return jnp.mean((h @ p["w3"] - y) ** 2)

    full = jax.value_and_grad(loss)

    def temp(f):
        return jax.jit(f).lower(p, x, y).compile().memory_analysis().temp_size_in_bytes

    t_full, t8 = temp(full), temp(optim.microbatch(full, 8))
    grad_bytes = sum(v.size * 4 for v in p.values())
    assert t8 < t_full / 2, (t8, t_full)
    assert t8 < t_full / 8 + 4 * grad_bytes, (t8, t_full, grad_bytes)    # not n copies of the gradient
    assert temp(optim.microbatch(full, 1)) == t_full


# ------------------------------------------------------------------------------------------------ with optim
def test_update_with_mean_grads_on_a_tied_model_matches_full_batch():
    w = jnp.asarray(np.random.default_rng(6).normal(size=(5, 3)), jnp.float32)
    model = {"emb": w, "head": w}

    def loss(m, tok, y):
        h = m["emb"][tok]                                                  # (B, 3)
        logits = h @ m["head"].T                                           # (B, 5)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    k = np.random.default_rng(7)
    tok = jnp.asarray(k.integers(0, 5, size=32), jnp.int32)
    y = jnp.asarray(k.integers(0, 5, size=32), jnp.int32)
    rule = optim.Adam(1e-2)

    state_f, model_f = optim.setup(rule, model), model
    state_m, model_m = optim.setup(rule, model), model
    full = jax.value_and_grad(loss)
    micro = optim.microbatch(full, 4)
    for _ in range(3):
        lf, gf = full(model_f, tok, y)
        lm, gm = micro(model_m, tok, y)
        close(lm, lf, rtol=1e-5)
        state_f, model_f = optim.update(state_f, model_f, gf)
        state_m, model_m = optim.update(state_m, model_m, gm)
    assert model_m["emb"] is model_m["head"]
    close(model_m["emb"], model_f["emb"], rtol=1e-5, atol=1e-6)

    @jax.jit
    def step(state, m):
        _, g = micro(m, tok, y)
        return optim.update(state, m, g)

    s, m = step(optim.setup(rule, model), model)
    s2, m2 = optim.update(optim.setup(rule, model), model, full(model, tok, y)[1])
    close(m["emb"], m2["emb"], rtol=1e-5, atol=1e-6)
    close(m["head"], m2["head"], rtol=1e-5, atol=1e-6)
