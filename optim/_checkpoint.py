"""Checkpoints that keep ties: `save(path, state, model=None)` and `load(path, like=...)`.

A checkpoint is one `.npz`-style zip file of three `.npy` members, read back with `np.load(allow_pickle=False)`:
a JSON description (`meta`, UTF-8 bytes), its SHA-256 (`check`) and every array's bytes in one blob (`data`,
64-byte aligned, at offsets the description gives; one member instead of one per array keeps a model with
tens of thousands of leaves fast to write and read). Nothing in it is code and nothing is unpickled, so loading
a file never runs anything from it; classes (the model's node types, the rules) come from `like`, which the
caller builds with their own code, and the file must describe exactly the same structure. Members are stored
uncompressed, and `load` checks every member's size against its `.npy` header and the description before
reading it, so a crafted file cannot make it inflate or allocate more than the file holds.

What the file holds: every leaf path of the model, the tie groups (canonical path and members, transformed
members with the function's name), the frozen flags, each rule's hyperparameters (schedules included: they
are pytrees of numbers), the step counter, every optimiser state array, and, when `model` is given, the model's
arrays (each tie group once) and plain Python leaves (numbers, strings). A typed PRNG key (`jax.random.key`)
is stored as its key data plus its implementation's name (`"key"` in its entry); such a file has format
version 2, so that an older optim, which would take the data for plain integers, refuses it. A SHA-256 of
every array and of the description detects corruption; `load` checks everything against `like` before it
builds anything, so a bad or mismatched file raises a `ValueError` that names what differs and nothing is
half-loaded.

`save` writes a temporary file in the same directory, flushes and fsyncs it, renames it over `path`
(`os.replace`, atomic on POSIX and Windows) and fsyncs the directory: a crash at any moment leaves either the
previous checkpoint or the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._state import Layout, Param, PathError, State, unwrap
from ._tree import PyTree, flatten, show, structure_diff

__all__ = ["save", "load"]

FORMAT = "optim-checkpoint"
VERSION = 2        # 1: no typed PRNG keys; 2: entries may carry "key" (written only when the file holds keys)


# ----------------------------------------------------------------------------------------------- save
def save(path: str | os.PathLike, state: State, model: PyTree | None = None) -> None:
    """Write `state` (and `model`, if given) to `path`, atomically.

    The file records the tie map, frozen flags, hyperparameters (schedules included), the step counter and
    every optimiser state array; with `model`, also the model's arrays (each tie group stored once) and its
    plain Python leaves (numbers, strings). Other leaves (functions, ...) are not stored: `load` takes them
    from its `like=` model. Arrays must be addressable from this process (on several hosts, gather first or
    save one file per process).

    The write goes to a temporary file in the same directory, which is fsynced and renamed over `path`; a
    crash mid-write leaves the previous checkpoint intact.

    >>> import jax.numpy as jnp, optim, tempfile, os
    >>> from optim._checkpoint import save, load
    >>> w = jnp.ones(3)
    >>> model = {"emb": w, "head": w}
    >>> state = optim.setup(optim.Adam(0.1), model)
    >>> state, model = optim.update(state, model, {"emb": jnp.ones(3), "head": jnp.ones(3)})
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
    >>> save(path, state, model)
    >>> fresh = {"emb": jnp.zeros(3), "head": jnp.zeros(3)}      # untied: the file's tie map wins
    >>> state2, model2 = load(path, like=(optim.setup(optim.Adam(0.1), fresh), fresh))
    >>> int(state2.step), model2["emb"] is model2["head"], state2.ties()
    (1, True, {'emb': ('head',)})
    """
    if not isinstance(state, State):
        raise TypeError(f"save: expected the State from optim.setup, got {type(state).__name__}")
    lay = state.layout
    if lay.ambiguous:   # the file names leaves by dotted path
        raise ValueError(f"save: several leaves of this model share the dotted path "
                         f"{sorted(lay.ambiguous)[0]!r}, and checkpoints name leaves by dotted path; rename a key")
    paths = list(lay.paths)
    writer = _Writer()
    meta: dict[str, Any] = {"format": FORMAT, "version": 1, "paths": paths,       # version: set below
                            "structure": _signature(lay.treedef)}

    rules = []
    for k, rule in enumerate(state.rules):
        leaves, treedef = jax.tree_util.tree_flatten(rule)
        rules.append({"repr": _clean(repr(unwrap(rule))), "structure": _signature(treedef),
                      "leaves": [writer.leaf(v, f"hyperparameter {j} of rule {k}") for j, v in enumerate(leaves)]})
    meta["rules"] = rules

    params = []
    per_param = _param_states(state)
    for u, p in enumerate(lay.params):
        where = show(paths[p.canonical])
        leaves, treedef = jax.tree_util.tree_flatten(per_param[u])
        params.append({
            "canonical": paths[p.canonical], "members": [paths[i] for i in p.members],
            "transforms": [[paths[t[0]], _fname(t[1]), list(t[2]), jnp.dtype(t[3]).name] for t in p.transforms],
            "shape": list(p.shape), "dtype": jnp.dtype(p.dtype).name, "rule": p.rule, "frozen": lay.frozen[u],
            "state_structure": _signature(treedef),
            "state": [writer.leaf(v, f"optimiser state {j} of {where}") for j, v in enumerate(leaves)]})
    meta["params"] = params
    meta["step"] = writer.leaf(state.step, "the step counter")

    if model is not None:
        leaves, treedef = jax.tree_util.tree_flatten(model)
        if treedef != lay.treedef:
            raise ValueError("save: the model does not have the structure this state was set up for: "
                             + structure_diff(paths, flatten(model)[0]))
        entries: list = [None] * len(leaves)
        for p in lay.params:        # each tie group once: its members point at the canonical array
            entry = writer.leaf(leaves[p.canonical], f"model leaf {show(paths[p.canonical])}")
            for i in p.members:
                entries[i] = entry
        for i, x in enumerate(leaves):
            if entries[i] is None:
                entries[i] = writer.leaf(x, f"model leaf {show(paths[i])}", optional=True)
        meta["model"] = entries
    else:
        meta["model"] = None

    meta["version"] = VERSION if writer.keys else 1      # files without keys stay readable by older optim
    meta["data_bytes"] = size = writer.fetch()
    body = json.dumps(meta, separators=(",", ":")).encode()
    _write_atomic(os.fspath(path), body, writer.arrays, writer.entries, size)


def _param_states(state: State) -> list:
    """One optimiser state per parameter. The file stores them per parameter (not per stacking group), so it
    does not depend on how a version of optim groups parameters. Stacks are fetched to the host once and sliced
    there, when this process can see all of them."""
    stacks = state.stacks
    if all(not isinstance(a, jax.Array) or (a.is_fully_addressable and not isinstance(a, jax.core.Tracer))
           for a in jax.tree.leaves(stacks)):
        stacks = jax.device_get(stacks)
    return State(state.layout, state.rules, stacks, state.step).param_states()


class _Writer:
    """Collects a checkpoint's arrays (named `a0, a1, ...` in the description); a JSON entry describes every
    leaf: an array's name, dtype, shape, place in the data blob and SHA-256 (for typed PRNG keys: of their key
    data, plus `"key"`: the implementation's name), or a Python value."""

    def __init__(self):
        self.arrays: list = []
        self.entries: list[dict] = []
        self.keys = False

    def leaf(self, v: Any, what: str, optional: bool = False) -> dict:
        if isinstance(v, (jax.Array, np.ndarray, np.generic)):
            if isinstance(v, jax.core.Tracer):
                raise TypeError(f"save: {what} is a tracer; call save outside jit / pmap")
            if isinstance(v, jax.Array) and not v.is_fully_addressable:
                raise ValueError(f"save: {what} is not fully addressable from this process (several hosts): "
                                 "gather it first (jax.experimental.multihost_utils.process_allgather) or "
                                 "save one file per process")
            key = None
            if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
                key = str(jax.random.key_impl(v))
                data = jax.eval_shape(jax.random.key_data, v)
                if _key_type(key, data.shape, data.dtype) != (v.shape, str(v.dtype)):
                    raise ValueError(f"save: {what} is a PRNG key of implementation {key!r}, which load could not "
                                     "rebuild (jax.random.wrap_key_data takes only JAX's named implementations)")
                v, self.keys = jax.random.key_data(v), True
            name = _name(v.dtype)
            try:
                _dtype(name, what)
            except TypeError:
                raise TypeError(f"save: {what} has dtype {name}, which a checkpoint cannot hold") from None
            entry = {"array": f"a{len(self.arrays)}", "dtype": name, "shape": list(np.shape(v))}
            if key is not None:
                entry["key"] = key
            self.arrays.append(v)
            self.entries.append(entry)
            return entry
        if isinstance(v, bool):
            return {"py": "bool", "value": v}
        if isinstance(v, int):
            return {"py": "int", "value": v}
        if isinstance(v, float):
            return {"py": "float", "value": v}
        if isinstance(v, complex):
            return {"py": "complex", "value": [v.real, v.imag]}
        if isinstance(v, str):
            return {"py": "str", "value": v}
        if optional:        # functions, custom objects: the caller's `like` model supplies them on load
            return {"py": "skip", "type": type(v).__qualname__}
        raise TypeError(f"save: {what} is a {type(v).__name__}, which a checkpoint cannot hold "
                        "(only arrays, numbers and strings)")

    def fetch(self) -> int:
        """Bring every array to the host (one batched transfer), lay them out in one blob, 64-byte aligned;
        returns the blob's size."""
        host = jax.device_get(self.arrays)
        self.arrays = [np.asarray(a, order="C") for a in host]
        offset = 0
        for entry, a in zip(self.entries, self.arrays):
            offset = -(-offset // _ALIGN) * _ALIGN
            entry.update(offset=offset, nbytes=int(a.nbytes), sha256=_digest(a))
            offset += a.nbytes
        return offset


_ALIGN = 64


def _write_atomic(path: str, meta: bytes, arrays: list, entries: list, size: int) -> None:
    """Write the checkpoint to a temporary file next to `path`, fsync it, rename it over `path`, fsync the
    directory. The zip holds three .npy members: `meta` (the JSON), `check` (its SHA-256) and `data` (every
    array's bytes, at the offsets the JSON gives), streamed without copying the arrays into one buffer."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name, arr in (("meta", np.frombuffer(meta, np.uint8)),
                                  ("check", np.frombuffer(hashlib.sha256(meta).digest(), np.uint8))):
                    with zf.open(name + ".npy", "w") as out:
                        np.lib.format.write_array(out, arr, allow_pickle=False)
                with zf.open("data.npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array_header_2_0(
                        out, {"descr": "|u1", "fortran_order": False, "shape": (size,)})
                    written = 0
                    for entry, a in zip(entries, arrays):
                        out.write(bytes(entry["offset"] - written))          # alignment padding
                        _emit(out, a)
                        written = entry["offset"] + entry["nbytes"]
                    out.write(bytes(size - written))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _emit(out: Any, a: np.ndarray) -> None:
    """Write one array's bytes to the zip stream (a separate function so tests can interrupt a save)."""
    out.write(a.reshape(-1).view(np.uint8).data)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:      # e.g. Windows, where directories cannot be opened (and renames are durable)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


# ----------------------------------------------------------------------------------------------- load
def load(path: str | os.PathLike, like: Any) -> Any:
    """Read a checkpoint written by `save`, onto the structure given by `like`.

    `like` is what your code builds before training starts:

    - `like=state` (a `State` from `optim.setup(rule, fresh_model)`): returns the saved `State`;
    - `like=(state, model)`: returns `(state, model)`, the saved model's arrays in `model`'s structure, with
      every tie group's positions holding one array object (ties are re-linked even if `model` has none).

    From `like` come only what a file cannot hold without running code: the classes of the model's nodes and
    of the rules, and functions (of transformed ties, and of model leaves that are not arrays, numbers or
    strings). Everything else comes from the file: the tie map, frozen flags, hyperparameters (schedules
    included), the step counter, the optimiser state and the model's arrays. Each array is placed like its
    counterpart in `like` (its sharding, for sharded training).

    Raises `ValueError` naming what differs when the file is truncated or corrupted, or when it was saved from
    another model (other leaf paths, node types, shapes, dtypes) or another rule; nothing is half-loaded.
    """
    like_state, like_model = _split_like(like)
    path = os.fspath(path)
    meta, read = _open(path)
    try:
        return _restore(path, meta, read, like_state, like_model)
    finally:
        read.close()


def _split_like(like: Any) -> tuple[State, Any]:
    if isinstance(like, State):
        return like, _NO_MODEL
    if isinstance(like, (tuple, list)) and len(like) == 2 and isinstance(like[0], State):
        state, model = like
        if jax.tree.structure(model) != state.layout.treedef:
            raise ValueError("load: like=(state, model): the model does not have the structure the state was "
                             "set up for: " + structure_diff(list(state.layout.paths), flatten(model)[0]))
        return state, model
    raise TypeError("load: like= takes the State from optim.setup on a freshly built model, or (state, model); "
                    f"got {type(like).__name__}")


_NO_MODEL = object()


def _open(path: str) -> tuple[dict, Any]:
    """Open the file and check its description's checksum; the arrays are read (and checked) later."""
    try:
        npz = np.load(path, allow_pickle=False)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as e:
        raise ValueError(f"load: {path} is not a readable optim checkpoint (truncated or corrupted?): "
                         f"{type(e).__name__}: {e}") from None
    try:
        if not isinstance(npz, np.lib.npyio.NpzFile) or "meta" not in npz.files or "check" not in npz.files:
            raise ValueError("it has no optim description (meta.npy)")
        _stored_size(npz, "meta")
        _stored_size(npz, "check")
        body = npz["meta"].tobytes()
        if hashlib.sha256(body).digest() != npz["check"].tobytes():
            raise ValueError("the description's checksum does not match (corrupted)")
        meta = json.loads(body.decode())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError("it is not an optim checkpoint")
        if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
            raise ValueError(f"it has format version {meta.get('version')!r}; this optim reads up to {VERSION}")
        if "data" not in npz.files:
            raise ValueError("it has no data member (data.npy)")
        size = _stored_size(npz, "data")
        if size != meta.get("data_bytes"):
            raise ValueError(f"its member data.npy holds {size} bytes of arrays, its description says "
                             f"{meta.get('data_bytes')!r} (truncated or corrupted)")
    except Exception as e:
        if hasattr(npz, "close"):
            npz.close()
        msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"load: {path} is not a readable optim checkpoint: {msg}") from None
    return meta, npz


def _stored_size(npz: Any, name: str) -> int:
    """The length of member `name` (a .npy of bytes), checked against the zip's sizes before any of its data is
    read. `save` stores members uncompressed: a compressed one could inflate far beyond the file (a zip bomb),
    and numpy allocates what a .npy header says before reading, so both must agree with the zip's sizes."""
    info = npz.zip.getinfo(name + ".npy")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"its member {info.filename} is compressed (zip method {info.compress_type}); optim.save "
                         "stores members uncompressed, and load does not inflate them")
    with npz.zip.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"its member {info.filename} has .npy format version {version}")
        fmt = np.lib.format
        shape, _, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(f)
        header = f.tell()
    if dtype != np.uint8 or len(shape) != 1:
        raise ValueError(f"its member {info.filename} holds {dtype}{list(shape)}, not bytes")
    if info.file_size != header + shape[0] or info.compress_size != info.file_size:
        raise ValueError(f"its member {info.filename} is {info.file_size} bytes long in the zip, but its .npy "
                         f"header describes {header + shape[0]}")
    return shape[0]


class _Mismatch(ValueError):
    pass


def _restore(path: str, meta: dict, npz: Any, like: State, like_model: Any) -> Any:
    try:
        plan = _match(meta, like, like_model)
    except _Mismatch as e:
        raise ValueError(f"load: {path} does not match like=: {e}") from None
    except (KeyError, TypeError, IndexError, AttributeError) as e:     # a description that is not ours
        raise ValueError(f"load: {path} has a malformed description ({type(e).__name__}: {e})") from None
    arrays = _read_arrays(path, meta, npz, plan.expect)
    return plan.build(arrays)


class _Plan:
    """Everything `load` builds, checked against `like` before any array is read."""

    def __init__(self):
        # array name -> (what, shape, dtype, PRNG key implementation or None)
        self.expect: dict[str, tuple[str, tuple, Any, str | None]] = {}

    def want(self, entry: dict, what: str, shape: tuple | None = None, dtype: Any = None) -> None:
        """Read `entry`'s array; if `shape` is given, it must have that shape and dtype (keys: of the keys)."""
        if not isinstance(entry, dict):
            raise TypeError(f"{what}: entry is not an object")
        if "array" not in entry:
            raise _Mismatch(f"{what}: the checkpoint has a Python {entry.get('py')}, like= has an array")
        got_shape, got_dtype = tuple(entry["shape"]), entry["dtype"]
        key = entry.get("key")
        if key is not None:      # typed PRNG keys: compare the keys' shape and dtype, not their data's
            if not isinstance(key, str):
                raise TypeError(f"{what}: key implementation {key!r} is not a name")
            keys = _key_type(key, got_shape, _dtype(got_dtype, what))
            if keys is None:
                raise _Mismatch(f"{what}: the checkpoint holds PRNG keys of implementation {key!r} with data "
                                f"{got_dtype}{list(got_shape)}, which this JAX cannot rebuild")
            got_shape, got_dtype = keys
        if shape is not None and (tuple(shape) != got_shape or _name(dtype) != got_dtype):
            raise _Mismatch(f"{what}: the checkpoint has {got_dtype}{list(got_shape)}, like= has "
                            f"{_name(dtype)}{list(shape)}")
        self.expect[entry["array"]] = (what, tuple(entry["shape"]), _dtype(entry["dtype"], what), key)


def _match(meta: dict, like: State, like_model: Any) -> Any:
    lay = like.layout
    paths = list(lay.paths)
    saved_paths = list(meta["paths"])
    if saved_paths != paths:
        raise _Mismatch("the checkpoint was saved from another model: " + _path_diff(saved_paths, paths))
    where = _first_difference(meta["structure"], _signature(lay.treedef))
    if where is not None:
        k, a, b = where
        raise _Mismatch(f"the model's structure differs near {show(paths[k]) if k < len(paths) else '<end>'}: "
                        f"the checkpoint has a node {a}, like= has {b}")
    plan = _Plan()

    # Parameters: the file's tie groups on like's treedef; rule classes and state structures from like.
    covered: dict[int, str] = {}
    params, frozen, states, rule_of_saved = [], [], [], {}
    index = lay.index
    for u, sp in enumerate(meta["params"]):
        c = index[sp["canonical"]]
        where = show(sp["canonical"])
        try:
            lu = lay.param(sp["canonical"])
        except PathError:
            raise _Mismatch(f"{where} is a parameter in the checkpoint but not a trainable leaf of like=") from None
        lp = lay.params[lu]
        shape, dtype = tuple(sp["shape"]), _dtype(sp["dtype"], where)
        if (shape, dtype) != (lp.shape, jnp.dtype(lp.dtype)):
            raise _Mismatch(f"parameter {where}: the checkpoint has {dtype.name}{list(shape)}, like= has "
                            f"{jnp.dtype(lp.dtype).name}{list(lp.shape)}")
        members = []
        for m in sp["members"]:
            i = index[m]
            q = lay.params[lay.param_of[i]] if lay.param_of[i] >= 0 else None
            if q is None or (q.shape, jnp.dtype(q.dtype)) != (shape, dtype) or any(t[0] == i for t in q.transforms):
                raise _Mismatch(f"{show(m)} is tied to {where} in the checkpoint but is not a trainable "
                                f"{dtype.name}{list(shape)} leaf of like=")
            members.append(i)
        transforms = []
        for tpath, fname, tshape, tdtype in sp["transforms"]:
            i = index[tpath]
            f = next((t[1] for q in lay.params for t in q.transforms if t[0] == i), None)
            if f is None:
                raise _Mismatch(f"the checkpoint ties {show(tpath)} to {fname}({where}); functions are not "
                                f"stored, so set up like= with the same tie: ties={{{tpath!r}: ({sp['canonical']!r}, "
                                f"{fname})}}")
            if _fname(f) != fname:
                raise _Mismatch(f"{show(tpath)} is {fname}({where}) in the checkpoint but {_fname(f)}(...) in like=")
            transforms.append((i, f, tuple(tshape), _dtype(tdtype, tpath)))
        for i in members + [t[0] for t in transforms]:
            if i in covered:
                raise _Mismatch(f"{show(paths[i])} belongs to two parameters ({covered[i]} and {where})")
            covered[i] = where

        # the rule: like's rule for this parameter must have the saved structure
        k = sp["rule"]
        if not isinstance(k, int) or not 0 <= k < len(meta["rules"]):
            raise TypeError(f"rule index {k!r} out of range")
        saved_rule = meta["rules"][k]
        like_rule = like.rules[lp.rule]
        like_sig = _signature(jax.tree.structure(like_rule))
        if like_sig != saved_rule["structure"]:
            raise _Mismatch(f"the rule of {where} differs: the checkpoint has {saved_rule['repr']}, like= has "
                            f"{_clean(repr(unwrap(like_rule)))}")
        rule_of_saved.setdefault(k, like_rule)

        # the optimiser state: like's structure, the file's arrays (checked for shape and dtype)
        like_leaves, like_def = jax.tree_util.tree_flatten(like.param_state(lu))
        if _signature(like_def) != sp["state_structure"] or len(like_leaves) != len(sp["state"]):
            raise _Mismatch(f"the optimiser state of {where} has another structure: the checkpoint's rule is "
                            f"{saved_rule['repr']}, like='s is {_clean(repr(unwrap(like_rule)))}")
        for j, (entry, x) in enumerate(zip(sp["state"], like_leaves)):
            _want_like(plan, entry, x, f"optimiser state {j} of {where}")
        states.append((like_def, sp["state"], like_leaves))
        params.append(Param(c, tuple(members), shape, dtype, k, tuple(transforms), lp.place))
        if not isinstance(sp["frozen"], bool):
            raise TypeError("frozen flag is not a bool")
        frozen.append(sp["frozen"])
    for i in range(len(paths)):
        if lay.param_of[i] >= 0 and i not in covered:
            raise _Mismatch(f"{show(paths[i])} is a trainable leaf of like= but not a parameter in the checkpoint")

    # rules: like's classes, the file's hyperparameter values
    rules = []
    for k, saved_rule in enumerate(meta["rules"]):
        template = rule_of_saved.get(k)
        if template is None:
            template = like.rules[k] if k < len(like.rules) else None
            if template is None or _signature(jax.tree.structure(template)) != saved_rule["structure"]:
                raise _Mismatch(f"the checkpoint's rule {saved_rule['repr']} has no counterpart in like=")
        leaves, treedef = jax.tree_util.tree_flatten(template)
        if len(leaves) != len(saved_rule["leaves"]):
            raise TypeError("rule leaves do not match the rule's structure")
        for j, (entry, x) in enumerate(zip(saved_rule["leaves"], leaves)):
            what = f"hyperparameter {j} of {saved_rule['repr']}"
            if _int_hyperparameter(entry, x):   # written before hyperparameters were floats: widened in build
                plan.want(entry, what, np.shape(x), _dtype(entry["dtype"], what))
            else:
                _want_like(plan, entry, x, what)
        rules.append((treedef, saved_rule["leaves"], leaves))
    plan.want(meta["step"], "the step counter", (), jnp.int32)

    new_layout = Layout(lay.treedef, tuple(params), tuple(frozen))
    if new_layout == lay:
        new_layout = lay          # identical: keep like's (already computed paths, identity comparisons)

    model_entries = meta["model"]
    if like_model is not _NO_MODEL and model_entries is None:
        raise _Mismatch("like= has a model but the checkpoint holds none (it was saved without model=)")
    like_leaves_m = jax.tree.leaves(like_model) if like_model is not _NO_MODEL else None
    if like_leaves_m is not None:
        if len(model_entries) != len(like_leaves_m):
            raise TypeError("model entries do not match the leaf paths")
        placed = {}
        for p in params:
            placed.update({i: (p.shape, p.dtype) for i in p.members})
            placed.update({t[0]: (t[2], t[3]) for t in p.transforms})
        for i, entry in enumerate(model_entries):
            what = f"model leaf {show(paths[i])}"
            if i in placed:
                plan.want(entry, what, *placed[i])
            elif "array" in entry and isinstance(like_leaves_m[i], (jax.Array, np.ndarray, np.generic)):
                plan.want(entry, what, np.shape(like_leaves_m[i]), like_leaves_m[i].dtype)
            elif "array" in entry:
                plan.want(entry, what)      # like= has a Python value there: the file's array, as saved
            else:
                _python(entry, None)        # validate now: nothing may fail once building starts

    def build(arrays: dict) -> Any:
        # Pass 1: decide every leaf (a Python value, or which array goes where); pass 2: move all arrays to
        # their devices in two batched transfers; pass 3: assemble. Tied members share one transfer.
        slots: dict = {}

        def put(entry: dict, like_x: Any) -> Any:
            if "array" not in entry:
                return _Value(_python(entry, like_x))
            key = (entry["array"], _placement(like_x))
            return slots.setdefault(key, _Slot(key))

        rule_parts = [(td, [put(e, x) for e, x in zip(es, xs)]) for td, es, xs in rules]
        state_parts = [(td, [put(e, x) for e, x in zip(es, xs)]) for td, es, xs in states]
        out: list = []
        if like_leaves_m is not None:
            out = [None] * len(like_leaves_m)
            for p in params:                 # one array object per tie group
                value = put(model_entries[p.canonical], like_leaves_m[p.canonical])
                for i in p.members:
                    out[i] = value
            for i, (entry, x) in enumerate(zip(model_entries, like_leaves_m)):
                if out[i] is None:
                    out[i] = put(entry, x)

        plain = [sl for sl in slots.values() if sl.key[1] is None]
        placed = [sl for sl in slots.values() if sl.key[1] is not None and sl.key[1] is not _HOST]
        for sl in slots.values():
            if sl.key[1] is _HOST:
                sl.value = arrays[sl.key[0]]
        for group, values in ((plain, jax.device_put([arrays[sl.key[0]] for sl in plain])),
                              (placed, jax.device_put([arrays[sl.key[0]] for sl in placed],
                                                      [sl.key[1] for sl in placed]))):
            for sl, v in zip(group, values):
                sl.value = v

        new_rules = tuple(jax.tree_util.tree_unflatten(td, [_widen(v.value, x) for v, x in zip(vs, xs)])
                          for (td, vs), (_, _, xs) in zip(rule_parts, rules))
        new_states = tuple(jax.tree_util.tree_unflatten(td, [v.value for v in vs]) for td, vs in state_parts)
        step = jnp.asarray(arrays[meta["step"]["array"]], jnp.int32)
        state = State.of_params(new_layout, new_rules, list(new_states), step)
        if new_layout == like.layout:     # stacks go where like='s stacks are (the same shardings, spelled alike)
            state = State(new_layout, new_rules, jax.tree.map(_place_like, state.stacks, like.stacks), step)
        if like_leaves_m is None:
            return state
        return state, lay.treedef.unflatten([v.value for v in out])

    plan.build = build
    return plan


def _place_like(a: Any, like: Any) -> Any:
    if isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer) and (
            not isinstance(a, jax.Array) or a.sharding != like.sharding):
        return jax.device_put(a, like.sharding)
    return a


class _Value:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class _Slot:
    """One array to load, and where it goes: `(array name, sharding or None)`; filled in by `build`."""

    __slots__ = ("key", "value")

    def __init__(self, key: tuple):
        self.key, self.value = key, None


def _int_hyperparameter(entry: Any, x: Any) -> bool:
    """An integer hyperparameter in the file where like= has a floating one: files written before optim stored
    hyperparameters given as ints (`Descent(1)`) as floats. They load, widened to like='s dtype."""
    if not (isinstance(entry, dict) and "array" in entry and "key" not in entry and isinstance(entry.get("dtype"), str)
            and isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(x.dtype, jnp.floating)):
        return False
    try:
        return bool(np.issubdtype(np.dtype(entry["dtype"]), np.integer))
    except TypeError:
        return False


def _widen(v: Any, like_x: Any) -> Any:
    """A hyperparameter in like='s dtype (only differs for `_int_hyperparameter`)."""
    if hasattr(v, "dtype") and hasattr(like_x, "dtype") and v.dtype != like_x.dtype:
        return jnp.asarray(v, like_x.dtype)
    return v


def _want_like(plan: _Plan, entry: dict, x: Any, what: str) -> None:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        plan.want(entry, what, np.shape(x), x.dtype)
    elif "array" in entry:
        raise _Mismatch(f"{what}: the checkpoint has an array, like= has a Python {type(x).__name__}")
    else:
        _python(entry, x)


def _read_arrays(path: str, meta: dict, npz: Any, expect: dict) -> dict:
    """Read the data blob and cut out every array the plan needs, checking its checksum, dtype and shape (its
    size was checked against the description when the file was opened). Typed PRNG keys are rebuilt here."""
    entries = {e["array"]: e for e in _all_entries(meta)}
    try:
        blob = npz["data"] if expect else np.zeros(0, np.uint8)
    except Exception as e:
        raise ValueError(f"load: {path} is truncated or corrupted: cannot read its data "
                         f"({type(e).__name__}: {e})") from None
    out = {}
    for name, (what, shape, dtype, key) in expect.items():
        e = entries[name]
        offset, nbytes = e["offset"], e["nbytes"]
        if (not isinstance(offset, int) or not isinstance(nbytes, int) or offset < 0
                or offset + nbytes > blob.size or nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize):
            raise ValueError(f"load: {path} is corrupted: {what} lies outside its data")
        raw = blob[offset:offset + nbytes]
        if _digest(raw) != e.get("sha256"):
            raise ValueError(f"load: {path} is corrupted: the checksum of {what} does not match")
        out[name] = raw.view(dtype).reshape(shape)
        if key is not None:
            out[name] = jax.random.wrap_key_data(out[name], impl=key)
    blob.flags.writeable = False       # numpy arrays handed out are views of it: read-only, like setup's
    return out


def _all_entries(meta: dict):
    for r in meta["rules"]:
        yield from (e for e in r["leaves"] if "array" in e)
    for p in meta["params"]:
        yield from (e for e in p["state"] if "array" in e)
    yield meta["step"]
    for e in meta["model"] or ():
        if "array" in e:
            yield e


# ----------------------------------------------------------------------------------------------- helpers
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _clean(text: str) -> str:
    """A repr without memory addresses (they differ between processes)."""
    return _ADDRESS.sub("", text)


_SIGNATURES: dict = {}


def _signature(treedef) -> list[str]:
    """The node types and static data of a treedef, one string per node in pre-order (leaves are '*').

    Compared on load so that a checkpoint is not silently restored into a structure whose static parts
    (a custom node's aux data: activation names, sizes) differ. Cached: a model's parameters mostly share a
    handful of state structures."""
    try:
        hit = _SIGNATURES.get(treedef)
    except TypeError:       # unhashable aux data
        return _walk(treedef)
    if hit is None:
        hit = _walk(treedef)
        if len(_SIGNATURES) > 1024:
            _SIGNATURES.clear()
        _SIGNATURES[treedef] = hit
    return hit


def _walk(treedef) -> list[str]:
    out: list[str] = []

    def walk(td):
        data = td.node_data()
        if data is None:
            out.append("*")
            return
        typ, aux = data
        out.append(typ.__qualname__ if aux is None else f"{typ.__qualname__}[{_clean(repr(aux))}]")
        for child in td.children():
            walk(child)

    walk(treedef)
    return out


def _first_difference(saved: list, like: list):
    """`(leaf index, saved node, like node)` at the first differing node, or None."""
    leaf = 0
    for a, b in zip(saved, like):
        if a != b:
            return leaf, a, b
        leaf += a == "*"
    if len(saved) != len(like):
        return leaf, "(end)" if len(saved) < len(like) else saved[len(like)], \
            "(end)" if len(like) < len(saved) else like[len(saved)]
    return None


def _path_diff(saved: list[str], like: list[str]) -> str:
    s, l_ = set(saved), set(like)
    only_saved = [p for p in saved if p not in l_]
    only_like = [p for p in like if p not in s]
    parts = []
    if only_saved:
        parts.append("like= lacks " + ", ".join(map(show, only_saved[:5])) + (" ..." if len(only_saved) > 5 else ""))
    if only_like:
        parts.append("the checkpoint lacks " + ", ".join(map(show, only_like[:5]))
                     + (" ..." if len(only_like) > 5 else ""))
    if not parts:
        k = next(k for k, (a, b) in enumerate(zip(saved, like)) if a != b)
        parts.append(f"leaf order differs at position {k}: {show(saved[k])} vs {show(like[k])}")
    return "; ".join(parts)


def _fname(f: Any) -> str:
    return getattr(f, "__name__", type(f).__name__)


def _storable(dt: np.dtype) -> bool:
    return dt == np.bool_ or bool(jnp.issubdtype(dt, jnp.number))


_DTYPES: dict = {}


def _dtype(name: Any, what: str) -> np.dtype:
    """A dtype named in the file: only numbers and bools (never object dtypes)."""
    dt = _DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        try:
            dt = jnp.dtype(name) if isinstance(name, str) else None
        except TypeError:
            dt = None
        if dt is None or not _storable(dt):
            raise TypeError(f"{what}: unknown dtype {name!r}")
        _DTYPES[name] = dt
    return dt


def _name(dtype: Any) -> str:
    """`jnp.dtype(dtype).name`, cached (numpy computes names slowly)."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        # typed PRNG keys' dtypes ('key<fry>') are not numpy dtypes
        name = str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else jnp.dtype(dtype).name
        with contextlib.suppress(TypeError):
            _NAMES[dtype] = name
        return name


_NAMES: dict = {}


def _key_type(impl: str, shape: tuple, dtype: Any) -> tuple | None:
    """`(shape, dtype name)` of the typed PRNG keys that `jax.random.wrap_key_data(data, impl=impl)` rebuilds
    from key data of `shape` and `dtype`, or None if it cannot (a name JAX does not know, data of another shape).
    Abstract: nothing is computed."""
    try:
        keys = jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=impl), jax.ShapeDtypeStruct(shape, dtype))
    except (ValueError, TypeError):       # what wrap_key_data raises for an unknown name or mis-shaped data
        return None
    return tuple(keys.shape), str(keys.dtype)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(a, order="C").reshape(-1).view(np.uint8)).hexdigest()


_HOST = "host"


def _placement(x: Any) -> Any:
    """Where a loaded array goes, following its counterpart in `like`:

    - a numpy array (what `setup` gives for state on the default device): stays a read-only numpy array, which
      the first `update` moves to the device (a device transfer per array would dominate loading a model with
      tens of thousands of leaves);
    - a jax array committed to a sharding or device: that sharding;
    - an uncommitted jax array: the default device, uncommitted (a committed copy of an uncommitted
      hyperparameter would clash with sharded arguments in `jit`).
    """
    if isinstance(x, np.ndarray):
        return _HOST
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and getattr(x, "committed", True):
        return x.sharding
    return None


def _python(entry: dict, like_x: Any) -> Any:
    kind = entry["py"]
    if kind == "skip":
        return like_x
    v = entry["value"]
    if kind == "bool" and isinstance(v, bool):
        return v
    if kind == "int" and isinstance(v, int) and not isinstance(v, bool):
        return v
    if kind == "float" and isinstance(v, (int, float)):
        return float(v)
    if kind == "complex" and isinstance(v, list) and len(v) == 2:
        return complex(v[0], v[1])
    if kind == "str" and isinstance(v, str):
        return v
    raise ValueError(f"load: malformed Python leaf {entry!r} in the checkpoint")
