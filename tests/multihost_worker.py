"""One process of a 2-process JAX job on this machine (run by tests/test_multihost.py, one copy per process).

Run as a script: `python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT CKPT_DIR OUT.json`. It sets
XLA_FLAGS (4 simulated CPU devices) and JAX_PLATFORMS before JAX starts, selects gloo for the cross-process CPU
collectives, joins the job (`jax.distributed.initialize`, coordinator 127.0.0.1:PORT) and, on the global 8-device
mesh:

1. places the tied model (emb is head: one array object in two places) FSDP-sharded, one placement per distinct
   array, and calls `optim.setup` (the state is placed like the parameters);
2. trains 6 steps uninterrupted (the reference); each process feeds its half of every batch;
3. from a fresh setup, trains 3 steps, saves `{"model": ..., "opt": optim.state_dict(state)}` with orbax (every
   process calls save: each writes its own shards), restores onto an abstract target built from another fresh
   setup (`jax.eval_shape`, with the fresh arrays' shardings), re-links the tie with `optim.retie`, and trains
   3 more steps.

It writes one JSON record: the losses of both runs as `float.hex` (bitwise), SHA-256 checksums of the final
parameters and optimiser state gathered to host (`process_allgather`), and the checks made in the process
(`checks`: name -> bool). The pytest side compares the two processes' records and asserts on the checks.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":      # only when run as a script: pytest's doctest collection imports this module too
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    # as tests/parallel_cases.py: more PJRT worker threads, so XLA:CPU collectives do not starve on 2 cores
    os.environ.setdefault("PJRT_NPROC", "16")

import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sharding_checks import misplaced_state  # noqa: E402   (this script's folder is on sys.path)

LOCAL_DEVICES = 4
VOCAB, DIM = 16, 8
BATCH = 32                 # 4 examples per device, 16 per process
STEPS, SPLIT = 6, 3        # the resumed run: SPLIT steps, save, restore, STEPS - SPLIT steps


# ------------------------------------------------------------------------------------------- the model
def make_model(seed: int = 0) -> dict:
    """As tests/parallel_cases.make_model: the embedding is tied to the output projection (one array object)."""
    k = jax.random.split(jax.random.key(seed), 4)
    emb = np.asarray(jax.random.normal(k[0], (VOCAB, DIM)) * 0.5)
    return {"emb": emb,
            "mlp": {"w": np.asarray(jax.random.normal(k[1], (DIM, DIM)) * 0.3), "b": np.zeros(DIM, np.float32)},
            "gain": np.ones((), np.float32),                   # a scalar: replicated
            "head": emb}


def make_rule(optim):
    return optim.OptimiserChain(optim.ClipGlobalNorm(1.0),
                                optim.AdamW(optim.Linear(3e-2, 1e-2, STEPS), weight_decay=1e-2))


def loss_fn(model: dict, batch: dict) -> jax.Array:
    x = jax.nn.one_hot(batch["tok"], VOCAB) @ model["emb"]
    h = jnp.tanh(x @ model["mlp"]["w"] + model["mlp"]["b"]) * model["gain"]
    logp = jax.nn.log_softmax(h @ model["head"].T)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(batch["tgt"], VOCAB), axis=-1))


def global_batches() -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"tok": rng.integers(0, VOCAB, BATCH).astype(np.int32),
             "tgt": rng.integers(0, VOCAB, BATCH).astype(np.int32)} for _ in range(STEPS)]


def spec(x) -> P:
    """FSDP: the first axis sharded over all 8 devices where it divides; the rest replicated."""
    return P("data") if np.ndim(x) and np.shape(x)[0] % jax.device_count() == 0 else P()


def place(model: dict, mesh) -> dict:
    """Global arrays built from the host value every process holds (`make_array_from_callback`: each process
    fills its own devices' shards), one placement per distinct array, so tied positions stay one object."""
    done: dict = {}

    def put(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec(host)), lambda idx: host[idx])

    return jax.tree.map(lambda x: done[id(x)] if id(x) in done else done.setdefault(id(x), put(x)), model)


# ------------------------------------------------------------------------------------------- host views
def gather(tree) -> list[np.ndarray]:
    """Every leaf's global value on this host. `process_allgather` for arrays that span both processes (numpy
    and fully addressable arrays are the same on every process here, and process_allgather would stack them)."""
    from jax.experimental import multihost_utils

    out = []
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            out.append(np.asarray(multihost_utils.process_allgather(a, tiled=True)))
        else:
            out.append(np.asarray(a))
    return out


def digest(tree) -> str:
    h = hashlib.sha256()
    for a in gather(tree):
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def bitwise_equal(a, b) -> bool:
    la, lb = gather(a), gather(b)
    return (jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
            and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(la, lb)))


# ------------------------------------------------------------------------------------------- the job
def main(process_id: int, num_processes: int, port: int, ckpt_dir: str, out_path: str) -> None:
    t_start = time.perf_counter()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=60)
    import orbax.checkpoint as ocp

    import optim

    assert jax.process_index() == process_id and jax.process_count() == num_processes
    assert jax.local_device_count() == LOCAL_DEVICES, jax.local_devices()
    assert jax.device_count() == LOCAL_DEVICES * num_processes, jax.devices()
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    by_batch = NamedSharding(mesh, P("data"))
    rows = BATCH // num_processes
    batches = global_batches()
    checks: dict[str, bool] = {}
    info: dict = {}

    def local_batch(i: int):
        """This process's rows of batch i, assembled into the global batch sharded over the data axis."""
        local = {k: v[process_id * rows:(process_id + 1) * rows] for k, v in batches[i].items()}
        return jax.tree.map(lambda v: jax.make_array_from_process_local_data(by_batch, v), local)

    traces: list = []

    @jax.jit
    def step(state, model, batch):
        traces.append(1)                          # once per compilation
        loss, grads = jax.value_and_grad(loss_fn)(model, batch)
        state, model = optim.update(state, model, grads)
        return state, model, loss

    def run(state, model, steps) -> tuple:
        losses = []
        for i in steps:
            state, model, loss = step(state, model, local_batch(i))
            jax.block_until_ready(model)          # as tests/parallel_cases.py: no deep queue of collectives
            losses.append(float(loss).hex())       # a replicated scalar: readable on every process
        return state, model, losses

    def fresh(seed: int = 0):
        model = place(make_model(seed), mesh)
        return optim.setup(make_rule(optim), model), model

    # 1. setup on the sharded, tied model
    state, model = fresh()
    checks["tied_after_place"] = model["emb"] is model["head"]
    checks["ties_found"] = state.ties() == {"emb": ("head",)}
    bad = misplaced_state(optim, state, model)
    info["setup_unsharded"] = bad
    checks["setup_places_state_like_params"] = not bad
    info["param_specs"] = {p: str(x.sharding.spec) for p, x in optim.trainables(model, path=True)}
    checks["emb_spans_both_processes"] = (not model["emb"].is_fully_addressable
                                          and len(model["emb"].sharding.device_set) == jax.device_count())

    # 2. the uninterrupted run
    t0 = time.perf_counter()
    s_ref, m_ref, losses_ref = run(state, model, range(STEPS))
    info["seconds_uninterrupted"] = round(time.perf_counter() - t0, 2)
    info["compilations_uninterrupted"] = len(traces)
    checks["state_sharding_kept"] = not misplaced_state(optim, s_ref, m_ref)
    initial = gather(place(make_model(), mesh)["emb"])[0]
    info["emb_moved"] = float(np.max(np.abs(gather(m_ref["emb"])[0] - initial)))
    checks["params_moved"] = info["emb_moved"] > 1e-3

    # the same training on one local device, on the whole batch (not bitwise: other reduction orders)
    ref_model = jax.tree.map(jnp.asarray, make_model())
    ref_model["head"] = ref_model["emb"]
    ref_state = optim.setup(make_rule(optim), ref_model)
    ref_losses = []
    for b in batches:
        ref_state, ref_model, loss = step(ref_state, ref_model, b)
        ref_losses.append(float(loss))
    info["single_device_max_abs_diff"] = max(float(np.max(np.abs(a - np.asarray(b))))
                                             for a, b in zip(gather(m_ref), jax.tree.leaves(ref_model)))
    info["single_device_loss_diff"] = max(abs(float.fromhex(a) - b) for a, b in zip(losses_ref, ref_losses))
    checks["matches_single_device"] = (info["single_device_max_abs_diff"] < 1e-4
                                       and info["single_device_loss_diff"] < 1e-4)
    traces.clear()

    # 3. 3 steps, save, restore onto a fresh setup, 3 steps
    t0 = time.perf_counter()
    state, model = fresh()
    state, model, losses_a = run(state, model, range(SPLIT))
    saved_opt = optim.state_dict(state)
    ckpt = os.path.join(ckpt_dir, "ckpt")
    with ocp.StandardCheckpointer() as ckptr:         # every process saves (its shards); leaving waits
        ckptr.save(ckpt, {"model": model, "opt": saved_opt})
    info["seconds_save"] = round(time.perf_counter() - t0, 2)

    like, fresh_model = fresh(seed=7)                  # other values: the restore must overwrite all of them
    abstract = jax.eval_shape(lambda s, m: {"model": m, "opt": optim.state_dict(s)}, like, fresh_model)
    concrete = {"model": fresh_model, "opt": optim.state_dict(like)}
    # The restore target: the fresh arrays' shardings. `setup` replicates the step counter over the parameters'
    # mesh, so no leaf is left on one device (restored there, it would be committed to it, and a step over the
    # global mesh would refuse it).
    info["target_single_device"] = [jax.tree_util.keystr(k) for k, c in jax.tree_util.tree_leaves_with_path(concrete)
                                    if len(c.sharding.device_set) == 1]
    checks["no_single_device_leaf_in_target"] = not info["target_single_device"]
    target = jax.tree.map(lambda a, c: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=c.sharding), abstract, concrete)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(ckpt, target)
    checks["restored_shardings_are_the_targets"] = all(
        a.sharding == t.sharding for a, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)))
    checks["restore_stores_tied_positions_apart"] = restored["model"]["emb"] is not restored["model"]["head"]
    new_state = optim.load_state_dict(like, restored["opt"])
    new_model = optim.retie(new_state, restored["model"])
    checks["tie_relinked"] = new_model["emb"] is new_model["head"]
    checks["ties_kept"] = new_state.ties() == {"emb": ("head",)}
    checks["opt_state_restored_bitwise"] = bitwise_equal(optim.state_dict(new_state), saved_opt)
    opt_restored = digest(optim.state_dict(new_state))
    checks["model_restored_bitwise"] = bitwise_equal(new_model, model)
    checks["step_restored"] = int(new_state.step) == SPLIT
    bad = misplaced_state(optim, new_state, new_model)
    info["restored_unsharded"] = bad
    checks["restored_state_placed_like_params"] = not bad
    checks["restored_state_placed_like_fresh"] = all(
        a.sharding.is_equivalent_to(b.sharding, a.ndim)
        for a, b in zip(jax.tree.leaves(new_state.stacks), jax.tree.leaves(like.stacks))
        if isinstance(a, jax.Array) and isinstance(b, jax.Array))
    new_state, new_model, losses_b = run(new_state, new_model, range(SPLIT, STEPS))
    info["seconds_resumed"] = round(time.perf_counter() - t0, 2)
    # Not asserted: jit keys its cache on whether inputs are committed, so a fresh setup (uncommitted scalar
    # hyperparameters and step) and a jitted step's outputs (replicated over the mesh) compile separately.
    info["compilations"] = len(traces)

    checks["resumed_losses_bitwise"] = losses_a + losses_b == losses_ref
    checks["resumed_params_bitwise"] = bitwise_equal(new_model, m_ref)
    checks["resumed_opt_state_bitwise"] = bitwise_equal(optim.state_dict(new_state), optim.state_dict(s_ref))
    checks["resumed_tie_kept_values"] = bitwise_equal(new_model["emb"], new_model["head"])   # separate buffers

    record = {
        "process_id": process_id, "process_count": jax.process_count(), "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "collectives": jax.config.jax_cpu_collectives_implementation,
        "losses_uninterrupted": losses_ref, "losses_resumed": losses_a + losses_b,
        "params_uninterrupted": digest(m_ref), "params_resumed": digest(new_model),
        "opt_uninterrupted": digest(optim.state_dict(s_ref)), "opt_resumed": digest(optim.state_dict(new_state)),
        "opt_saved": digest(saved_opt), "opt_restored": opt_restored,
        "checks": checks, "info": info, "seconds": round(time.perf_counter() - t_start, 2),
    }
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
