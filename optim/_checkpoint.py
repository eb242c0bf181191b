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
import dataclasses
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

from ._state import Layout, Param, PathError, State, TiedCopy, func_name, unwrap
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
        rules.append({"repr": _rule_repr(rule), "structure": _signature(treedef),
                      "leaves": [writer.leaf(v, f"hyperparameter {j} of rule {k}") for j, v in enumerate(leaves)]})
    meta["rules"] = rules

    params = []
    per_param = _param_states(state)
    for u, p in enumerate(lay.params):
        where = show(paths[p.canonical])
        leaves, treedef = jax.tree_util.tree_flatten(per_param[u])
        params.append({
            "canonical": paths[p.canonical], "members": [paths[i] for i in p.members],
            "transforms": [[paths[t.position], func_name(t.f), list(t.shape), jnp.dtype(t.dtype).name]
                           for t in p.transforms],
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
    """One optimiser state per parameter. The file stores them per parameter (not per stack), so it
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
        if isinstance(v, _ARRAYS):
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
            name = _dtype_name(v.dtype)
            if _storable_dtype(name) is None:
                raise TypeError(f"save: {what} has dtype {name}, which a checkpoint cannot hold")
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
    """The file is a checkpoint of another model or rule than like='s."""


class _Malformed(ValueError):
    """The file's description is not one `save` writes (edited, or written by something else)."""


def _restore(path: str, meta: dict, npz: Any, like: State, like_model: Any) -> Any:
    try:
        plan = _match(meta, like, like_model)
    except _Mismatch as e:
        raise ValueError(f"load: {path} does not match like=: {e}") from None
    except _Malformed as e:
        raise ValueError(f"load: {path} has a malformed description ({e})") from None
    arrays = _read_arrays(path, meta, npz, plan.expect)
    return plan.build(arrays)


def _match(meta: dict, like: State, like_model: Any) -> _Plan:
    """Check the file's description against like= and plan what `load` builds. Raises `_Malformed` or
    `_Mismatch`; once it returns, building cannot fail on anything in the file."""
    _check_description(meta)
    plan = _Plan(meta, like, like_model)
    plan.match_structure()
    plan.match_params()
    plan.match_rules()
    plan.want(meta["step"], "the step counter", (), jnp.int32)
    plan.match_model()
    return plan


class _Plan:
    """What `load` builds, matched against like= step by step (`_match`) before any array is read: each step
    checks a part of the description (raising `_Mismatch` or `_Malformed`) and records what `build` needs,
    among it `expect`, the arrays to read. `build` then assembles the result from them."""

    def __init__(self, meta: dict, like: State, like_model: Any):
        self.meta = meta
        self.like = like
        self.paths = list(like.layout.paths)
        # array name -> (what, shape, dtype, PRNG key implementation or None)
        self.expect: dict[str, tuple[str, tuple, Any, str | None]] = {}
        # match_params: the file's parameters (tie groups on like='s treedef) and frozen flags, the layout they
        # make, and per parameter the optimiser state to build: (like's state treedef, the file's entries, like's
        # leaves)
        self.params: list[Param] = []
        self.frozen: list[bool] = []
        self.layout: Layout = like.layout
        self.states: list[tuple] = []
        # the saved rule index -> like='s rule of a parameter using it: the class that rule is rebuilt with
        self.like_rule_of: dict[int, Any] = {}
        # per saved rule (match_rules): (like's rule treedef, the file's entries, like's leaves)
        self.rules: list[tuple] = []
        # the model (match_model): like='s leaves and the file's entries; None when like= has no model
        self.like_leaves: list | None = None if like_model is _NO_MODEL else jax.tree.leaves(like_model)
        self.model_entries: list | None = None

    # ----------------------------------------------------------------------------------------- matching
    def match_structure(self) -> None:
        """The file's model has like='s leaf paths, node types and static data."""
        saved = self.meta["paths"]
        if saved != self.paths:
            raise _Mismatch("the checkpoint was saved from another model: " + structure_diff(
                saved, self.paths, missing="like= lacks", unexpected="the checkpoint lacks"))
        where = _first_difference(self.meta["structure"], _signature(self.like.layout.treedef))
        if where is not None:
            k, a, b = where
            raise _Mismatch(f"the model's structure differs near "
                            f"{show(self.paths[k]) if k < len(self.paths) else '<end>'}: "
                            f"the checkpoint has a node {a}, like= has {b}")

    def match_params(self) -> None:
        """The file's tie groups on like='s treedef, with the rule classes and state structures of like=; every
        trainable leaf of like= in exactly one of them."""
        lay = self.like.layout
        owner: dict[int, str] = {}        # model position -> its parameter
        for sp in self.meta["params"]:
            self.params.append(self._param(sp, owner))
            self.frozen.append(sp["frozen"])
        for i in range(len(self.paths)):
            if lay.param_of[i] >= 0 and i not in owner:
                raise _Mismatch(f"{show(self.paths[i])} is a trainable leaf of like= but not a parameter in the "
                                "checkpoint")
        layout = Layout(lay.treedef, tuple(self.params), tuple(self.frozen))
        self.layout = lay if layout == lay else layout     # identical: keep like's (computed paths, identity)

    def _param(self, sp: dict, owner: dict[int, str]) -> Param:
        """One saved parameter, checked against like='s parameter at its canonical path."""
        lay, where = self.like.layout, show(sp["canonical"])
        try:
            u = lay.param(sp["canonical"])
        except PathError:
            raise _Mismatch(f"{where} is a parameter in the checkpoint but not a trainable leaf of like=") from None
        lp = lay.params[u]
        shape, dtype = tuple(sp["shape"]), _dtype_named(sp["dtype"], where)
        if (shape, dtype) != (lp.shape, jnp.dtype(lp.dtype)):
            raise _Mismatch(f"parameter {where}: the checkpoint has {dtype.name}{list(shape)}, like= has "
                            f"{jnp.dtype(lp.dtype).name}{list(lp.shape)}")
        members = [self._member(m, shape, dtype, where) for m in sp["members"]]
        transforms = [self._tied_copy(t, sp["canonical"]) for t in sp["transforms"]]
        for i in members + [t.position for t in transforms]:
            if i in owner:
                raise _Mismatch(f"{show(self.paths[i])} belongs to two parameters ({owner[i]} and {where})")
            owner[i] = where
        self._rule(sp["rule"], self.like.rules[lp.rule], where)
        self._state(sp, u, where)
        # like='s parameter with the file's tie group and rule index: its placement and requested state sharding
        return dataclasses.replace(lp, canonical=lay.index[sp["canonical"]], members=tuple(members), rule=sp["rule"],
                                   transforms=tuple(transforms))

    def _member(self, path: str, shape: tuple, dtype: np.dtype, where: str) -> int:
        """A position the file ties to the parameter at `where`: a trainable leaf of like= of its shape and dtype."""
        lay = self.like.layout
        i = lay.index[path]
        q = lay.params[lay.param_of[i]] if lay.param_of[i] >= 0 else None
        if q is None or (q.shape, jnp.dtype(q.dtype)) != (shape, dtype) or any(t.position == i for t in q.transforms):
            raise _Mismatch(f"{show(path)} is tied to {where} in the checkpoint but is not a trainable "
                            f"{dtype.name}{list(shape)} leaf of like=")
        return i

    def _tied_copy(self, saved: list, canonical: str) -> TiedCopy:
        """A position the file ties to `canonical` through a function, which like= must tie alike (functions are
        not stored)."""
        path, fname, shape, dtype = saved
        i = self.like.layout.index[path]
        f = next((t.f for q in self.like.layout.params for t in q.transforms if t.position == i), None)
        if f is None:
            raise _Mismatch(f"the checkpoint ties {show(path)} to {fname}({show(canonical)}); functions are not "
                            f"stored, so set up like= with the same tie: ties={{{path!r}: ({canonical!r}, "
                            f"{fname})}}")
        if func_name(f) != fname:
            raise _Mismatch(f"{show(path)} is {fname}({show(canonical)}) in the checkpoint but {func_name(f)}(...) "
                            "in like=")
        return TiedCopy(i, f, tuple(shape), _dtype_named(dtype, path))

    def _rule(self, k: int, like_rule: Any, where: str) -> None:
        """like='s rule for a parameter must have the structure of the saved rule `k`: it is the class that rule
        is rebuilt with."""
        saved = self.meta["rules"][k]
        if not _same_rule_structure(saved["structure"], like_rule):
            raise _Mismatch(f"the rule of {where} differs: the checkpoint has {saved['repr']}, like= has "
                            f"{_rule_repr(like_rule)}")
        self.like_rule_of.setdefault(k, like_rule)

    def _state(self, sp: dict, u: int, where: str) -> None:
        """A parameter's optimiser state: like='s structure, the file's arrays (checked for shape and dtype)."""
        like_leaves, like_def = jax.tree_util.tree_flatten(self.like.param_state(u))
        if not _same_state_structure(sp["state_structure"], like_def) or len(like_leaves) != len(sp["state"]):
            like_rule = self.like.rules[self.like.layout.params[u].rule]
            raise _Mismatch(f"the optimiser state of {where} has another structure: the checkpoint's rule is "
                            f"{self.meta['rules'][sp['rule']]['repr']}, like='s is {_rule_repr(like_rule)}")
        for j, (entry, x) in enumerate(zip(sp["state"], like_leaves)):
            self._want_like(entry, x, f"optimiser state {j} of {where}")
        self.states.append((like_def, sp["state"], like_leaves))

    def match_rules(self) -> None:
        """Every saved rule: like='s class (its parameters' rule, else like='s rule of the same index and
        structure) with the file's hyperparameters."""
        for k, saved in enumerate(self.meta["rules"]):
            template = self.like_rule_of.get(k)
            if template is None:
                template = self.like.rules[k] if k < len(self.like.rules) else None
                if template is None or not _same_rule_structure(saved["structure"], template):
                    raise _Mismatch(f"the checkpoint's rule {saved['repr']} has no counterpart in like=")
            leaves, treedef = jax.tree_util.tree_flatten(template)
            if len(leaves) != len(saved["leaves"]):
                raise _Malformed("rule leaves do not match the rule's structure")
            for j, (entry, x) in enumerate(zip(saved["leaves"], leaves)):
                what = f"hyperparameter {j} of {saved['repr']}"
                if _int_hyperparameter(entry, x):   # written before hyperparameters were floats: widened in build
                    self.want(entry, what, np.shape(x), _dtype_named(entry["dtype"], what))
                else:
                    self._want_like(entry, x, what)
            self.rules.append((treedef, saved["leaves"], leaves))

    def match_model(self) -> None:
        """The model's entries, when like= has a model: tied positions hold their parameter's shape and dtype,
        other arrays like='s (or, where like= has a Python value, the file's)."""
        if self.like_leaves is None:
            return
        entries = self.meta["model"]
        if entries is None:
            raise _Mismatch("like= has a model but the checkpoint holds none (it was saved without model=)")
        if len(entries) != len(self.like_leaves):
            raise _Malformed("model entries do not match the leaf paths")
        placed = {}
        for p in self.params:
            placed.update({i: (p.shape, p.dtype) for i in p.members})
            placed.update({t.position: (t.shape, t.dtype) for t in p.transforms})
        for i, (entry, x) in enumerate(zip(entries, self.like_leaves)):
            what = f"model leaf {show(self.paths[i])}"
            if i in placed:
                self.want(entry, what, *placed[i])
            elif "array" in entry and isinstance(x, _ARRAYS):
                self.want(entry, what, np.shape(x), x.dtype)
            elif "array" in entry:
                self.want(entry, what)      # like= has a Python value there: the file's array, as saved
            else:
                _python(entry, None)        # validate now: nothing may fail once building starts
        self.model_entries = entries

    def want(self, entry: dict, what: str, shape: tuple | None = None, dtype: Any = None) -> None:
        """Read `entry`'s array; if `shape` is given, it must have that shape and dtype (keys: of the keys)."""
        if "array" not in entry:
            raise _Mismatch(f"{what}: the checkpoint has a Python {entry.get('py')}, like= has an array")
        got_shape, got_dtype = tuple(entry["shape"]), entry["dtype"]
        key = entry.get("key")
        if key is not None:      # typed PRNG keys: compare the keys' shape and dtype, not their data's
            if not isinstance(key, str):
                raise _Malformed(f"{what}: key implementation {key!r} is not a name")
            keys = _key_type(key, got_shape, _dtype_named(got_dtype, what))
            if keys is None:
                raise _Mismatch(f"{what}: the checkpoint holds PRNG keys of implementation {key!r} with data "
                                f"{got_dtype}{list(got_shape)}, which this JAX cannot rebuild")
            got_shape, got_dtype = keys
        if shape is not None and (tuple(shape) != got_shape or _dtype_name(dtype) != got_dtype):
            raise _Mismatch(f"{what}: the checkpoint has {got_dtype}{list(got_shape)}, like= has "
                            f"{_dtype_name(dtype)}{list(shape)}")
        self.expect[entry["array"]] = (what, tuple(entry["shape"]), _dtype_named(entry["dtype"], what), key)

    def _want_like(self, entry: dict, x: Any, what: str) -> None:
        """`entry` where like= has `x`: an array of x's shape and dtype, or a Python value."""
        if isinstance(x, _ARRAYS):
            self.want(entry, what, np.shape(x), x.dtype)
        elif "array" in entry:
            raise _Mismatch(f"{what}: the checkpoint has an array, like= has a Python {type(x).__name__}")
        else:
            _python(entry, x)

    # ----------------------------------------------------------------------------------------- building
    def build(self, arrays: dict) -> Any:
        """The loaded `State` (and model) from `arrays` (what `expect` names, read and checked). Pass 1 decides
        every leaf (a Python value, or which array goes where); pass 2 moves all arrays to their devices in two
        batched transfers; pass 3 assembles. Tied members share one transfer."""
        slots: dict = {}

        def put(entry: dict, like_x: Any) -> Any:
            if "array" not in entry:
                return _Value(_python(entry, like_x))
            key = (entry["array"], _destination(like_x))
            return slots.setdefault(key, _Slot(key))

        rule_parts = [(td, [put(e, x) for e, x in zip(es, xs)]) for td, es, xs in self.rules]
        state_parts = [(td, [put(e, x) for e, x in zip(es, xs)]) for td, es, xs in self.states]
        model_parts: list = []
        if self.like_leaves is not None:
            entries, like_leaves = self.model_entries, self.like_leaves
            model_parts = [None] * len(like_leaves)
            for p in self.params:                 # one array object per tie group
                value = put(entries[p.canonical], like_leaves[p.canonical])
                for i in p.members:
                    model_parts[i] = value
            for i, (entry, x) in enumerate(zip(entries, like_leaves)):
                if model_parts[i] is None:
                    model_parts[i] = put(entry, x)

        _transfer(list(slots.values()), arrays)

        rules = tuple(jax.tree_util.tree_unflatten(td, [_widen(v.value, x) for v, x in zip(vs, xs)])
                      for (td, vs), (_, _, xs) in zip(rule_parts, self.rules))
        states = [jax.tree_util.tree_unflatten(td, [v.value for v in vs]) for td, vs in state_parts]
        step = _place_like(jnp.asarray(arrays[self.meta["step"]["array"]], jnp.int32), self.like.step)
        state = State.of_params(self.layout, rules, states, step)
        if self.layout == self.like.layout:     # stacks go where like='s are (the same shardings, spelled alike)
            state = State(self.layout, rules, jax.tree.map(_place_like, state.stacks, self.like.stacks), step)
        if self.like_leaves is None:
            return state
        return state, self.like.layout.treedef.unflatten([v.value for v in model_parts])


def _transfer(slots: list, arrays: dict) -> None:
    """Fill every slot with its array, where it goes (`_destination`): host arrays as they are, the others in two
    batched transfers (to the default device; to their shardings)."""
    plain = [sl for sl in slots if sl.key[1] is None]
    placed = [sl for sl in slots if sl.key[1] is not None and sl.key[1] is not _HOST]
    for sl in slots:
        if sl.key[1] is _HOST:
            sl.value = arrays[sl.key[0]]
    for group, values in ((plain, jax.device_put([arrays[sl.key[0]] for sl in plain])),
                          (placed, jax.device_put([arrays[sl.key[0]] for sl in placed],
                                                  [sl.key[1] for sl in placed]))):
        for sl, v in zip(group, values):
            sl.value = v


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
    """One array to load, and where it goes: `(array name, _destination(like's leaf))`; filled in by `build`."""

    __slots__ = ("key", "value")

    def __init__(self, key: tuple):
        self.key, self.value = key, None


def _int_hyperparameter(entry: Any, x: Any) -> bool:
    """An integer hyperparameter in the file where like= has a floating one: files written before optim stored
    hyperparameters given as ints (`Descent(1)`) as floats. They load, widened to like='s dtype."""
    if not (isinstance(entry, dict) and "array" in entry and "key" not in entry and isinstance(entry.get("dtype"), str)
            and isinstance(x, _ARRAYS) and jnp.issubdtype(x.dtype, jnp.floating)):
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


def _check_description(meta: dict) -> None:
    """Check that the description has the form `save` writes, so that matching it against like= may index it
    freely: every part's keys and container types, array shapes, and paths that name the file's leaves. What
    values mean (dtypes, Python values, where arrays lie) is checked where they are used. Raises `_Malformed`."""
    paths = meta.get("paths")
    if not (isinstance(paths, list) and all(isinstance(p, str) for p in paths) and len(set(paths)) == len(paths)):
        raise _Malformed("the leaf paths are not a list of distinct strings")
    known = set(paths)
    _check_fields(meta, _DESCRIPTION, "the description")
    if not (meta["model"] is None or isinstance(meta["model"], list)):
        raise _Malformed("the model entries are not a list")
    for k, rule in enumerate(meta["rules"]):
        _check_fields(rule, _RULE, f"rule {k}")
        _check_entries(rule["leaves"], f"the hyperparameters of rule {k}")
    for u, sp in enumerate(meta["params"]):
        what = f"parameter {u}"
        _check_fields(sp, _PARAM, what)
        k = sp["rule"]
        if not 0 <= k < len(meta["rules"]):
            raise _Malformed(f"rule index {k!r} out of range")
        if not (sp["canonical"] in known and all(isinstance(m, str) and m in known for m in sp["members"])
                and _is_shape(sp["shape"])):
            raise _Malformed(f"{what}: its paths or shape are malformed")
        for t in sp["transforms"]:
            if not (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str) and t[0] in known
                    and isinstance(t[1], str) and _is_shape(t[2])):
                raise _Malformed(f"{what}: transformed member {t!r} is malformed")
        _check_entries(sp["state"], f"the optimiser state of {what}")
    _check_entries([meta["step"]], "the step counter")
    _check_entries(meta["model"] or (), "the model")


# the keys each part of a description has, and their types (`object`: checked where used)
_DESCRIPTION = {"structure": list, "rules": list, "params": list, "step": object, "model": object}
_RULE = {"repr": str, "structure": list, "leaves": list}
_PARAM = {"canonical": str, "members": list, "transforms": list, "shape": list, "dtype": object, "rule": int,
          "frozen": bool, "state_structure": list, "state": list}
_ARRAY_ENTRY = {"array": str, "shape": list, "dtype": object, "offset": object, "nbytes": object}


def _check_fields(obj: Any, fields: dict, what: str) -> None:
    if not isinstance(obj, dict):
        raise _Malformed(f"{what} is not an object")
    for key, kind in fields.items():
        if key not in obj:
            raise _Malformed(f"{what}: {key!r} is missing")
        if not isinstance(obj[key], kind):
            raise _Malformed(f"{what}: {key!r} is a {type(obj[key]).__name__}, not a {kind.__name__}")


def _check_entries(entries: Any, what: str) -> None:
    """Leaf entries (`_Writer.leaf`): an array's name, shape, dtype and place in the data, or a Python value."""
    for j, e in enumerate(entries):
        if isinstance(e, dict) and "array" in e:
            if e.keys() >= _ARRAY_ENTRY.keys() and isinstance(e["array"], str) and _is_shape(e["shape"]):
                continue         # the common case, checked fast: a model may have tens of thousands of entries
            _check_fields(e, _ARRAY_ENTRY, f"{what}, entry {j}")
            raise _Malformed(f"{what}, entry {j}: shape {e['shape']!r} is not a list of sizes")
        elif not (isinstance(e, dict) and "py" in e and ("value" in e or e["py"] == "skip")):
            raise _Malformed(f"{what}, entry {j}: {e!r} is neither an array nor a Python value")


def _is_shape(x: Any) -> bool:
    return isinstance(x, list) and all(type(n) is int and n >= 0 for n in x)


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


def _walk(treedef, untuple: bool = False) -> list[str]:
    """The signature of `treedef`; with `untuple`, a named tuple's node reads as a plain tuple's."""
    out: list[str] = []

    def walk(td):
        data = td.node_data()
        if data is None:
            out.append("*")
            return
        typ, aux = data
        if untuple and issubclass(typ, tuple) and hasattr(typ, "_fields"):
            typ = tuple
        out.append(typ.__qualname__ if aux is None else f"{typ.__qualname__}[{_clean(repr(aux))}]")
        for child in td.children():
            walk(child)

    walk(treedef)
    return out


def _same_state_structure(saved: list[str], treedef: Any) -> bool:
    """Whether a saved optimiser state's signature is `treedef`'s. Rule states were plain tuples before they were
    named (`AdamState(mu, nu, bt)`): a saved `tuple` node matches a named tuple's node (its arity is the type's),
    so those files still load."""
    like = _signature(treedef)
    return saved == like or saved == _walk(treedef, untuple=True)


def _same_rule_structure(saved: list[str], rule: Any) -> bool:
    """Whether a saved rule's signature is `rule`'s. A structural field added to a rule class later, with
    default None (`Adam.mu_dtype`), is absent from the files written before it: trailing None entries of a
    node's static data compare as absent, so those files still load."""
    like = _signature(jax.tree.structure(rule))
    return saved == like or [_no_trailing_none(a) for a in saved] == [_no_trailing_none(b) for b in like]


def _no_trailing_none(node: str) -> str:
    """`'Adam[(True, None, None)]'` -> `'Adam[(True)]'`, `'Adam[(True,)]'` -> `'Adam[(True)]'`,
    `'Momentum[(None,)]'` -> `'Momentum[()]'`."""
    node = re.sub(r"(,\s*None)*,?\)\]$", ")]", node)
    return re.sub(r"\[\(None\)\]$", "[()]", node)


def _rule_repr(rule: Any) -> str:
    """How a description names a rule."""
    return _clean(repr(unwrap(rule)))


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


_DTYPES: dict = {}


def _storable_dtype(name: Any) -> np.dtype | None:
    """The dtype named `name` if a checkpoint can hold it (numbers and bools, never object dtypes), else None.
    Cached."""
    if not isinstance(name, str):
        return None
    dt = _DTYPES.get(name)
    if dt is None:
        try:
            dt = jnp.dtype(name)
        except TypeError:
            return None
        if not (dt == np.bool_ or jnp.issubdtype(dt, jnp.number)):
            return None
        _DTYPES[name] = dt
    return dt


def _dtype_named(name: Any, what: str) -> np.dtype:
    """The dtype the file names `name` for `what`."""
    dt = _storable_dtype(name)
    if dt is None:
        raise _Malformed(f"{what}: unknown dtype {name!r}")
    return dt


def _dtype_name(dtype: Any) -> str:
    """`jnp.dtype(dtype).name`, cached (numpy computes names slowly); typed PRNG keys' dtypes ('key<fry>'),
    which are not numpy dtypes, by their str."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        name = str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else jnp.dtype(dtype).name
        with contextlib.suppress(TypeError):
            _DTYPE_NAMES[dtype] = name
        return name


_DTYPE_NAMES: dict = {}


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


_ARRAYS = (jax.Array, np.ndarray, np.generic)      # what a checkpoint stores as arrays
_HOST = "host"


def _destination(x: Any) -> Any:
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
