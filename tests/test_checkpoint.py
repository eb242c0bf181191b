"""Checkpoints: what survives save / load, resuming in a new process bit for bit, crash safety, bad files."""

from __future__ import annotations

import io
import functools
import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from optim import load, save

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


# ------------------------------------------------------------------------------------------- a model
def build(seed: int = 0) -> dict:
    """A model with every kind of leaf a checkpoint meets: a tie by identity, a tie through a function
    (`dec` = emb.T), a bfloat16 parameter, a complex one, and non-trainable leaves (int array, Python int,
    string, function). Each call builds new containers around the same (immutable) initial arrays."""
    emb, w0, w1, gate, phase, dec, vocab = _initial(seed)
    return {
        "emb": emb,
        "layers": [{"w": w0, "b": jnp.zeros(4)}, {"w": w1, "b": jnp.zeros(4)}],
        "gate": gate,
        "phase": phase,
        "head": emb,                            # tied by identity
        "dec": dec,                             # tied through jnp.transpose (explicit)
        "vocab": vocab,
        "n_layers": 2,
        "act": "tanh",
        "fn": jnp.tanh,
    }


@functools.cache
def _initial(seed: int) -> tuple:
    k = np.random.default_rng(seed)
    emb = jnp.asarray(k.normal(size=(6, 4)), jnp.float32)
    return (emb, jnp.asarray(k.normal(size=(4, 4)) * 0.5, jnp.float32),
            jnp.asarray(k.normal(size=(4, 4)) * 0.5, jnp.float32),
            jnp.asarray(k.normal(size=4) * 0.1, jnp.bfloat16),
            jnp.asarray(np.exp(1j * k.normal(size=4)), jnp.complex64),
            emb.T, jnp.arange(6, dtype=jnp.int32))


TIES = {"dec": ("emb", jnp.transpose)}
PARAM_KEYS = ("emb", "layers", "gate", "phase", "head", "dec")


def rule_for(path: str, x) -> optim.Rule:
    base = optim.OptimiserChain(optim.ClipGlobalNorm(1.0),
                                optim.AdamW(optim.warmup_cosine(3e-2, 2, 12), weight_decay=1e-2))
    return optim.MixedPrecision(jnp.float32, base) if x.dtype == jnp.bfloat16 else base


def fresh() -> tuple:
    model = build()
    return optim.setup(rule_for, model, ties=TIES), model


def loss(params: dict, model: dict, tok) -> jax.Array:
    m = {**model, **params}
    h = m["emb"][tok]
    for layer in m["layers"]:
        h = m["fn"](h @ layer["w"] + layer["b"])
    h = h * m["gate"].astype(jnp.float32) + jnp.real(m["phase"] * jnp.conj(m["phase"])) * 0.1
    h = h + 0.01 * jnp.abs(jnp.sum(m["phase"]))
    return jnp.mean((h @ m["head"].T) ** 2) + jnp.mean((h @ m["dec"]) ** 2) * 0.5


_grad = jax.jit(jax.grad(lambda params, tok: loss(params, {"fn": jnp.tanh}, tok)))


def grads_of(model: dict, step: int) -> dict:
    tok = np.random.default_rng(step).integers(0, 6, 8)
    g = _grad({k: model[k] for k in PARAM_KEYS}, tok)
    return {**{k: None for k in model if k not in PARAM_KEYS}, **g}


def train(state, model, start: int, stop: int) -> tuple:
    """Steps start..stop-1, with the mid-run changes a checkpoint must carry over."""
    for step in range(start, stop):
        if step == 2:
            state = optim.adjust(state, weight_decay=2e-2)
            state = optim.freeze(state, "layers.1")
        if step == 3:
            state = optim.adjust(state, lr=optim.warmup_cosine(2e-2, 2, 12))     # same kind: data only
        if step == 5:
            state = optim.thaw(state, "layers.1.b")
        state, model = optim.update(state, model, grads_of(model, step))
    return state, model


def arrays(state, model) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves((state, model)) if isinstance(a, (jax.Array, np.ndarray))]


def assert_bitwise(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert x.tobytes() == y.tobytes()


def dump(path, arrays: list) -> None:
    """Arrays as raw bytes plus (dtype, shape): np.savez cannot name bfloat16."""
    np.savez(path, *[np.frombuffer(a.tobytes(), np.uint8) for a in arrays],
             spec=np.frombuffer(json.dumps([(a.dtype.name, a.shape) for a in arrays]).encode(), np.uint8))


def undump(path) -> list:
    with np.load(path, allow_pickle=False) as f:
        spec = json.loads(f["spec"].tobytes())
        return [f[f"arr_{i}"].view(jnp.dtype(d)).reshape(s) for i, (d, s) in enumerate(spec)]


# ------------------------------------------------------------------------------------------- round trip
def test_everything_survives_a_round_trip(tmp_path):
    state, model = train(*fresh(), 0, 4)
    path = tmp_path / "ckpt.npz"
    save(path, state, model)
    new_state, new_model = load(path, like=fresh())

    assert int(new_state.step) == 4
    assert new_state.ties() == state.ties() == {"emb": ("head", "dec")}
    assert [new_state[p].frozen for p in new_state.paths()] == [state[p].frozen for p in state.paths()]
    assert new_state["layers.1.w"].frozen and not new_state["layers.0.w"].frozen
    assert float(new_state["emb"].rule.rules[1].weight_decay) == pytest.approx(2e-2)
    lr = new_state["emb"].rule.rules[1].lr
    assert isinstance(lr, optim.Join)                                          # the schedule itself ...
    assert float(lr.schedules[1].init) == pytest.approx(2e-2)                  # ... with the adjusted peak
    assert float(fresh()[0]["emb"].rule.rules[1].lr.schedules[1].init) == pytest.approx(3e-2)
    assert new_state.layout == state.layout
    assert_bitwise(arrays(new_state, new_model), arrays(state, model))
    # ties re-linked: one array object per tie group; the transformed member restored as saved
    assert new_model["emb"] is new_model["head"]
    assert new_model["dec"].tobytes() == new_model["emb"].T.tobytes()
    assert new_model["gate"].dtype == jnp.bfloat16 and new_model["phase"].dtype == jnp.complex64
    assert new_model["n_layers"] == 2 and new_model["act"] == "tanh" and new_model["fn"] is jnp.tanh
    assert new_model["vocab"].dtype == jnp.int32


def test_like_state_only_returns_state(tmp_path):
    state, model = train(*fresh(), 0, 2)
    save(tmp_path / "s.npz", state)                       # no model
    new = load(tmp_path / "s.npz", like=fresh()[0])
    assert isinstance(new, optim.State)
    assert_bitwise(arrays(new, {}), arrays(state, {}))
    with pytest.raises(ValueError, match="holds none"):
        load(tmp_path / "s.npz", like=fresh())


def test_file_tie_map_relinks_an_untied_fresh_model(tmp_path):
    w = jnp.array([1.0, 2.0, 3.0])
    state = optim.setup(optim.Adam(0.1), {"enc": w, "dec": w})
    state, model = optim.update(state, {"enc": w, "dec": w}, {"enc": jnp.ones(3), "dec": -jnp.ones(3) * 3})
    save(tmp_path / "t.npz", state, model)
    untied = {"enc": jnp.zeros(3), "dec": jnp.zeros(3)}   # e.g. built from an array library that copies
    new_state, new_model = load(tmp_path / "t.npz", like=(optim.setup(optim.Adam(0.1), untied), untied))
    assert new_state.ties() == {"dec": ("enc",)}         # canonical: "dec", first in flatten order (sorted keys)
    assert new_model["enc"] is new_model["dec"]
    s2, m2 = optim.update(new_state, new_model, {"enc": jnp.ones(3), "dec": jnp.ones(3)})
    assert m2["enc"] is m2["dec"]


def test_loaded_state_does_not_retrace_a_jitted_step(tmp_path):
    def make():
        w = jnp.arange(6.0).reshape(2, 3)
        return {"w": w, "tied": w, "b": jnp.zeros(3)}

    traces = []

    @jax.jit
    def step(state, model):
        traces.append(1)
        return optim.update(state, model, jax.tree.map(jnp.ones_like, model))

    state, model = step(*step(optim.setup(optim.Adam(optim.Cosine(0.1, 10)), make()), make()))
    save(tmp_path / "j.npz", state, model)
    model = make()
    loaded, model = load(tmp_path / "j.npz", like=(optim.setup(optim.Adam(optim.Cosine(0.1, 10)), model), model))
    assert loaded.layout == state.layout
    before = len(traces)
    step(loaded, model)
    assert len(traces) == before


def test_sharded_like_places_arrays_like_it(tmp_path):
    state, model = train(*fresh(), 0, 1)
    save(tmp_path / "p.npz", state, model)
    dev = jax.devices()[-1]
    like_state, like_model = fresh()
    like_model = jax.tree.map(lambda a: jax.device_put(a, dev) if isinstance(a, jax.Array) else a, like_model)
    _, new_model = load(tmp_path / "p.npz", like=(like_state, like_model))
    assert new_model["layers"][0]["w"].devices() == {dev}


# ------------------------------------------------------------------------------------------- new process
RESUME = """
import sys, numpy as np, jax
sys.path.insert(0, {here!r})
import test_checkpoint as T
from optim import load
state, model = load({ckpt!r}, like=T.fresh())
assert model["emb"] is model["head"], "tie not re-linked"
state, model = T.train(state, model, {k}, {n})
T.dump({out!r}, T.arrays(state, model))
print("resumed", int(state.step))
"""


def test_resume_in_a_new_process_is_bitwise_identical(tmp_path):
    k, n = 4, 9
    state, model = train(*fresh(), 0, k)
    save(tmp_path / "ckpt.npz", state, model)
    out = tmp_path / "resumed.npz"
    code = RESUME.format(here=str(HERE), ckpt=str(tmp_path / "ckpt.npz"), k=k, n=n, out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed {n}" in proc.stdout
    state, model = train(state, model, k, n)        # the uninterrupted run
    assert_bitwise(undump(out), arrays(state, model))


# ------------------------------------------------------------------------------------------- crash safety
KILLED = """
import sys, time, numpy as np
sys.path.insert(0, {here!r})
import optim
from optim._io import checkpoint as _checkpoint, checkpoint_format as _checkpoint_format
big = {{"w": np.ones((512, 512), np.float32), "v": np.ones((512, 512), np.float32)}}
state = optim.setup(optim.Adam(0.1), big)
emit = _checkpoint_format._emit
count = [0]
def slow_emit(out, a):               # the writer stalls after its first arrays: kill it there
    emit(out, a)
    count[0] += 1
    if count[0] == 3:
        print("WRITING", flush=True)
        time.sleep(60)
_checkpoint_format._emit = slow_emit
_checkpoint.save({ckpt!r}, state, big)
print("finished", flush=True)
"""


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt.npz"
    state, model = train(*fresh(), 0, 3)
    save(ckpt, state, model)
    before = ckpt.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", KILLED.format(here=str(HERE), ckpt=str(ckpt))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the saving process did not start writing"
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", line + proc.stderr.read()
        partial = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert len(partial) == 1 and partial[0].stat().st_size > 0      # mid-write, in the same directory
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert ckpt.read_bytes() == before
    new_state, new_model = load(ckpt, like=fresh())
    assert int(new_state.step) == 3
    assert_bitwise(arrays(new_state, new_model), arrays(state, model))
    with pytest.raises(ValueError, match="not a readable optim checkpoint"):
        load(partial[0], like=optim.setup(optim.Adam(0.1), {"w": np.ones((512, 512), np.float32),
                                                             "v": np.ones((512, 512), np.float32)}))


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path):
    state, model = fresh()
    path = tmp_path / "a.npz"
    save(path, state, model)
    first = path.read_bytes()
    broken = optim.State(state.layout, state.rules, state.stacks, object())     # a step that cannot be stored
    with pytest.raises(TypeError, match="the step counter is a object, which a checkpoint cannot hold"):
        save(path, broken, model)
    assert path.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz"]
    state2, model2 = train(state, model, 0, 1)
    save(path, state2, model2)              # replaces the old file
    assert int(load(path, like=fresh())[0].step) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz"]
    assert (path.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_save_fsyncs_file_and_directory_and_renames(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))),
                                                  real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", os.path.dirname(a) ==
                                                                    os.path.dirname(os.fspath(b)))),
                                                      real_replace(a, b))[1])
    save(tmp_path / "f.npz", *fresh())
    assert calls == [("fsync", False), ("replace", True), ("fsync", True)]


# ------------------------------------------------------------------------------------------- no pickle
def test_no_pickle_anywhere(tmp_path):
    src = "".join((ROOT / "optim" / "_io" / name).read_text() for name in ("checkpoint.py", "checkpoint_format.py"))
    assert not re.search(r"import (c?pickle|dill|marshal|shelve)|allow_pickle=True|\beval\(|\bexec\(", src)
    calls = re.findall(r"np\.load\(([^)]*)\)", src)
    assert calls and all("allow_pickle=False" in c for c in calls)
    # A file carrying a pickled object: loading must refuse it without running it.
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    np.savez(tmp_path / "evil.npz", meta=np.array([Evil()], dtype=object), check=np.zeros(32, np.uint8))
    with pytest.raises(ValueError, match="not a readable optim checkpoint"):
        load(tmp_path / "evil.npz", like=fresh())
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- bad files
@pytest.fixture
def saved(tmp_path):
    state, model = train(*fresh(), 0, 2)
    path = tmp_path / "ckpt.npz"
    save(path, state, model)
    return path


def _rewrite(path, fn):
    """Rewrite one member of the zip (keeping the others) with `fn(name, bytes) -> bytes`."""
    with zipfile.ZipFile(path) as z:
        items = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, data in items:
            z.writestr(name, fn(name, data))


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.98])
def test_truncated_file_raises(saved, keep):
    data = saved.read_bytes()
    saved.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="not a readable optim checkpoint|truncated|corrupted"):
        load(saved, like=fresh())


def test_flipped_byte_in_an_array_raises_naming_it(saved):
    with zipfile.ZipFile(saved) as z:
        meta = json.loads(np.lib.format.read_array(io.BytesIO(z.read("meta.npy"))).tobytes())
    entry = meta["params"][0]["state"][1]                 # emb's second optimiser state array

    def flip(member, data):
        if member == "data.npy":
            f = io.BytesIO(data)
            np.lib.format.read_array_header_2_0(f) if np.lib.format.read_magic(f) == (2, 0) else None
            data = bytearray(data)
            data[f.tell() + entry["offset"] + 5] ^= 0x10
            data = bytes(data)
        return data

    _rewrite(saved, flip)
    with pytest.raises(ValueError, match=r"corrupted: the checksum of optimiser state 1 of 'emb'"):
        load(saved, like=fresh())


def test_corrupted_raw_bytes_raise(saved):
    data = bytearray(saved.read_bytes())
    for k in range(len(data) // 3, len(data) // 3 + 8):
        data[k] ^= 0xFF
    saved.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted|not a readable"):
        load(saved, like=fresh())


def test_edited_description_raises(saved):
    _rewrite(saved, lambda m, d: d.replace(b'"tanh"', b'"relu"') if m == "meta.npy" else d)
    with pytest.raises(ValueError, match="checksum does not match"):
        load(saved, like=fresh())


def test_not_a_checkpoint(tmp_path):
    np.savez(tmp_path / "other.npz", x=np.ones(3))
    with pytest.raises(ValueError, match="no optim description"):
        load(tmp_path / "other.npz", like=fresh())
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(ValueError, match="not a readable optim checkpoint"):
        load(tmp_path / "text.npz", like=fresh())
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load(tmp_path / "missing.npz", like=fresh())
    with pytest.raises(TypeError, match="like="):
        load(tmp_path / "other.npz", like=build())


def _rewrite_meta(path, edit):
    """Edit the JSON description and store a matching checksum (a consistent but foreign description)."""
    import hashlib

    with zipfile.ZipFile(path) as z:
        items = {i.filename: z.read(i.filename) for i in z.infolist()}
    meta = edit(json.loads(np.lib.format.read_array(io.BytesIO(items["meta.npy"])).tobytes()))
    body = json.dumps(meta).encode()
    for name, arr in (("meta.npy", np.frombuffer(body, np.uint8)),
                      ("check.npy", np.frombuffer(hashlib.sha256(body).digest(), np.uint8))):
        buf = io.BytesIO()
        np.lib.format.write_array(buf, arr)
        items[name] = buf.getvalue()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in items.items():
            z.writestr(name, data)


def test_newer_format_version_raises(saved):
    _rewrite_meta(saved, lambda m: {**m, "version": 99})
    with pytest.raises(ValueError, match="format version 99; this optim reads up to 3"):
        load(saved, like=fresh())


def test_foreign_description_raises_cleanly(saved):
    def edit(m):
        m["params"][0]["state"][0]["offset"] = 10 ** 9           # points outside the data
        return m

    _rewrite_meta(saved, edit)
    with pytest.raises(ValueError, match="optimiser state 0 of 'emb' lies outside its data"):
        load(saved, like=fresh())
    _rewrite_meta(saved, lambda m: {**m, "params": "nonsense"})
    with pytest.raises(ValueError, match="malformed description"):
        load(saved, like=fresh())


def _npy_bytes(n: int, body: bytes) -> bytes:
    """A .npy of version 2.0 whose header says `n` bytes (uint8), followed by `body`."""
    f = io.BytesIO()
    np.lib.format.write_array_header_2_0(f, {"descr": "|u1", "fortran_order": False, "shape": (n,)})
    return f.getvalue() + body


def _replace_data(path, data: bytes, compression=zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(path) as z:
        items = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, old in items:
            z.writestr(name, data if name == "data.npy" else old, compress_type=
                       compression if name == "data.npy" else zipfile.ZIP_STORED)


@pytest.fixture
def data_reads(monkeypatch):
    """Bytes that reading from the zip has returned, per member (clear it before the read to watch)."""
    reads: dict = {}
    real = zipfile.ZipExtFile.read

    def read(self, n=-1):
        out = real(self, n)
        reads[self.name] = reads.get(self.name, 0) + len(out)
        return out

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read)
    return reads


def test_compressed_member_is_refused_before_it_is_inflated(saved, data_reads):
    with zipfile.ZipFile(saved) as z:
        size = json.loads(np.lib.format.read_array(io.BytesIO(z.read("meta.npy"))).tobytes())["data_bytes"]
    n = 64 << 20                                                   # a 64 MiB run of zeros: ~64 KiB deflated
    _replace_data(saved, _npy_bytes(n, bytes(n)), zipfile.ZIP_DEFLATED)
    assert saved.stat().st_size < n // 100 and n > 1000 * size
    data_reads.clear()
    with pytest.raises(ValueError, match=r"ckpt.npz is not a readable optim checkpoint: its member data.npy is "
                                         r"compressed \(zip method 8\); optim.save stores members uncompressed"):
        load(saved, like=fresh())
    assert data_reads.get("data.npy", 0) == 0                       # not a byte inflated


def test_compressed_copy_of_a_valid_file_is_refused(saved):
    with zipfile.ZipFile(saved) as z:
        items = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(saved, "w", compression=zipfile.ZIP_DEFLATED) as z:      # same content, deflated
        for name, data in items:
            z.writestr(name, data)
    with pytest.raises(ValueError, match=r"its member meta.npy is compressed"):
        load(saved, like=fresh())


@pytest.mark.parametrize("header, body, message", [
    (1 << 40, 1000, r"its member data.npy is 1128 bytes long in the zip, but its .npy header describes "
                    r"1099511627904"),                               # a header promising 1 TiB (numpy allocates it)
    (4 << 20, 4 << 20, r"its member data.npy holds 4194304 bytes of arrays, its description says \d+ "
                       r"\(truncated or corrupted\)"),               # consistent, but not what the description says
])
def test_member_sizes_are_checked_before_reading(saved, data_reads, header, body, message):
    _replace_data(saved, _npy_bytes(header, bytes(body)))
    data_reads.clear()
    with pytest.raises(ValueError, match=message):
        load(saved, like=fresh())
    assert data_reads.get("data.npy", 0) < 4096                     # its .npy header, nothing of its data


def test_unstorable_leaves_are_refused_before_writing(tmp_path):
    w = np.array([1.0, 2.0])
    model = {"w": w, "junk": np.array([object()], dtype=object)}
    state = optim.setup(optim.Descent(0.1), model)
    with pytest.raises(TypeError, match="model leaf 'junk' has dtype object, which a checkpoint cannot hold"):
        save(tmp_path / "o.npz", state, model)
    assert list(tmp_path.iterdir()) == []


def _like_with(model, rule=rule_for, ties=TIES):
    return optim.setup(rule, model, ties=ties), model


@pytest.mark.parametrize("change, message", [
    (lambda m: {**m, "extra": jnp.ones(2)}, r"another model: the checkpoint lacks 'extra'"),
    (lambda m: {k: v for k, v in m.items() if k != "gate"}, r"another model: like= lacks 'gate'"),
    (lambda m: {**m, "layers": [m["layers"][0], {"w": jnp.ones((4, 4)), "b": jnp.zeros(5)}]},
     r"parameter 'layers.1.b': the checkpoint has float32\[4\], like= has float32\[5\]"),
    (lambda m: {**m, "layers": [m["layers"][0], {"w": jnp.ones((4, 4)), "b": jnp.zeros(4, jnp.float16)}]},
     r"parameter 'layers.1.b': the checkpoint has float32\[4\], like= has float16\[4\]"),
    (lambda m: {**m, "layers": tuple(m["layers"])}, r"structure differs near 'layers.0.b': the checkpoint has a "
                                                    r"node list, like= has tuple"),
])
def test_mismatched_model_raises_naming_the_difference(saved, change, message):
    model = change(build())
    with pytest.raises(ValueError, match=message):
        load(saved, like=_like_with(model))


@pytest.mark.parametrize("vocab, message", [
    (jnp.arange(5, dtype=jnp.int32), r"model leaf 'vocab': the checkpoint has int32\[6\], like= has int32\[5\]"),
    (jnp.arange(6, dtype=jnp.int16), r"model leaf 'vocab': the checkpoint has int32\[6\], like= has int16\[6\]"),
    (np.zeros((6, 1), bool), r"model leaf 'vocab': the checkpoint has int32\[6\], like= has bool\[6, 1\]"),
])
def test_non_trainable_array_of_another_shape_or_dtype_raises(saved, vocab, message):
    with pytest.raises(ValueError, match=r"ckpt.npz does not match like=: " + message):
        load(saved, like=_like_with({**build(), "vocab": vocab}))


def test_step_counter_in_the_model_is_checked(tmp_path):
    model = {"w": jnp.ones(3), "count": jnp.zeros(3, jnp.int32)}
    save(tmp_path / "c.npz", optim.setup(optim.Adam(0.1), model), model)
    for count, message in [(jnp.zeros(4, jnp.int32), r"int32\[3\], like= has int32\[4\]"),
                           (jnp.zeros(3, jnp.uint8), r"int32\[3\], like= has uint8\[3\]")]:
        like = {"w": jnp.ones(3), "count": count}
        with pytest.raises(ValueError, match=r"model leaf 'count': the checkpoint has " + message):
            load(tmp_path / "c.npz", like=(optim.setup(optim.Adam(0.1), like), like))


def test_other_rule_raises(saved):
    model = build()
    with pytest.raises(ValueError, match=r"the rule of 'emb' differs: the checkpoint has OptimiserChain\("
                                         r"ClipGlobalNorm.*like= has Momentum"):
        load(saved, like=_like_with(model, rule=lambda p, x: optim.Momentum(0.1)))
    with pytest.raises(ValueError, match=r"rule of 'emb' differs.*like= has OptimiserChain\(ClipGlobalNorm\(max_norm"
                                         r"=1\), AdamW\(lr=0.001"):       # a number where a schedule was saved
        load(saved, like=_like_with(model, rule=lambda p, x: optim.OptimiserChain(optim.ClipGlobalNorm(1.0),
                                                                                 optim.AdamW(1e-3))))


def test_transformed_tie_must_be_declared_again(saved):
    with pytest.raises(ValueError, match=r"ties 'dec' to transpose\('emb'\); functions are not stored"):
        load(saved, like=_like_with(build(), ties=None))


def test_failed_load_leaves_like_untouched(saved):
    like_state, like_model = fresh()
    before = arrays(like_state, like_model)
    data = saved.read_bytes()
    saved.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"is not a readable optim checkpoint \(truncated or corrupted\?\)"):
        load(saved, like=(like_state, like_model))
    assert_bitwise(arrays(like_state, like_model), before)


def test_save_rejects_a_model_of_another_structure(tmp_path):
    state, model = fresh()
    with pytest.raises(ValueError, match="structure this state was set up for"):
        save(tmp_path / "x.npz", state, {**model, "extra": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_large_save_and_load_is_quick(tmp_path):
    model = {f"l{i}": {"w": jnp.ones((256, 256)), "b": jnp.zeros(256)} for i in range(40)}
    state = optim.setup(optim.Adam(1e-3), model)
    t0 = time.perf_counter()
    save(tmp_path / "big.npz", state, model)
    load(tmp_path / "big.npz", like=(state, model))
    assert time.perf_counter() - t0 < 30     # ~1 s; generous for a loaded machine


def test_readme_checkpoint_block(tmp_path, monkeypatch):
    import types

    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "optim.load(" in b)
    api = optim if hasattr(optim, "load") else types.SimpleNamespace(**vars(optim), save=save, load=load)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    state, model = train(*fresh(), 0, 3)
    scope = {"optim": api, "state": state, "model": model, "rule": rule_for, "ties": TIES, "build_model": build}
    exec(block, scope)
    assert int(scope["state"].step) == 3 and scope["model"]["emb"] is scope["model"]["head"]
    assert_bitwise(arrays(scope["state"], scope["model"]), arrays(state, model))


# ------------------------------------------------------------------------------------------- PRNG keys
def keyed(seed: int) -> dict:
    """A model holding typed PRNG keys (one, an array of them, another implementation) and an old-style one."""
    return {"w": jnp.ones(3), "rng": jax.random.key(seed), "keys": jax.random.split(jax.random.key(seed + 1), 3),
            "rbg": jax.random.key(seed + 2, impl="rbg"), "old": jax.random.PRNGKey(seed + 3)}


def _meta(path) -> dict:
    with zipfile.ZipFile(path) as z:
        return json.loads(np.lib.format.read_array(io.BytesIO(z.read("meta.npy"))).tobytes())


def test_typed_prng_keys_round_trip(tmp_path):
    state = optim.setup(optim.Adam(0.1), keyed(0))
    state, model = optim.update(state, keyed(0), {"w": jnp.ones(3), "rng": None, "keys": None, "rbg": None,
                                                  "old": None})
    save(tmp_path / "k.npz", state, model)
    like = keyed(10)
    _, new = load(tmp_path / "k.npz", like=(optim.setup(optim.Adam(0.1), like), like))
    for name in ("rng", "keys", "rbg"):
        assert new[name].dtype == model[name].dtype and new[name].shape == model[name].shape
        assert jax.random.key_impl(new[name]) == jax.random.key_impl(model[name])
        assert (jax.random.key_data(new[name]) == jax.random.key_data(model[name])).all()
    assert new["rbg"].dtype != new["rng"].dtype and new["keys"].shape == (3,)
    for k, saved_k in [(new["rng"], model["rng"]), (new["keys"][2], model["keys"][2]), (new["rbg"], model["rbg"])]:
        assert jax.random.normal(k, (3,)).tobytes() == jax.random.normal(saved_k, (3,)).tobytes()
    assert new["old"].dtype == jnp.uint32 and new["old"].tobytes() == model["old"].tobytes()
    assert _meta(tmp_path / "k.npz")["version"] == 3          # older optim refuses it, keys and all
    save(tmp_path / "plain.npz", *fresh())
    assert _meta(tmp_path / "plain.npz")["version"] == 3      # and any file now: its Adam powers count steps taken


@pytest.mark.parametrize("change, message", [
    (lambda m: {**m, "keys": jax.random.split(jax.random.key(0), 4)}, r"key<fry>\[3\], like= has key<fry>\[4\]"),
    (lambda m: {**m, "rng": jax.random.key(0, impl="rbg")}, r"key<fry>\[\], like= has key<rbg>\[\]"),
    (lambda m: {**m, "old": jax.random.key(0)}, r"uint32\[2\], like= has key<fry>\[\]"),
    (lambda m: {**m, "rng": jax.random.PRNGKey(0)}, r"key<fry>\[\], like= has uint32\[2\]"),
])
def test_typed_prng_keys_are_checked_against_like(tmp_path, change, message):
    model = keyed(0)
    save(tmp_path / "k.npz", optim.setup(optim.Adam(0.1), model), model)
    like = change(keyed(0))
    with pytest.raises(ValueError, match=r"does not match like=: model leaf '\w+': the checkpoint has " + message):
        load(tmp_path / "k.npz", like=(optim.setup(optim.Adam(0.1), like), like))


def test_prng_key_of_an_unnamed_implementation_is_refused_at_save(tmp_path):
    from jax.extend.random import define_prng_impl

    impl = define_prng_impl(key_shape=(2,), seed=lambda s: jnp.zeros(2, jnp.uint32),
                            split=lambda k, shape: jnp.zeros((*shape, 2), jnp.uint32),
                            random_bits=lambda k, bits, shape: jnp.zeros(shape, jnp.uint32),
                            fold_in=lambda k, d: k, name="mine", tag="mine")
    model = {"w": jnp.ones(3), "sub": {"rng": jax.random.key(0, impl=impl)}}
    with pytest.raises(ValueError, match=r"save: model leaf 'sub.rng' is a PRNG key of implementation 'mine', "
                                         r"which load could not rebuild"):
        save(tmp_path / "m.npz", optim.setup(optim.Adam(0.1), model), model)
    assert list(tmp_path.iterdir()) == []


def test_model_with_colliding_dotted_names_is_refused_by_save(tmp_path):
    model = {"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}}
    state = optim.setup(optim.Adam(), model)
    with pytest.raises(ValueError, match="share the dotted path 'a.b'.*rename a key"):
        optim.save(tmp_path / "c.npz", state, model)
    assert not (tmp_path / "c.npz").exists()


def test_file_written_before_float_hyperparameters_loads():
    """A file written at de3ce20, when `ClipGlobalNorm(1)` and int schedule values were stored as int32: it loads
    onto a like= whose hyperparameters are floats, and the next step gives the numbers the old code gave."""
    path = pathlib.Path(__file__).parent / "data" / "checkpoint_0.1_int_hyperparameters.npz"
    rule = optim.SkipNonFinite(optim.chain(optim.ClipGlobalNorm(1), optim.AdamW(optim.warmup_cosine(1e-2, 2, 10),
                                                                                 weight_decay=0.1)))
    model = {"emb": jnp.zeros((2, 3)), "head": jnp.zeros((2, 3)), "b": jnp.zeros(3), "n": 0}
    state, model = optim.load(path, like=(optim.setup(rule, model), model))
    assert state.ties() == {"emb": ("head",)} and int(state.step) == 3 and model["n"] == 3
    inner = state.rule.rule.rules
    assert inner[0].max_norm.dtype == jnp.float32 and inner[1].lr.schedules[0].start.dtype == jnp.float32
    # written when states were plain tuples: loaded as the named states of today
    emb = state["emb"].state
    assert type(emb).__name__ == "SkipNonFiniteState" and type(emb.inner[1]).__name__ == "AdamState"
    assert emb.inner[1].mu.shape == (2, 3) and emb.inner[1].bt.shape == (2,) and int(emb.skipped) == 0
    # version 1 held the next step's powers (β⁴ after 3 steps); loaded as the products of the steps taken (β³)
    np.testing.assert_allclose(np.asarray(emb.inner[1].bt), [0.9 ** 3, 0.999 ** 3], rtol=1e-6)
    g = {"emb": jnp.ones((2, 3)), "head": jnp.ones((2, 3)), "b": jnp.ones(3), "n": None}
    state, model = optim.update(state, model, g)
    # printed by the old code for the same step (repr of float32 values as Python floats); the powers' conversion
    # (a division by β) rounds them an ulp away, which 1 / (1 - β₂ᵗ) amplifies: 8e-7 relative here
    np.testing.assert_allclose(float(model["emb"][0, 0]), -0.02459985576570034, rtol=2e-6)
    np.testing.assert_allclose(float(model["b"][0]), 0.9729401469230652, rtol=2e-6)


def test_a_number_adjusted_in_over_a_schedule_loads_with_the_run_s_own_rule(tmp_path):
    """The guide: adjusted values survive. A run built with schedules that replaced one with a number
    (`adjust(lr=1e-4)`) loads with like= set up from the run's own rule: the file's number takes the
    schedule's place, the other schedule stays, and the resumed steps equal the uninterrupted run's bitwise. A
    schedule adjusted in over a number needs like= with a schedule there: refused, naming the two rules."""
    rule = optim.chain(optim.ClipGrad(optim.Constant(1.0)), optim.Adam(optim.Cosine(1e-2, 100)))
    model = {"w": jnp.linspace(-1.0, 1.0, 6), "b": jnp.ones(2)}
    grads = lambda m, t: jax.tree.map(lambda a: jnp.sin(a * (t + 1.0)), m)   # noqa: E731
    state = optim.setup(rule, model)
    state, model = optim.update(state, model, grads(model, 0))
    state = optim.adjust(state, "w", lr=1e-4)
    optim.save(tmp_path / "ck.npz", state, model)

    like = optim.setup(rule, jax.tree.map(jnp.zeros_like, model))
    got, got_model = optim.load(tmp_path / "ck.npz", like=(like, jax.tree.map(jnp.zeros_like, model)))
    assert got["w"].rule.rules[1].lr == pytest.approx(1e-4) and got["w"].rule.rules[0].delta == optim.Constant(1.0)
    assert got["b"].rule.rules[1].lr == optim.Cosine(1e-2, 100)
    for t in (1, 2):
        state, model = optim.update(state, model, grads(model, t))
        got, got_model = optim.update(got, got_model, grads(got_model, t))
    for a, b in zip(jax.tree.leaves((state, model)), jax.tree.leaves((got, got_model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    plain = optim.setup(optim.Adam(1e-2), model)
    optim.save(tmp_path / "sched.npz", optim.adjust(plain, lr=optim.Cosine(1e-2, 10)))
    with pytest.raises(ValueError, match=r"the rule of 'b' differs: the checkpoint has Adam\(lr=Cosine"):
        optim.load(tmp_path / "sched.npz", like=plain)
