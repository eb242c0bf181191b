"""Whole-model rules (ClipGlobalNorm, SkipNonFinite) and per-leaf rule choice (`setup` with a function)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optim
from conftest import close, counted_update


def test_clip_global_norm_exact():
    m = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    state = optim.setup(optim.chain(optim.ClipGlobalNorm(1.0), optim.Descent(1.0)), m)
    _, out = optim.update(state, m, {"a": jnp.array([3.0]), "b": jnp.array([4.0])})
    close(out["a"], [-0.6])
    close(out["b"], [-0.8])
    _, out = optim.update(state, m, {"a": jnp.array([0.3]), "b": jnp.array([0.4])})   # below the bound
    close(out["b"], [-0.4])
    _, out = optim.update(state, m, {"a": jnp.array([3.0]), "b": None})               # None does not count
    close(out["a"], [-1.0])


def test_clip_global_norm_counts_a_tie_once_unlike_optax():
    w = jnp.zeros(2)
    m = {"enc": w, "dec": w}
    g = {"enc": jnp.array([3.0, 4.0]), "dec": jnp.array([3.0, 4.0])}
    state = optim.setup(optim.chain(optim.ClipGlobalNorm(1.0), optim.Descent(1.0)), m)
    _, out = optim.update(state, m, g)
    close(out["enc"], [-0.6, -0.8])               # the summed gradient [6, 8] has norm 10
    assert float(optim.global_norm(g, state)) == pytest.approx(10.0)
    assert float(optax.global_norm(g)) == pytest.approx(np.sqrt(50.0))   # optax counts the tie twice
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    u, _ = tx.update(g, tx.init(m), m)
    summed_optax_step = np.asarray(u["enc"] + u["dec"])
    assert not np.allclose(summed_optax_step, [-0.6, -0.8])


def test_clip_global_norm_inside_jit_and_after_a_per_leaf_stage():
    m = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    rule = optim.chain(optim.ClipGrad(3.0), optim.ClipGlobalNorm(1.0), optim.Descent(1.0))
    state = optim.setup(rule, m)
    _, out = jax.jit(optim.update)(state, m, {"a": jnp.array([30.0]), "b": jnp.array([4.0])})
    close(out["a"], [-0.5 ** 0.5])                # clipped to (3, 3) first, then to norm 1
    close(out["b"], [-0.5 ** 0.5])


def test_skip_non_finite_leaves_everything_untouched_and_counts():
    m = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])}
    state = optim.setup(optim.SkipNonFinite(optim.Adam(0.1)), m)
    good = {"a": jnp.array([1.0, 1.0]), "b": jnp.array([1.0])}
    bad = {"a": jnp.array([1.0, jnp.nan]), "b": jnp.array([1.0])}
    for step in (optim.update, jax.jit(optim.update)):
        s1, m1 = step(state, m, bad)
        close(m1["a"], m["a"])
        close(m1["b"], m["b"])
        assert int(s1["b"].state.skipped) == 1 and int(s1["a"].state.skipped) == 1
        jax.tree.map(close, s1["a"].state.inner, state["a"].state.inner)
        s2, m2 = step(s1, m1, good)
        _, ref = optim.update(optim.setup(optim.Adam(0.1), m), m, good)
        close(m2["a"], ref["a"])
        assert int(s2["a"].state.skipped) == 1
    s3, m3 = optim.update(state, m, {"a": jnp.array([1.0, jnp.inf]), "b": None})
    close(m3["a"], m["a"])


def test_skip_non_finite_under_vmap_skips_only_the_bad_members():
    # vmap batches the finiteness flag: the CPU conditional becomes a select per member.
    m = {"a": jnp.ones((3, 2)), "b": jnp.ones((3, 1))}
    state = jax.vmap(lambda x: optim.setup(optim.SkipNonFinite(optim.Adam(0.1)), x, ties={}))(m)
    g = {"a": jnp.array([[1.0, 1.0], [jnp.nan, 1.0], [2.0, 1.0]]), "b": jnp.ones((3, 1))}
    s1, m1 = jax.vmap(optim.update)(state, m, g)
    for i in range(3):
        one = optim.setup(optim.SkipNonFinite(optim.Adam(0.1)), jax.tree.map(lambda a: a[i], m))
        s_ref, m_ref = optim.update(one, jax.tree.map(lambda a: a[i], m), jax.tree.map(lambda a: a[i], g))
        jax.tree.map(lambda a, b: close(a[i], b), m1, m_ref)
        assert int(s1["a"].state.skipped[i]) == int(s_ref["a"].state.skipped) == (i == 1)


def _compiled_copies(rule, m, g):
    text = jax.jit(optim.update, donate_argnums=(0, 1)).lower(optim.setup(rule, m), m, g).compile().as_text()
    entry = text[text.index("ENTRY"):]
    # Copies of parameter-sized arrays (a pack of the rules' small numbers may be copied: a few bytes).
    sizes = [math.prod(int(d) for d in dims.split(",") if d)
             for dims in re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", entry)]
    return sum(n >= 1024 for n in sizes), entry


@pytest.mark.parametrize("inner", [optim.AdamW(1e-3), optim.AdaDelta()], ids=["AdamW", "AdaDelta"])
def test_skip_non_finite_copies_no_state_on_xla_s_path(inner, monkeypatch):
    # A select between the new and the old state made XLA:CPU copy each state array before overwriting it in
    # place (3 copies per Adam parameter); the CPU conditional of `skip_unless` copies none.
    from optim._engine import fused
    monkeypatch.setattr(fused, "ENABLED", False)
    m = {f"w{i}": jnp.ones((4096,)) for i in range(3)}
    g = jax.tree.map(lambda a: 0.1 * a, m)
    copies, entry = _compiled_copies(optim.SkipNonFinite(inner), m, g)
    assert " conditional(" in entry
    assert copies == 0, entry


def test_skip_non_finite_is_branch_free_off_cpu():
    # Lowered for GPU the step selects (a conditional would read its predicate back to the host each step).
    m = {"a": jnp.ones((8,))}
    state = optim.setup(optim.SkipNonFinite(optim.Adam(0.1)), m)
    def text(platform):
        return jax.jit(optim.update).trace(state, m, m).lower(lowering_platforms=(platform,)).as_text()

    # Both carry the (constant) platform switch of `lax.platform_dependent`; only CPU's has the conditional.
    cuda, cpu = text("cuda"), text("cpu")
    assert cpu.count("stablehlo.case") == cuda.count("stablehlo.case") + 1
    assert "stablehlo.select" in cuda


def test_rule_per_leaf_and_tie_groups():
    model = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    state = optim.setup(lambda path, x: optim.Muon(0.02) if x.ndim == 2 else optim.AdamW(3e-4), model)
    assert isinstance(state["w"].rule, optim.Muon) and isinstance(state["b"].rule, optim.AdamW)
    assert len(state.rules) == 2
    same = optim.setup(lambda path, x: optim.AdamW(3e-4), model)
    assert len(same.rules) == 1                     # equal rules are shared: one group of hyperparameters
    w = jnp.ones(2)
    with pytest.raises(ValueError, match="'a' and 'b' are tied .* different rules"):
        optim.setup(lambda path, x: optim.Descent(0.1 if path == "a" else 0.2), {"a": w, "b": w})
    with pytest.raises(TypeError, match="returned 3 for 'a'"):
        optim.setup(lambda path, x: 3, {"a": w})
    s = optim.adjust(state, lr=1e-3)
    assert float(s["w"].rule.lr) == pytest.approx(1e-3) and float(s["b"].rule.lr) == pytest.approx(1e-3)
    g = jax.tree.map(jnp.ones_like, model)
    _, out = optim.update(state, model, g)
    # each leaf takes its own rule's step: what that rule alone gives on that leaf
    _, muon_alone = optim.update(optim.setup(optim.Muon(0.02), {"w": model["w"]}), {"w": model["w"]}, {"w": g["w"]})
    close(out["w"], muon_alone["w"])
    assert not np.allclose(out["w"], model["w"])
    close(out["b"], [-3e-4, -3e-4], rtol=1e-5, atol=0)   # AdamW's first step is lr * sign(g)


# ----------------------------------------------------------------------------------------------- SkipLargeUpdates
def skip_reference(norms, sigma, warmup, beta):
    """A numpy model of SkipLargeUpdates from its definition: per step the decision, the statistics after it
    (count, mean, var, skipped), and the threshold it used. The mean and variance are the weighted ones of every
    value taken in so far (weights beta^(n-k)), computed by direct sums, not by the incremental update."""
    ys, skipped, out = [], 0, []
    for x in norms:
        n = len(ys)
        mu = var = 0.0
        if n:
            w, y = beta ** np.arange(n - 1, -1, -1.0), np.array(ys)
            mu = np.sum(w * y) / np.sum(w)
            var = np.sum(w * (y - mu) ** 2) / np.sum(w)
        thr = mu + sigma * np.sqrt(var)
        skip = True
        if np.isfinite(x):
            skip = bool(n >= warmup and var > 0 and x > thr)
            ys.append(min(x, thr) if skip else x)
        skipped += skip
        n = len(ys)
        w, y = beta ** np.arange(n - 1, -1, -1.0), np.array(ys)
        mu = np.sum(w * y) / np.sum(w) if n else 0.0
        var = np.sum(w * (y - mu) ** 2) / np.sum(w) if n else 0.0
        out.append({"skip": skip, "thr": thr, "late": n >= warmup, "count": n, "mean": mu, "var": var,
                    "skipped": skipped})
    return out


def scripted_norms():
    """50 gradient norms near 1: a NaN and a spike during warmup (10 steps), a NaN and two spikes after it,
    then from step 30 a lasting shift to about 6."""
    k = np.arange(50)
    norms = 1 + 0.1 * np.sin(1.7 * k)
    norms[3], norms[6] = np.nan, 4.0
    norms[15], norms[18], norms[22] = np.nan, 50.0, 10.0
    norms[30:] = 6 + 0.2 * np.sin(1.7 * k[30:])
    return norms


UNIT = {"a": np.array([0.48, 0.0, 0.6], np.float32), "b": np.array([0.0, 0.64], np.float32)}   # a unit direction


def grads_of_norm(x):
    return {k: jnp.asarray(np.float32(x) * u) for k, u in UNIT.items()}


def exact_norm(g):
    return float(np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in g.values())))


@pytest.mark.parametrize("jit", [False, True])
def test_skip_large_updates_matches_a_numpy_reference(jit):
    step = jax.jit(optim.update) if jit else optim.update
    m = {"a": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([0.25, 3.0])}
    state = optim.setup(optim.SkipLargeUpdates(optim.Adam(0.1), sigma=3.0, warmup=10, norm_decay=0.9), m)
    plain = optim.setup(optim.Adam(0.1), m)                   # Adam alone, fed only the accepted gradients
    plain_m = m
    gs = [grads_of_norm(x) for x in scripted_norms()]
    ref = skip_reference([exact_norm(g) for g in gs], 3.0, 10, 0.9)
    for t, (g, r) in enumerate(zip(gs, ref)):
        if r["late"] and np.isfinite(r["thr"]) and np.isfinite(exact_norm(g)):
            assert abs(exact_norm(g) - r["thr"]) > 0.05 * r["thr"], t      # the script keeps clear of the edge
        before_m, before_inner = m, state["a"].state.inner
        state, m = step(state, m, g)
        for p in ("a", "b"):                                  # both parameters hold the same statistics
            stats = state[p].state.stats
            assert int(stats["count"]) == r["count"] and int(stats["skipped"]) == r["skipped"], (t, p)
            close(stats["mean"], r["mean"], rtol=2e-6, err_msg=f"step {t}")
            close(stats["var"], r["var"], rtol=2e-5, atol=1e-6, err_msg=f"step {t}")
        if r["skip"]:                                         # model and Adam's state bitwise untouched
            for p in ("a", "b"):
                np.testing.assert_array_equal(m[p], before_m[p])
            jax.tree.map(np.testing.assert_array_equal, state["a"].state.inner, before_inner)
        else:
            plain, plain_m = optim.update(plain, plain_m, g)
        for p in ("a", "b"):      # the same arithmetic, in another program: equal up to XLA's fusion (an ulp)
            close(m[p], plain_m[p], rtol=1e-6, atol=1e-7, err_msg=f"step {t}")
        jax.tree.map(lambda u, v: close(u, v, rtol=1e-6, atol=1e-7), state["b"].state.inner, plain["b"].state)
    skips = [r["skip"] for r in ref]
    assert [t for t, s in enumerate(skips) if s] == [3, 15, 18, 22, 30, 31, 32]   # the shift is absorbed
    assert int(state["a"].state.stats["skipped"]) == 7 and not any(skips[33:])


def test_skip_large_updates_warmup_and_no_spread():
    m = {"a": jnp.zeros(2)}
    s = optim.setup(optim.SkipLargeUpdates(optim.Descent(1.0), sigma=2.0, warmup=0), m)
    for x in [1.0, 1.0, 1.0, 5.0]:                     # identical norms: no spread, so 5 is not an outlier
        s, m = optim.update(s, m, {"a": jnp.array([x, 0.0])})
    assert int(s["a"].state.stats["skipped"]) == 0 and int(s["a"].state.stats["count"]) == 4
    s, m2 = optim.update(s, m, {"a": jnp.array([100.0, 0.0])})
    assert int(s["a"].state.stats["skipped"]) == 1
    np.testing.assert_array_equal(m2["a"], m["a"])
    # during warmup even a huge norm is a step; a non-finite one is skipped and not taken in
    s = optim.setup(optim.SkipLargeUpdates(optim.Descent(1.0), sigma=2.0, warmup=3), {"a": jnp.zeros(2)})
    for x, skipped, count in [(1.0, 0, 1), (2.0, 0, 2), (jnp.inf, 1, 2), (1000.0, 1, 3), (1.5, 1, 4)]:
        s, _ = optim.update(s, {"a": jnp.zeros(2)}, {"a": jnp.array([x, 0.0])})
        assert (int(s["a"].state.stats["skipped"]), int(s["a"].state.stats["count"])) == (skipped, count)
    assert np.isfinite(float(s["a"].state.stats["mean"])) and np.isfinite(float(s["a"].state.stats["var"]))


def test_skip_large_updates_adjust_without_retrace():
    step, traces = counted_update()

    m = {"a": jnp.zeros(2)}
    s = optim.setup(optim.SkipLargeUpdates(optim.Descent(1.0), sigma=3.0, warmup=4), m)
    for x in [1.0, 2.0, 1.0, 2.0]:
        s, m = step(s, m, {"a": jnp.array([x, 0.0])})
    spike = {"a": jnp.array([20.0, 0.0])}
    assert int(step(s, m, spike)[0]["a"].state.stats["skipped"]) == 1
    s2 = optim.adjust(s, sigma=100.0)                          # a looser bound: the spike is a step
    assert float(s2["a"].rule.sigma) == 100.0
    assert int(step(s2, m, spike)[0]["a"].state.stats["skipped"]) == 0
    s3 = optim.adjust(s, warmup=10)                            # back in warmup: a step
    assert int(s3["a"].rule.warmup) == 10 and jnp.issubdtype(s3["a"].rule.warmup.dtype, jnp.integer)
    assert int(step(s3, m, spike)[0]["a"].state.stats["skipped"]) == 0
    s4 = optim.adjust(s, norm_decay=0.5, warmup=0)
    assert int(step(s4, m, spike)[0]["a"].state.stats["skipped"]) == 1
    assert len(traces) == 1
    with pytest.raises(ValueError, match="sigma"):
        optim.adjust(s, sigma=-1.0)
    with pytest.raises(ValueError, match="warmup"):
        optim.adjust(s, warmup=2.5)
    with pytest.raises(ValueError, match="norm_decay"):
        optim.adjust(s, norm_decay=1.0)


def test_skip_large_updates_counts_a_tie_once():
    w = jnp.ones(3)
    model = {"emb": w, "head": w}
    s = optim.setup(optim.SkipLargeUpdates(optim.Descent(0.1), sigma=1.0, warmup=1), model)
    g = {"emb": jnp.array([1.0, 2.0, 2.0]), "head": jnp.array([3.0, 0.0, 4.0])}
    s, model = optim.update(s, model, g)
    tied = np.sqrt(4.0 ** 2 + 2.0 ** 2 + 6.0 ** 2)          # the norm of the summed gradient [4, 2, 6]
    close(s["emb"].state.stats["mean"], tied)
    assert abs(tied - np.sqrt(9.0 + 25.0)) > 1               # not the norm over positions (sqrt(34), optax)
    assert model["emb"] is model["head"]
    close(model["emb"], 1 - 0.1 * np.array([4.0, 2.0, 6.0]))
    # a second norm (sqrt(24)) makes a spread; then a summed gradient of 10x the first norm is skipped, while
    # large gradients at the two positions that cancel to a summed norm of 6 are a step
    s, model = optim.update(s, model, {"emb": jnp.array([1.0, 2.0, 2.0]), "head": jnp.array([1.0, 0.0, 2.0])})
    s1, m1 = optim.update(s, model, jax.tree.map(lambda v: 10 * v, g))
    assert int(s1["head"].state.stats["skipped"]) == 1 and m1["emb"] is m1["head"]
    np.testing.assert_array_equal(m1["emb"], model["emb"])
    cancel = {"emb": jnp.array([54.0, 102.0, 104.0]), "head": jnp.array([-50.0, -100.0, -100.0])}
    s2, m2 = optim.update(s, model, cancel)
    assert int(s2["head"].state.stats["skipped"]) == 0 and int(s2["head"].state.stats["count"]) == 3
    close(m2["emb"], model["emb"] - 0.1 * np.array([4.0, 2.0, 4.0]))


@pytest.mark.parametrize("outer", ["SkipNonFinite", "SkipLargeUpdates"])
def test_skip_large_updates_nested_with_skip_non_finite(outer):
    large = lambda r: optim.SkipLargeUpdates(r, sigma=3.0, warmup=3)   # noqa: E731
    rule = (optim.SkipNonFinite(large(optim.Adam(0.1))) if outer == "SkipNonFinite"
            else large(optim.SkipNonFinite(optim.Adam(0.1))))
    m = {"a": jnp.array([1.0, 2.0])}
    s = optim.setup(rule, m)
    plain, plain_m = optim.setup(optim.Adam(0.1), m), m
    for x in [1.0, 1.2, 0.9, 1.1, np.nan, 30.0, 1.0, np.inf, 1.05]:
        g = {"a": jnp.array([x, 0.0], jnp.float32)}
        s, m = jax.jit(optim.update)(s, m, g)
        if np.isfinite(x) and x < 10:
            plain, plain_m = optim.update(plain, plain_m, g)
        close(m["a"], plain_m["a"], rtol=1e-6, atol=1e-7)
    st = s["a"].state
    if outer == "SkipNonFinite":     # NaN / Inf counted outside, the spike inside
        assert int(st[1]) == 2 and int(st[0][1]["skipped"]) == 1 and int(st[0][1]["count"]) == 7
        jax.tree.map(close, st[0][0], plain["a"].state)
    else:                            # the outer wrapper skips all three and keeps the inner counter at 0
        assert int(st[1]["skipped"]) == 3 and int(st[0][1]) == 0 and int(st[1]["count"]) == 7
        jax.tree.map(close, st[0][0], plain["a"].state)


def test_skip_large_updates_with_clip_global_norm_in_a_chain():
    m = {"a": jnp.zeros(2), "b": jnp.zeros(1)}

    def g(x):
        return {"a": jnp.array([0.6 * x, 0.0]), "b": jnp.array([0.8 * x])}

    norms = [2.0, 2.5, 1.5, 2.2, 40.0]
    # around the chain: the raw norms, before clipping; the spike is skipped
    s = optim.setup(optim.SkipLargeUpdates(optim.chain(optim.ClipGlobalNorm(1.0), optim.Adam(0.1)),
                                           sigma=3.0, warmup=4), m)
    for x in norms:
        s, _ = optim.update(s, m, g(x))
    assert int(s["a"].state.stats["skipped"]) == 1
    close(s["a"].state.stats["count"], 5)
    assert float(s["a"].state.stats["mean"]) > 1.5
    # inside the chain after ClipGlobalNorm: the clipped norms, all 1 (no spread), so nothing is skipped
    s = optim.setup(optim.chain(optim.ClipGlobalNorm(1.0), optim.SkipLargeUpdates(optim.Adam(0.1), sigma=3.0,
                                                                                  warmup=4)), m)
    for x in norms:
        s, _ = optim.update(s, m, g(x))
    assert int(s["a"].state[1].stats["skipped"]) == 0
    close(s["a"].state[1].stats["mean"], 1.0)
    # first in a chain: a skipped step closes the gate for the later stages, whose state is kept
    s = optim.setup(optim.chain(optim.SkipLargeUpdates(optim.ClipGlobalNorm(1.0), sigma=3.0, warmup=4),
                                optim.Adam(0.1)), m)
    model = m
    for x in norms[:-1]:
        s, model = optim.update(s, model, g(x))
    s2, m2 = optim.update(s, model, g(40.0))
    assert int(s2["a"].state[0].stats["skipped"]) == 1
    jax.tree.map(np.testing.assert_array_equal, s2["a"].state[1], s["a"].state[1])
    np.testing.assert_array_equal(m2["a"], model["a"])


def test_skip_large_updates_none_gradient_does_not_count():
    m = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    s = optim.setup(optim.SkipLargeUpdates(optim.Adam(0.1), sigma=3.0, warmup=0, norm_decay=0.5), m)
    s, m = optim.update(s, m, {"a": jnp.array([3.0, 0.0]), "b": jnp.array([0.0, 4.0])})       # norm 5
    s1, m1 = optim.update(s, m, {"a": jnp.array([1.0, 0.0]), "b": None})                      # norm 1
    assert int(s1["a"].state.stats["count"]) == 2 and int(s1["b"].state.stats["count"]) == 1
    close(s1["a"].state.stats["mean"], (0.5 * 5 + 1) / 1.5)                                     # weights 0.5, 1
    jax.tree.map(np.testing.assert_array_equal, s1["b"].state, s["b"].state)                 # not advanced
    np.testing.assert_array_equal(m1["b"], m["b"])
    # next step: the statistics of the parameter that saw the most steps, written to both
    s2, _ = optim.update(s1, m1, {"a": jnp.array([0.0, 0.0]), "b": jnp.array([0.0, 2.0])})    # norm 2
    ref = skip_reference([5.0, 1.0, 2.0], 3.0, 0, 0.5)[-1]
    for p in ("a", "b"):
        assert int(s2[p].state.stats["count"]) == 3 and int(s2[p].state.stats["skipped"]) == 0
        close(s2[p].state.stats["mean"], ref["mean"])
        close(s2[p].state.stats["var"], ref["var"])


def test_skip_large_updates_construction():
    r = optim.SkipLargeUpdates(optim.Adam())
    assert (r.sigma, r.warmup, r.norm_decay) == (6.0, 100, 0.99) and isinstance(r.warmup, int)
    assert optim.SkipLargeUpdates(optim.Adam(), warmup=3.0).warmup == 3
    assert optim.SkipLargeUpdates(optim.Adam(), 2, 0).sigma == 2.0
    assert repr(r).startswith("SkipLargeUpdates(rule=Adam(")
    for kw, err, name in [({"sigma": -1.0}, ValueError, "sigma"), ({"sigma": float("nan")}, ValueError, "sigma"),
                          ({"warmup": -1}, ValueError, "warmup"), ({"warmup": 1.5}, ValueError, "warmup"),
                          ({"warmup": "3"}, TypeError, "warmup"), ({"warmup": True}, TypeError, "warmup"),
                          ({"norm_decay": 1.0}, ValueError, "norm_decay"),
                          ({"norm_decay": -0.1}, ValueError, "norm_decay")]:
        with pytest.raises(err, match=f"SkipLargeUpdates: {name}"):
            optim.SkipLargeUpdates(optim.Adam(), **kw)
    with pytest.raises(TypeError, match="SkipLargeUpdates: rule"):
        optim.SkipLargeUpdates(0.5)
    with pytest.raises(TypeError):
        optim.SkipLargeUpdates()


def test_skip_large_updates_checkpoint_round_trip(tmp_path):
    def fresh():
        w = jnp.array([1.0, 2.0])
        model = {"emb": w, "head": w, "b": jnp.zeros(3)}
        return optim.setup(optim.SkipLargeUpdates(optim.Adam(0.1), sigma=2.5, warmup=3), model), model

    state, model = fresh()
    state = optim.adjust(state, warmup=2)
    for x in [1.0, 1.3, 0.8, 50.0, 1.1]:
        g = {"emb": jnp.full(2, x), "head": jnp.zeros(2), "b": jnp.full(3, x)}
        state, model = optim.update(state, model, g)
    assert int(state["b"].state.stats["skipped"]) == 1
    optim.save(tmp_path / "skip.npz", state, model)
    new_state, new_model = optim.load(tmp_path / "skip.npz", like=fresh())
    assert int(new_state["b"].rule.warmup) == 2 and float(new_state["b"].rule.sigma) == 2.5
    jax.tree.map(np.testing.assert_array_equal, new_state["b"].state, state["b"].state)
    jax.tree.map(np.testing.assert_array_equal, new_state["emb"].state, state["emb"].state)
    g = {"emb": jnp.full(2, 60.0), "head": jnp.zeros(2), "b": jnp.full(3, 0.9)}
    a, ma = optim.update(state, model, g)
    b, mb = optim.update(new_state, new_model, g)
    jax.tree.map(np.testing.assert_array_equal, (a["b"].state, ma), (b["b"].state, mb))
    assert new_model["emb"] is new_model["head"]
