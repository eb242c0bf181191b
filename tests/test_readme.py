"""The README's runnable code blocks run and print what the README says."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_tie_problem_block(capsys):
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    scope: dict = {}
    exec(block, scope)
    np.testing.assert_allclose(scope["p"]["enc"], [0.70, 1.70, 2.70], atol=5e-3)
    np.testing.assert_allclose(scope["p"]["dec"], [1.30, 2.30, 3.30], atol=5e-3)
    np.testing.assert_allclose(scope["m"]["dec"], [1.2997, 2.2996, 3.2994], atol=1e-4)
    assert scope["m"]["enc"] is scope["m"]["dec"]


def test_custom_rule_block():
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "class SignSGD" in b)
    scope: dict = {}
    exec("import jax.numpy as jnp, optim\n" + block, scope)
    import jax.numpy as jnp
    import optim
    s = optim.setup(scope["SignSGD"](0.5), {"w": jnp.ones(2)})
    np.testing.assert_allclose(optim.update(s, {"w": jnp.ones(2)}, {"w": jnp.array([1.0, -1.0])})[1]["w"],
                               [0.5, 1.5])


def test_beyond_the_anchors_block():
    import jax
    import jax.numpy as jnp
    import optim

    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "ClipGlobalNorm" in b)
    w = jnp.array([3.0, 4.0])
    scope = {"jax": jax, "optim": optim, "model": {"a": w, "b": w}, "grads": {"a": w, "b": w}}
    exec(block, scope)
    assert int(scope["state"].step) == 2
    np.testing.assert_allclose(float(optim.global_norm(scope["g"])), 10.0, rtol=1e-6)
    np.testing.assert_allclose(float(scope["stats"]["grad_norm"]), 10.0, rtol=1e-6)   # the tie counted once
    assert sorted(scope["stats"]["per_param"]) == ["a"]


def test_optax_block():
    import jax
    import jax.numpy as jnp
    import optim

    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "to_optax" in b)
    w = jnp.array([1.0, 2.0])
    scope = {"jax": jax, "optim": optim, "model": {"a": w, "b": w}, "grads": {"a": jnp.ones(2), "b": jnp.ones(2)}}
    exec(block, scope)
    assert scope["state"].ties() == {"a": ("b",)}
    np.testing.assert_allclose(scope["model"]["a"], scope["model"]["b"])
    assert not np.allclose(scope["model"]["a"], w)


def _block(marker):
    return next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if marker in b)


def test_recipe_no_decay_on_biases_and_scales():
    import optim

    scope: dict = {}
    exec(_block('"*.scale": optim.Adam'), scope)
    state, model = scope["state"], scope["model"]
    rules = {p: type(leaf.rule).__name__ for p, leaf in state.items()}
    assert rules == {"block.bias": "Adam", "block.norm.bias": "Adam", "block.norm.scale": "Adam", "block.w": "AdamW",
                     "embed": "AdamW", "head.bias": "Adam", "head.w": "AdamW"}
    assert all(isinstance(state[p].rule, optim.AdamW) is (rules[p] == "AdamW") for p in rules)
    # A zero gradient: AdamW's decoupled decay lr * weight_decay = 1e-3 shrinks the matrices, nothing else moves.
    for w in (model["embed"], model["block"]["w"], model["head"]["w"]):
        np.testing.assert_allclose(w, 0.999, rtol=1e-6)
    for b in (model["block"]["bias"], model["block"]["norm"]["scale"], model["block"]["norm"]["bias"],
              model["head"]["bias"]):
        np.testing.assert_array_equal(b, 1.0)


def test_recipe_muon_for_matrices(capsys):
    scope: dict = {}
    exec(_block("hidden matrices: Muon"), scope)
    state, same, model = scope["state"], scope["same"], scope["model"]
    want = {"blocks.0.b": "AdamW", "blocks.0.w": "Muon", "blocks.1.b": "AdamW", "blocks.1.w": "Muon", "embed": "AdamW"}
    assert {p: type(leaf.rule).__name__ for p, leaf in state.items()} == want
    assert {p: type(leaf.rule).__name__ for p, leaf in same.items()} == want
    assert state.ties() == {"embed": ("head",)}
    np.testing.assert_array_equal(model["embed"], model["head"])       # still one parameter's value
    assert int(state["blocks.0.w"].state.count) == 50
    out = capsys.readouterr().out
    assert "'blocks.0.w': 'Muon'" in out
    before, after = (float(v) for v in out.strip().splitlines()[-1].split(" -> "))
    np.testing.assert_allclose([before, after], [4.157, 3.085], atol=2e-3)   # what the README prints


def test_recipe_mup_learning_rates():
    import jax
    import jax.numpy as jnp
    import optim

    scope: dict = {}
    exec(_block("base_width"), scope)
    state, same, model = scope["state"], scope["same"], scope["model"]
    want = {"layers.0.w": 1e-2, "layers.1.w": 2.5e-3, "layers.2.w": 2.5e-3,
            "layers.0.b": 1e-2, "layers.1.b": 1e-2, "layers.2.b": 1e-2}
    for s in (state, same):
        assert {p: round(float(leaf.rule.lr), 8) for p, leaf in s.items()} == want
    # The by_path table and the adjusted single rule train the same.
    grads = jax.tree.map(jnp.ones_like, model)
    a, b = optim.update(state, model, grads)[1], optim.update(same, model, grads)[1]
    for k, lr in enumerate((1e-2, 2.5e-3, 2.5e-3)):          # Adam's first step from zeros: -lr * sign(g)
        np.testing.assert_allclose(a["layers"][k]["w"], -lr, rtol=1e-4)
        np.testing.assert_allclose(b["layers"][k]["w"], -lr, rtol=1e-4)

    # The prose after the block: each path has a rule of its own in both forms, so retuning never compiles;
    # singling out part of a shared rule (the biases) after the first step compiles once.
    for s, first in ((state, 1), (same, 1)):
        traces = []
        step = jax.jit(lambda s, m, g: traces.append(1) or optim.update(s, m, g))
        s, m = step(s, model, grads)
        s = optim.adjust(s, "layers.2.w", lr=1e-3)
        s, m = step(s, m, grads)
        assert len(traces) == first
        for p, lr in (("layers.2.w", 5e-4), ("layers.1.w", 2e-3), ("layers.2.w", 1e-4)):
            s = optim.adjust(s, p, lr=lr)
            s, m = step(s, m, grads)
        assert len(traces) == first
        assert round(float(s["layers.1.w"].rule.lr), 8) == 2e-3
        assert round(float(s["layers.2.w"].rule.lr), 8) == 1e-4
        s = optim.adjust(s, "layers.0.b", lr=1e-3)
        s, m = step(s, m, grads)
        assert len(traces) == first + 1


def test_recipe_reduce_on_plateau(monkeypatch, capsys):
    import optim

    traces = []
    update = optim.update
    monkeypatch.setattr(optim, "update", lambda *a, **k: traces.append(1) or update(*a, **k))
    scope: dict = {}
    exec(_block("patience"), scope)
    lr, state, model = scope["lr"], scope["state"], scope["model"]
    assert len(traces) == 1                              # 150 steps and every adjust: one trace of `step`
    halvings = np.log2(0.3 / lr)
    assert halvings >= 1 and abs(halvings - round(halvings)) < 1e-9   # lr = 0.3 * 0.5 ** k, k >= 1
    np.testing.assert_allclose(float(state["w"].rule.lr), lr, rtol=1e-6)
    assert scope["best"] < 1e-4
    np.testing.assert_allclose([float(model["w"]), float(model["b"])], [3.0, 0.5], atol=1e-2)
    assert capsys.readouterr().out.startswith(f"lr {lr:.3g}, best validation loss")


def test_recipe_microbatch():
    import jax

    scope: dict = {}
    exec(_block("optim.microbatch("), scope)
    w = scope["w"]
    full_l, full_g = jax.value_and_grad(scope["loss"])({"emb": w, "head": w}, scope["x"], scope["y"])
    np.testing.assert_allclose(float(scope["l"]), float(full_l), rtol=1e-6)
    assert float(scope["l"]) == 64.0
    for k in ("emb", "head"):
        np.testing.assert_allclose(scope["grads"][k], full_g[k], rtol=1e-6)
    assert scope["model"]["emb"] is scope["model"]["head"]
    np.testing.assert_allclose(scope["model"]["emb"], 1.0 - 1e-3, rtol=1e-5)   # Adam's first step: lr * sign(g)
    assert scope["state"].ties() == {"emb": ("head",)}
