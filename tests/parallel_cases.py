"""Data-parallel and sharded training with optim on 8 simulated CPU devices (run by tests/test_parallel.py).

Run as a script (`python tests/parallel_cases.py OUT.json`): it sets XLA_FLAGS before JAX starts, trains the
same tied model in several parallel styles and on one device, and writes one JSON record per case:
`{"ok": bool, "error": str, ...measurements}`. The pytest side asserts on the records, so a failure in one
style does not hide the others.

Every style is compared with single-device training on the whole batch (rtol 1e-5). The loss is a mean over
the batch, so the mean of the per-shard gradients is the whole-batch gradient.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# With 8 simulated devices on 2 cores, XLA's CPU collectives can starve ("Expected 8 threads ... only 7
# arrived"); more PJRT worker threads avoid it (seen with jaxlib 0.10.2, as in examples/data_parallel.py).
os.environ.setdefault("PJRT_NPROC", str(max(32, os.cpu_count() or 1)))

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optim  # noqa: E402
from sharding_checks import misplaced_state  # noqa: E402   (this script's folder is on sys.path)

N_DEV = 8
STEPS = 6
BATCH = 32          # 4 examples per device
SYNC_EVERY = 2      # block_until_ready every few steps: queued sharded steps can deadlock XLA:CPU collectives
VOCAB, DIM = 16, 8
RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------------------------------- the model
def make_model(seed: int = 0) -> dict:
    """A small model whose embedding is tied to its output projection (one array object in two places)."""
    k = jax.random.split(jax.random.key(seed), 4)
    emb = jax.random.normal(k[0], (VOCAB, DIM)) * 0.5
    return {
        "emb": emb,                                            # token embedding ...
        "mlp": {"w": jax.random.normal(k[1], (DIM, DIM)) * 0.3, "b": jnp.zeros(DIM)},
        "gain": jnp.ones(()),                                  # a scalar: cannot be sharded
        "head": emb,                                           # ... tied to the output projection
    }


def make_rule():
    return optim.OptimiserChain(optim.ClipGlobalNorm(1.0), optim.AdamW(optim.Linear(3e-2, 1e-2, STEPS),
                                                                         weight_decay=1e-2))


def loss_fn(model: dict, batch: dict) -> jax.Array:
    x = jax.nn.one_hot(batch["tok"], VOCAB) @ model["emb"]            # (B, DIM)
    h = jnp.tanh(x @ model["mlp"]["w"] + model["mlp"]["b"]) * model["gain"]
    logits = h @ model["head"].T                                      # (B, VOCAB)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(batch["tgt"], VOCAB), axis=-1))


def batches() -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"tok": rng.integers(0, VOCAB, BATCH).astype(np.int32),
             "tgt": rng.integers(0, VOCAB, BATCH).astype(np.int32)} for _ in range(STEPS)]


def tie_preserving_put(model, shardings):
    """`jax.device_put` per leaf, but one transfer per distinct array, so tied positions stay one object."""
    done: dict = {}
    return jax.tree.map(lambda x, s: done.setdefault(id(x), jax.device_put(x, s)), model, shardings)


def to_host(tree) -> list:
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


# ------------------------------------------------------------------------------------------- reference
def single_device() -> tuple:
    model = make_model()
    state = optim.setup(make_rule(), model)

    @jax.jit
    def step(state, model, batch):
        return optim.update(state, model, jax.grad(loss_fn)(model, batch))

    for i, b in enumerate(batches()):
        state, model = step(state, model, b)
    return jax.block_until_ready((state, model))


def compare(got_state, got_model, ref) -> dict:
    ref_state, ref_model = ref
    worst = 0.0
    for name, a, b in [("model", got_model, ref_model), ("state", got_state, ref_state)]:
        ta, tb = jax.tree.structure(a), jax.tree.structure(b)
        if ta != tb:
            raise AssertionError(f"{name}: tree structure differs: {ta} vs {tb}")
        for x, y in zip(to_host(a), to_host(b)):
            np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL, err_msg=name)
            if x.dtype.kind == "f" and x.size:
                worst = max(worst, float(np.max(np.abs(x - y))))
    tied = bool(np.array_equal(np.asarray(got_model["emb"]), np.asarray(got_model["head"])))
    if not tied:
        raise AssertionError("tied positions emb / head differ after training")
    moved = float(np.max(np.abs(np.asarray(got_model["emb"]) - np.asarray(make_model()["emb"]))))
    if moved < 1e-3:
        raise AssertionError("the parameters hardly moved: the comparison would be vacuous")
    return {"max_abs_diff": worst, "tied": tied, "step": int(np.asarray(got_state.step).reshape(-1)[0])}


# ------------------------------------------------------------------------------------------- 1. pmap
def case_pmap(ref) -> dict:
    model = make_model()
    state = optim.setup(make_rule(), model)          # ties found here, before replication splits identities
    rep = lambda t: jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (N_DEV, *np.shape(a))), t)  # noqa: E731
    pstate, pmodel = rep(state), rep(model)

    def step(state, model, batch):
        grads = jax.lax.pmean(jax.grad(loss_fn)(model, batch), "dev")
        return optim.update(state, model, grads)

    pstep = jax.pmap(step, axis_name="dev")
    for i, b in enumerate(batches()):
        shard = jax.tree.map(lambda a: a.reshape(N_DEV, -1, *a.shape[1:]), b)
        pstate, pmodel = pstep(pstate, pmodel, shard)
        if i % SYNC_EVERY == 0:
            jax.block_until_ready(pmodel)
    # every replica holds the same values
    for a in jax.tree.leaves((pstate, pmodel)):
        a = np.asarray(a)
        assert all(np.array_equal(a[0], a[k]) for k in range(1, N_DEV)), "replicas diverged"
    first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
    out = compare(first(pstate), first(pmodel), ref)
    out["replicas_equal"] = True
    return out


# ------------------------------------------------------------------------------------------- 2. sharded jit
def compiles_of_fresh_state(mesh, **setup) -> int:
    """How many programs a user's jitted step compiles over four steps from a fresh `setup` state (`adjust`ed
    before the last), on a model whose specs have the form a jitted step returns (`P(None, None)` on Explicit
    axes, `P()` on Auto ones; a model in the other form is compiled for twice by JAX itself, optim or not).
    One: the fresh state and the adjusted values are placed as the step returns them."""
    auto = all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    model = make_model()
    model = tie_preserving_put(model, jax.tree.map(
        lambda a: NamedSharding(mesh, P() if auto else P(*[None] * a.ndim)), model))
    state = optim.setup(make_rule(), model, **setup)
    step = jax.jit(lambda s, m, b: optim.update(s, m, jax.grad(loss_fn)(m, b)))
    for i, b in enumerate(batches()[:4]):
        if i == 3:      # a new hyperparameter value is data: no compile either
            state = optim.adjust(state, weight_decay=2e-2)
        state, model = step(state, model, jax.device_put(b, NamedSharding(mesh, P("data"))))
    return step._cache_size()


def case_jit_sharded(ref) -> dict:
    mesh = jax.make_mesh((N_DEV,), ("data",))
    replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    model = make_model()
    model = tie_preserving_put(model, jax.tree.map(lambda _: replicated, model))
    assert model["emb"] is model["head"]
    state = optim.setup(make_rule(), model)
    assert state.ties() == {"emb": ("head",)}

    @jax.jit
    def step(state, model, batch):
        return optim.update(state, model, jax.grad(loss_fn)(model, batch))

    for i, b in enumerate(batches()):
        state, model = step(state, model, jax.device_put(b, by_batch))
        if i % SYNC_EVERY == 0:
            jax.block_until_ready(model)
    out = compare(state, model, ref)
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves((state, model))
               if isinstance(a, jax.Array)), "parameters or state left replicated placement"
    out["replicated"] = True
    out["compiles"] = compiles_of_fresh_state(mesh)
    return out


# ------------------------------------------------------------------------------------------- 3. shard_map
def case_shard_map(ref) -> dict:
    """shard_map with the gradients averaged by an explicit pmean (check_vma=False: per-device gradients)."""

    def step(state, model, batch):
        grads = jax.lax.pmean(jax.grad(loss_fn)(model, batch), "data")
        return optim.update(state, model, grads)

    return _run_shard_map(step, ref, check_vma=False)


def case_shard_map_vma(ref) -> dict:
    """shard_map with JAX's default varying-axes checking: the gradient of a replicated (invariant) parameter
    is already summed over the axis by autodiff, so the loss is averaged over the axis instead of the gradients
    (a pmean of such gradients would leave them 8 times too large)."""

    def step(state, model, batch):
        grads = jax.grad(lambda m: jax.lax.pmean(loss_fn(m, batch), "data"))(model)
        return optim.update(state, model, grads)

    return _run_shard_map(step, ref, check_vma=True)


def _run_shard_map(step, ref, check_vma: bool) -> dict:
    mesh = jax.make_mesh((N_DEV,), ("data",))
    model = make_model()
    state = optim.setup(make_rule(), model)
    sstep = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()),
                                  check_vma=check_vma))
    by_batch = NamedSharding(mesh, P("data"))
    for i, b in enumerate(batches()):
        state, model = sstep(state, model, jax.device_put(b, by_batch))
        if i % SYNC_EVERY == 0:
            jax.block_until_ready(model)
    return compare(state, model, ref)


# ------------------------------------------------------------------------------------------- 4. FSDP / ZeRO
def fsdp_specs(model, mesh):
    """Shard every parameter's first axis over the mesh where it divides; replicate the rest."""
    return jax.tree.map(lambda a: NamedSharding(mesh, P("data") if a.ndim and a.shape[0] % N_DEV == 0 else P()),
                        model)


def case_fsdp(ref) -> dict:
    # Auto axes: XLA inserts the all-gathers of the parameters the forward pass needs (with the default
    # Explicit axes the model code would call jax.sharding.reshard(w, P()) itself).
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    model = make_model()
    model = tie_preserving_put(model, fsdp_specs(model, mesh))
    assert model["emb"] is model["head"]
    state = optim.setup(make_rule(), model)
    setup_bad = misplaced_state(optim, state, model)
    # the step counter is replicated over the mesh, so a restore target built from this state puts it there
    # (one committed to a single device would be refused by a step over the mesh)
    step_spec = (str(state.step.sharding.spec), state.step.sharding.mesh.shape == mesh.shape)
    by_batch = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(state, model, batch):
        return optim.update(state, model, jax.grad(loss_fn)(model, batch))

    # The optimiser step alone on sharded gradients runs shard-local: no all-gather of state or parameters.
    batch0 = jax.device_put(batches()[0], by_batch)
    grads0 = jax.jit(jax.grad(loss_fn))(model, batch0)
    update_hlo = jax.jit(optim.update).lower(state, model, grads0).compile().as_text()
    # In the whole step, the only all-gathers are those of the forward / backward pass itself.
    step_hlo = step.lower(state, model, batch0).compile().as_text()
    grad_hlo = jax.jit(jax.grad(loss_fn)).lower(model, batch0).compile().as_text()
    tree = optim.state_dict(state)
    restored = jax.device_put(jax.device_get(tree), jax.tree.map(lambda a: a.sharding, tree))   # as orbax restores
    jax.jit(optim.update)(optim.load_state_dict(state, restored), model, grads0)
    # Called eagerly (optim's own jit), update keeps the placement too.
    eager_state, eager_model = optim.update(state, model, grads0)
    eager_bad = misplaced_state(optim, eager_state, eager_model)
    assert not eager_bad, f"eager update changed the state's sharding: {eager_bad}"
    assert eager_model["emb"] is eager_model["head"]

    for i, b in enumerate(batches()):
        state, model = step(state, model, jax.device_put(b, by_batch))
        if i % SYNC_EVERY == 0:
            jax.block_until_ready(model)
    out = compare(state, model, ref)
    specs = {p: str(x.sharding.spec) for p, x in optim.trainables(model, path=True)}
    assert specs == {"emb": "P('data',)", "head": "P('data',)", "mlp.b": "P('data',)", "mlp.w": "P('data',)",
                     "gain": "P()"}, specs
    after_bad = misplaced_state(optim, state, model)
    assert not after_bad, f"update changed the state's sharding: {after_bad}"
    out.update(setup_unsharded=setup_bad, step_spec=step_spec, update_all_gathers=update_hlo.count("all-gather"),
               step_all_gathers=step_hlo.count("all-gather"), grad_all_gathers=grad_hlo.count("all-gather"),
               param_specs=specs)
    assert out["update_all_gathers"] == 0, "the compiled update gathers state or parameters"
    assert out["step_all_gathers"] <= out["grad_all_gathers"], "the optimiser part of the step gathers arrays"
    return out


# ------------------------------------------------------------------------------------------- checkpoints
def case_checkpoint_sharded(ref) -> dict:
    """Save FSDP-sharded training state (gathered to host) and load it onto a freshly sharded model: every
    array comes back with its counterpart's sharding, values bit for bit, tie re-linked."""
    import tempfile

    from optim import load, save

    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def sharded():
        model = make_model()
        model = tie_preserving_put(model, fsdp_specs(model, mesh))
        state = optim.setup(make_rule(), model)
        assert not misplaced_state(optim, state, model)
        return state, model

    state, model = sharded()
    by_batch = NamedSharding(mesh, P("data"))
    step = jax.jit(lambda s, m, b: optim.update(s, m, jax.grad(loss_fn)(m, b)))
    for b in batches()[:2]:
        state, model = jax.block_until_ready(step(state, model, jax.device_put(b, by_batch)))
    with tempfile.TemporaryDirectory() as d:
        save(os.path.join(d, "ckpt.npz"), state, model)
        like_state, like_model = sharded()
        new_state, new_model = load(os.path.join(d, "ckpt.npz"), like=(like_state, like_model))
    assert new_model["emb"] is new_model["head"]
    assert int(new_state.step) == 2
    for a, b, c in zip(jax.tree.leaves((new_state, new_model)), jax.tree.leaves((state, model)),
                       jax.tree.leaves((like_state, like_model))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        if isinstance(c, jax.Array):
            assert a.sharding == c.sharding, (a.sharding, c.sharding)
    assert not misplaced_state(optim, new_state, new_model)
    # and training goes on from there exactly as without the round trip
    b = jax.device_put(batches()[2], by_batch)
    cont = jax.block_until_ready(step(new_state, new_model, b))
    want = jax.block_until_ready(step(state, model, b))
    assert all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(cont), jax.tree.leaves(want)))
    return {"tied": True, "step": 6, "max_abs_diff": 0.0}


def main(out_path: str) -> None:
    assert jax.device_count() == N_DEV, jax.devices()
    results = {}
    t0, c0 = time.perf_counter(), time.process_time()
    ref = single_device()
    results["single_device"] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2),
                                "cpu_seconds": round(time.process_time() - c0, 2)}
    run_cases([("pmap", case_pmap), ("jit_sharded", case_jit_sharded), ("shard_map", case_shard_map),
               ("shard_map_vma", case_shard_map_vma),
               ("fsdp", case_fsdp), ("checkpoint_sharded", case_checkpoint_sharded)], ref, results, out_path)


def run_cases(cases: list, ref, results: dict, out_path: str) -> None:
    """Run each `(name, fn)` of `cases` on the single-device reference, recording its result or its error (the
    pytest side asserts on the records, so one failing case does not hide the others), and write the records."""
    for name, fn in cases:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            rec = fn(ref)
            rec["ok"] = True
        except Exception as e:  # recorded, asserted on by the pytest side
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        rec["cpu_seconds"] = round(time.process_time() - c0, 2)
        results[name] = rec
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
