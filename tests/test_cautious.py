"""`Cautious(rule)`: the mask `u g > 0` rescaled by `n / (Σ mask + 1)` per parameter, against numpy written from the
paper (Liang et al. 2024, arXiv:2411.16085) and C-Optim's code, and how it composes: a decoupled decay left unmasked,
chains, ties, `None` gradients, freezing, stacks (one sum per member), `adjust`, checkpoints, complex parameters.

The registry entry (`rule_cases.py`) runs it through the shared reference, stacking, dtype and convergence tests;
this file checks what is particular to the wrapper.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from conftest import close, counted_update
from rule_refs import r_adam, r_adamw, r_cautious, r_lion, f32

O = optim


def _grads(shape, n, seed=0):
    """Gradients whose signs flip between steps, so that the moment and the gradient disagree on some entries."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def _mask64(u, g):
    """The paper's mask, rescaled: (u g > 0) · n / (Σ (u g > 0) + 1), over the whole array."""
    m = (u * g > 0).astype(np.float64)
    return m * (m.size / (m.sum() + 1))


def _follow(rule, ref, x0, grads):
    """Run `rule` on one parameter and the float64 reference side by side, comparing every step."""
    model = {"p": jnp.asarray(x0)}
    state = optim.setup(rule, model)
    x, s = x0.astype(np.float64), ref.init(x0.astype(np.float64))
    for t, g in enumerate(grads):
        state, model = optim.update(state, model, {"p": jnp.asarray(g)})
        s, d = ref.apply(s, x, g.astype(np.float64))
        x = x - d
        close(model["p"], x, rtol=1e-5, atol=1e-6, err_msg=f"step {t + 1}")


# ----------------------------------------------------------------------------------------------- the formula
def test_cautious_adam_masks_and_rescales_per_parameter():
    """Cautious(Adam) on a matrix: every step against numpy, and the mask really drops entries."""
    x0 = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    grads = _grads((3, 4), 6)
    _follow(O.Cautious(O.Adam(0.1)), r_cautious(r_adam(0.1)), x0, grads)
    # the masked entries do not move at all, the others by Adam's step times n / (Σ mask + 1)
    model = {"p": jnp.asarray(x0)}
    state = optim.setup(O.Cautious(O.Adam(0.1)), model)
    inner = optim.setup(O.Adam(0.1), model)
    for g in grads[:2]:
        before = np.asarray(model["p"])
        inner, adam = optim.update(inner, model, {"p": jnp.asarray(g)})     # the same moments as Cautious's
        state, model = optim.update(state, model, {"p": jnp.asarray(g)})
        u = before - np.asarray(adam["p"])
        agree = u * g > 0
        step = before - np.asarray(model["p"])
        assert (step[~agree] == 0).all()
        close(step[agree], u[agree] * 12 / (agree.sum() + 1), rtol=1e-5, atol=1e-7)
    assert 0 < agree.sum() < 12                            # the second step masks some entries, not all


def test_cautious_adamw_does_not_mask_the_decoupled_decay():
    """Exact numbers: where the mask is 0 the parameter moves by the decay η λ x alone (couple=True) or λ x
    (couple=False); where it is 1, by the masked Adam step plus the decay."""
    x = jnp.array([1.0, 2.0, -4.0, 8.0])
    for couple, decay in ((True, np.float32(0.1) * np.float32(0.5)), (False, np.float32(0.5))):
        rule = O.Cautious(O.AdamW(0.1, (0.5, 0.999), weight_decay=0.5, couple=couple))
        state = optim.setup(rule, {"p": x})
        # step 1: u = η sign(g) agrees everywhere: η sign(g) · 4/5 + decay · x
        g1 = jnp.array([1.0, 1.0, 1.0, 1.0])
        state, m = optim.update(state, {"p": x}, {"p": g1})
        np.testing.assert_allclose(np.asarray(m["p"]), np.asarray(x) - (np.float32(0.1) * 0.8 + decay * np.asarray(x)),
                                   rtol=1e-6)
        # step 2: m = 0.5 · 1 + 0.5 · (-0.25) = 0.375 > 0 on entries 0, 1, where g < 0: masked
        g2 = jnp.array([-0.25, -0.25, 1.0, 1.0])
        x1 = m["p"]
        state, m2 = optim.update(state, {"p": x1}, {"p": g2})
        got = np.asarray(m2["p"])
        want_masked = np.asarray(x1) - decay * np.asarray(x1)
        np.testing.assert_array_equal(got[:2], want_masked[:2].astype(np.float32))
        # entries 2, 3: the Adam step with mask 4 / (2 + 1), plus the decay
        s = optim.setup(O.Adam(0.1, (0.5, 0.999)), {"p": x})
        s, _ = optim.update(s, {"p": x}, {"p": g1})
        _, a = optim.update(s, {"p": x1}, {"p": g2})
        u = np.asarray(x1) - np.asarray(a["p"])
        np.testing.assert_allclose(got[2:], (np.asarray(x1) - u * 4 / 3 - decay * np.asarray(x1))[2:], rtol=1e-6)
        # and it is not what masking the whole AdamW step would give
        assert not np.allclose(got[:2], np.asarray(x1)[:2])


def test_cautious_lion_against_numpy():
    x0 = np.linspace(-1, 1, 7).astype(np.float32)
    _follow(O.Cautious(O.Lion(0.05, (0.8, 0.95))), r_cautious(r_lion(0.05, (0.8, 0.95))), x0, _grads(7, 8, 2))


def test_cautious_chain_with_clip_global_norm_masks_the_clipped_step_and_keeps_the_norm_global():
    """`Cautious(chain(ClipGlobalNorm(1), AdamW(λ)))` on two parameters: one norm over both (the clip looks
    across), one mask per parameter, the decay of the last stage unmasked."""
    rng = np.random.default_rng(3)
    x0 = {"a": rng.standard_normal(5).astype(np.float32), "b": rng.standard_normal((2, 3)).astype(np.float32)}
    grads = [{k: (3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in x0.items()} for _ in range(5)]
    lr, wd = 0.1, 0.3
    rule = O.Cautious(O.chain(O.ClipGlobalNorm(1.0), O.AdamW(lr, weight_decay=wd)))
    model = {k: jnp.asarray(v) for k, v in x0.items()}
    state = optim.setup(rule, model)
    x = {k: v.astype(np.float64) for k, v in x0.items()}
    inner = {k: r_adamw(lr) for k in x}
    s = {k: inner[k].init(x[k]) for k in x}
    for g in grads:
        state, model = optim.update(state, model, {k: jnp.asarray(v) for k, v in g.items()})
        norm = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in g.values()))
        f = min(1.0, 1.0 / norm)
        for k in x:
            s[k], u = inner[k].apply(s[k], x[k], f * g[k].astype(np.float64))
            x[k] = x[k] - (u * _mask64(u, g[k]) + f32(lr) * f32(wd) * x[k])
            close(model[k], x[k], rtol=1e-5, atol=1e-6)
    assert f < 1                                            # the clip was active


def test_cautious_of_a_rule_without_separable_decay_masks_everything():
    """A decay that is not the last stage of a chain (`WeightDecay` after `Momentum` here), or Lamb's, inside its
    trust ratio, is masked with the rest: an entry where the step disagrees does not move at all."""
    x = jnp.array([1.0, 2.0, 3.0, 4.0])
    state = optim.setup(O.Cautious(O.chain(O.Momentum(0.1, 0.9), O.WeightDecay(0.1))), {"p": x})
    state, m = optim.update(state, {"p": x}, {"p": jnp.ones(4)})
    state, m2 = optim.update(state, {"p": m["p"]}, {"p": jnp.array([-0.5, 1.0, 1.0, 1.0])})
    assert float(m2["p"][0]) == float(m["p"][0])
    from optim._rules.cautious import split_decay
    rule = O.Lamb(0.1, weight_decay=0.1)
    assert split_decay(rule) == (rule, None)
    bare, decay = split_decay(O.SkipNonFinite(O.AdamW(0.1, weight_decay=0.2)))
    assert bare.rule.weight_decay == 0.0 and decay is not None
    bare, decay = split_decay(O.chain(O.AdamW(0.1, weight_decay=0.2), O.Scale(0.5)))   # decay not last: masked
    assert decay is None


# ----------------------------------------------------------------------------------------------- composition
def test_ties_mask_with_the_summed_gradient():
    """A tied parameter is one parameter: its gradient is the sum of its parts, and the mask compares with it."""
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal(6).astype(np.float32))
    tied, alone = {"a": w, "b": w}, {"a": w}
    rule = O.Cautious(O.AdamW(0.1, weight_decay=0.1))
    st, sa = optim.setup(rule, tied), optim.setup(rule, alone)
    assert len(st.paths()) == 1
    for t in range(4):
        ga, gb = (jnp.asarray(rng.standard_normal(6).astype(np.float32)) for _ in range(2))
        st, tied = optim.update(st, tied, {"a": ga, "b": gb})
        sa, alone = optim.update(sa, alone, {"a": ga + gb})
        close(tied["a"], alone["a"], rtol=1e-6, atol=1e-7)
        assert tied["a"] is tied["b"]


def test_none_gradient_and_frozen_parameters_do_not_move():
    model = {"a": jnp.ones(3), "b": jnp.full(3, 2.0), "c": jnp.full(3, -1.0)}
    state = optim.freeze(optim.setup(O.Cautious(O.AdamW(0.1, weight_decay=0.1)), model), "c")
    g = {"a": jnp.array([1.0, -1.0, 0.5]), "b": None, "c": jnp.ones(3)}
    new_state, new = optim.update(state, model, g)
    assert new["b"] is model["b"] and new["c"] is model["c"]
    for k in ("b", "c"):
        jax.tree.map(np.testing.assert_array_equal, new_state[k].state, state[k].state)
    assert not np.allclose(new["a"], model["a"])


def test_stacked_members_have_their_own_mask_sums():
    """Many same-shape parameters share one stack; each member's mask is normalised by its own sum: the stacked
    update equals the rule applied to each parameter alone, and numpy."""
    rng = np.random.default_rng(5)
    model = {f"p{i}": jnp.asarray(rng.standard_normal(8).astype(np.float32)) for i in range(6)}
    rule = O.Cautious(O.AdamW(0.1, weight_decay=0.2))
    state = optim.setup(rule, model)
    assert len(state.stacks) < len(model)
    alone = {k: rule.init(v) for k, v in model.items()}
    inner = r_adamw(0.1)                                    # without the decay
    x = {k: np.asarray(v, np.float64) for k, v in model.items()}
    s = {k: inner.init(x[k]) for k in x}
    per_leaf = dict(model)
    counts = set()
    for t in range(4):
        # members agree with their moment on different numbers of entries
        g = {k: jnp.asarray((rng.standard_normal(8) + (i - 3) * 0.3 * (t % 2)).astype(np.float32))
             for i, k in enumerate(model)}
        state, model = optim.update(state, model, g)
        for k in model:
            alone[k], d = jax.jit(rule.apply)(alone[k], per_leaf[k], g[k])
            per_leaf[k] = optim.apply_step(per_leaf[k], d)
            gk = np.asarray(g[k], np.float64)
            s[k], u = inner.apply(s[k], x[k], gk)
            counts.add(int(np.sum(u * gk > 0)))
            x[k] = x[k] - (u * _mask64(u, gk) + f32(0.1) * f32(0.2) * x[k])
            close(model[k], per_leaf[k], rtol=2e-6, atol=1e-7)
            close(model[k], x[k], rtol=1e-5, atol=1e-6)
    assert len(counts) > 2                                  # the members' sums differed


def test_adjust_the_inner_lr_through_cautious_without_retracing():
    step, traces = counted_update()
    model = {"w": jnp.ones((2, 3)), "b": jnp.array([0.5, -0.5])}
    rng = np.random.default_rng(6)
    grads = [{k: jnp.asarray(rng.standard_normal(v.shape).astype(np.float32)) for k, v in model.items()}
             for _ in range(3)]
    state = optim.setup(O.Cautious(O.AdamW(0.01, weight_decay=0.1)), model)
    state, model = step(state, model, grads[0])
    state = optim.adjust(state, lr=0.5)
    assert state.rules[0].rule.lr == 0.5
    new_state, new = step(state, model, grads[1])
    _, want = optim.update(state, model, grads[1])
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-6), new, want)
    # a fresh Cautious(AdamW(0.5)) with the same state steps alike: the new lr is the one used
    other = optim.State.of_params(state.layout, (O.Cautious(O.AdamW(0.5, weight_decay=0.1)),),
                                  [state[p].state for p in state.paths()], state.step)
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-6), optim.update(other, model, grads[1])[1], new)
    step(new_state, new, grads[2])
    assert len(traces) == 1


def test_state_is_the_inner_rules_and_survives_save_and_load(tmp_path):
    model = {"w": jnp.ones((2, 3)), "b": jnp.array([0.5, -0.5])}
    rule = O.Cautious(O.AdamW(0.1, weight_decay=0.1))
    state = optim.setup(rule, model)
    g = {"w": jnp.full((2, 3), 0.3), "b": jnp.array([1.0, -2.0])}
    state, model = optim.update(state, model, g)
    assert type(state["b"].state).__name__ == "AdamState"
    optim.save(tmp_path / "ck", state)
    back = optim.load(tmp_path / "ck", optim.setup(rule, model))
    again = optim.load_state_dict(optim.setup(rule, model), optim.state_dict(state))
    g2 = {"w": jnp.array([[0.3, -0.3, 0.1], [1.0, 1.0, -1.0]]), "b": jnp.array([-1.0, -2.0])}
    want = optim.update(state, model, g2)[1]
    for other in (back, again):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), other.stacks,
                     state.stacks)
        jax.tree.map(lambda a, b: close(a, b, rtol=0, atol=0), optim.update(other, model, g2)[1], want)


def test_mixed_precision_wraps_cautious():
    model = {"w": jnp.ones(4, jnp.bfloat16)}
    state = optim.setup(O.MixedPrecision(O.Cautious(O.AdamW(0.01, weight_decay=0.1))), model)
    state, new = optim.update(state, model, {"w": jnp.array([1.0, -1.0, 1.0, -1.0], jnp.bfloat16)})
    assert new["w"].dtype == jnp.bfloat16
    close(state["w"].state.master, 1 - (0.01 * np.array([1, -1, 1, -1]) * 4 / 5 + 0.01 * 0.1), rtol=1e-6)


def test_ema_wraps_cautious_and_is_refused_inside_it():
    """EMA must wrap Cautious: inside it, the average would be of x minus the unmasked step, a point the model
    never takes, so `setup` refuses it, naming the parameter's path and the form to write. Outside, with decay 0,
    the average is the parameter after each (masked) step."""
    model = {"enc": {"w": jnp.linspace(-1.0, 1.0, 6)}}
    for inside in (O.Cautious(O.EMA(O.AdamW(0.1, weight_decay=0.1), decay=0.0)),
                   O.Cautious(O.chain(O.ClipGlobalNorm(1.0), O.SkipNonFinite(O.EMA(O.Lion(0.1), decay=0.0))))):
        with pytest.raises(ValueError, match=r"^setup: at 'enc\.w': EMA: EMA\(rule=.* is inside Cautious, which "
                                             r"masks the step after EMA took it: .* a point the model never takes\. "
                                             r"An EMA must see the whole step: put it outermost, "
                                             r"EMA\(rule=Cautious\(rule="):
            optim.setup(inside, model)
    state, m = optim.setup(O.EMA(O.Cautious(O.AdamW(0.1, weight_decay=0.1)), decay=0.0), model), model
    for g in _grads((6,), 4):
        state, m = optim.update(state, m, {"enc": {"w": jnp.asarray(g)}})
        close(optim.averaged(state, m)["enc"]["w"], m["enc"]["w"], rtol=0, atol=0)


def test_complex_parameters_mask_with_the_real_inner_product():
    """For a complex entry, the step agrees with the gradient when Re(conj(u) g) > 0 (u and g as vectors of
    ℝ²); the gradient `update` receives is conjugated first (see optim._rules)."""
    x = jnp.array([1 + 1j, 2 - 1j, -1 + 0.5j], jnp.complex64)
    rule = O.Cautious(O.Momentum(0.1, 0.9))
    state = optim.setup(rule, {"p": x})
    g1 = np.array([1 + 0j, 1j, -1 + 0j], np.complex64)
    state, m = optim.update(state, {"p": x}, {"p": jnp.asarray(g1)})
    g2 = np.array([-0.5 + 0j, 1 + 0j, 1j], np.complex64)
    state, m2 = optim.update(state, m, {"p": jnp.asarray(g2)})
    # numpy: the gradient conjugated (descent direction), Momentum's v = ρ v + η g
    d1, d2 = np.conj(g1).astype(np.complex128), np.conj(g2).astype(np.complex128)
    v1 = 0.1 * d1
    v2 = 0.9 * v1 + 0.1 * d2
    agree = np.real(np.conj(v2) * d2) > 0
    assert agree.tolist() == [False, True, True]
    assert np.real(v2[2] * d2[2]) < 0                       # without the conjugate, entry 2 would be masked
    x1 = np.asarray(x) - v1 * 3 / 4
    close(m["p"], x1, rtol=1e-6)
    close(m2["p"], x1 - v2 * agree * 3 / (agree.sum() + 1), rtol=1e-6)


def test_bad_input_is_a_type_error_with_a_hint():
    with pytest.raises(TypeError, match=r"Cautious: rule must be a rule \(it needs init and apply\), got 3; "
                                        r"write Cautious\(AdamW\(1e-3\)\)"):
        O.Cautious(3)
    with pytest.raises(TypeError, match=r"got the class AdamW; write Cautious\(AdamW\(...\)\)"):
        O.Cautious(O.AdamW)                                   # the class, not a rule
    with pytest.raises(TypeError, match="MixedPrecision must wrap Cautious"):
        O.Cautious(O.MixedPrecision(O.Adam()))
    with pytest.raises(TypeError):
        O.Cautious()


# ----------------------------------------------------------------------------------------------- C-Optim
def _c_adamw_torch(torch, x0, grads, lr, betas, eps, wd):
    """C-Optim's `c_adamw.py` AdamW.step (non-foreach branch, `correct_bias=True`) with its original mask
    normalisation `mask * (mask.numel() / (mask.sum() + 1))` (kept there as a comment), in float64."""
    p = torch.tensor(x0, dtype=torch.float64)
    exp_avg, exp_avg_sq = torch.zeros_like(p), torch.zeros_like(p)
    beta1, beta2 = betas
    out = []
    for step, g in enumerate(grads, 1):
        grad = torch.tensor(g, dtype=torch.float64)
        if wd > 0.0:
            p.add_(p, alpha=(-lr * wd))
        exp_avg.mul_(beta1).add_(grad, alpha=(1.0 - beta1))
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(eps)
        step_size = lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
        mask = (exp_avg * grad > 0).to(grad.dtype)
        mask = mask * (mask.numel() / (mask.sum() + 1))
        p.add_((exp_avg * mask) / denom, alpha=-step_size)
        out.append(p.clone().numpy())
    return out


def _c_lion_torch(torch, x0, grads, lr, betas, wd):
    """C-Optim's `c_lion.py` update_fn, in float64."""
    p = torch.tensor(x0, dtype=torch.float64)
    exp_avg = torch.zeros_like(p)
    beta1, beta2 = betas
    out = []
    for g in grads:
        grad = torch.tensor(g, dtype=torch.float64)
        p.data.mul_(1 - lr * wd)
        update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
        mask = (update * grad > 0).to(grad.dtype)
        mask = mask * (mask.numel() / (mask.sum() + 1))
        p.add_(update * mask, alpha=-lr)
        exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        out.append(p.clone().numpy())
    return out


def test_matches_c_optim_c_adamw_and_c_lion_float64():
    """C-Optim's formulas run in torch (float64, 30 steps) against Cautious(AdamW) and Cautious(Lion): C-AdamW
    puts ε outside the root of the bias-corrected v̂ as `√v + ε` scaled by `√(1 - β₂ᵗ)`, i.e. ε / √(1 - β₂ᵗ)
    in optim's form, so it is compared with ε = 0 (a gradient entry of 0 never occurs here); C-Lion is exact.
    C-Optim's decayed weights `p (1 - η λ)` before the step are the unmasked `η λ x` here."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal((4, 5))
    grads = [rng.standard_normal((4, 5)) for _ in range(30)]
    with jax.enable_x64(True):
        for rule, theirs in (
                (O.Cautious(O.AdamW(0.01, (0.9, 0.99), weight_decay=0.1, eps=0.0)),
                 _c_adamw_torch(torch, x0, grads, 0.01, (0.9, 0.99), 0.0, 0.1)),
                (O.Cautious(O.Lion(0.01, (0.9, 0.99))),
                 _c_lion_torch(torch, x0, grads, 0.01, (0.9, 0.99), 0.0))):
            model = {"p": jnp.asarray(x0)}
            state = optim.setup(rule, model)
            for t, g in enumerate(grads):
                state, model = optim.update(state, model, {"p": jnp.asarray(g)})
                assert model["p"].dtype == jnp.float64
                close(model["p"], theirs[t], rtol=1e-12, atol=1e-14, err_msg=f"{rule}: step {t + 1}")
