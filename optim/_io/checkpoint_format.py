"""The checkpoint file format of `save` and `load` (`checkpoint.py`): writing it, atomically, and reading it back.

A checkpoint is one `.npz`-style zip file of three `.npy` members, read back with `np.load(allow_pickle=False)`:
a JSON description (`meta`, UTF-8 bytes), its SHA-256 (`check`) and every array's bytes in one blob (`data`,
64-byte aligned, at offsets the description gives; one member instead of one per array keeps a model with
tens of thousands of leaves fast to write and read). Nothing in it is code and nothing is unpickled, so loading
a file never runs anything from it. Members are stored uncompressed, and `open_checkpoint` checks every
member's size against its `.npy` header and the description before reading it, so a crafted file cannot make
it inflate or allocate more than the file holds.

The description names every leaf by an entry (`Writer.leaf`): an array's name, dtype, shape, place in the data
blob and SHA-256, or a Python value (number, string). A typed PRNG key (`jax.random.key`) is stored as its key
data plus its implementation's name (`"key"` in its entry); such a file has format version 2, so that an older
optim, which would take the data for plain integers, refuses it. Tree structures are stored as signatures
(`signature`: node types and static data), compared on load.

Here: the writer and the atomic write (`write_atomic`: a temporary file in the same directory, flushed and
fsynced, renamed over the path with `os.replace`, atomic on POSIX and Windows, then the directory fsynced: a
crash at any moment leaves either the previous checkpoint or the new one); opening a file and checking its
description's form (`check_description`, raising `Malformed`); reading and verifying the arrays
(`read_arrays`); signatures; dtype and PRNG-key names. What a description must match to load onto `like=`
is `_checkpoint`'s.
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

from .._base.cache import LRU

FORMAT = "optim-checkpoint"
# 1: no typed PRNG keys; 2: entries may carry "key"; 3: the Adam family's `bt` holds the products of the β's of the
# steps taken (βᵗ), where 1 and 2 held the next step's (βᵗ⁺¹): `load` converts (optim._rules.moments.powers_from_next).
VERSION = 3


# -------------------------------------------------------------------------------------------- writing
class Writer:
    """Collects a checkpoint's arrays (named `a0, a1, ...` in the description); a JSON entry describes every
    leaf: an array's name, dtype, shape, place in the data blob and SHA-256 (for typed PRNG keys: of their key
    data, plus `"key"`: the implementation's name), or a Python value."""

    def __init__(self):
        self.arrays: list = []
        self.entries: list[dict] = []
        self.keys = False

    def leaf(self, v: Any, what: str, optional: bool = False) -> dict:
        if isinstance(v, ARRAYS):
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
                if key_type(key, data.shape, data.dtype) != (v.shape, str(v.dtype)):
                    raise ValueError(f"save: {what} is a PRNG key of implementation {key!r}, which load could not "
                                     "rebuild (jax.random.wrap_key_data takes only JAX's named implementations)")
                v, self.keys = jax.random.key_data(v), True
            name = dtype_name(v.dtype)
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


def write_atomic(path: str, meta: bytes, arrays: list, entries: list, size: int) -> None:
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


# -------------------------------------------------------------------------------------------- reading
def open_checkpoint(path: str) -> tuple[dict, Any]:
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


class Malformed(ValueError):
    """The file's description is not one `save` writes (edited, or written by something else)."""


def check_description(meta: dict) -> None:
    """Check that the description has the form `save` writes, so that matching it against like= may index it
    freely: every part's keys and container types, array shapes, and paths that name the file's leaves. What
    values mean (dtypes, Python values, where arrays lie) is checked where they are used. Raises `Malformed`."""
    paths = meta.get("paths")
    if not (isinstance(paths, list) and all(isinstance(p, str) for p in paths) and len(set(paths)) == len(paths)):
        raise Malformed("the leaf paths are not a list of distinct strings")
    known = set(paths)
    _check_fields(meta, _DESCRIPTION, "the description")
    if not (meta["model"] is None or isinstance(meta["model"], list)):
        raise Malformed("the model entries are not a list")
    for k, rule in enumerate(meta["rules"]):
        _check_fields(rule, _RULE, f"rule {k}")
        _check_entries(rule["leaves"], f"the hyperparameters of rule {k}")
    for u, sp in enumerate(meta["params"]):
        what = f"parameter {u}"
        _check_fields(sp, _PARAM, what)
        k = sp["rule"]
        if not 0 <= k < len(meta["rules"]):
            raise Malformed(f"rule index {k!r} out of range")
        if not (sp["canonical"] in known and all(isinstance(m, str) and m in known for m in sp["members"])
                and _is_shape(sp["shape"])):
            raise Malformed(f"{what}: its paths or shape are malformed")
        for t in sp["transforms"]:
            if not (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str) and t[0] in known
                    and isinstance(t[1], str) and _is_shape(t[2])):
                raise Malformed(f"{what}: transformed member {t!r} is malformed")
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
        raise Malformed(f"{what} is not an object")
    for key, kind in fields.items():
        if key not in obj:
            raise Malformed(f"{what}: {key!r} is missing")
        if not isinstance(obj[key], kind):
            raise Malformed(f"{what}: {key!r} is a {type(obj[key]).__name__}, not a {kind.__name__}")


def _check_entries(entries: Any, what: str) -> None:
    """Leaf entries (`Writer.leaf`): an array's name, shape, dtype and place in the data, or a Python value."""
    for j, e in enumerate(entries):
        if isinstance(e, dict) and "array" in e:
            if e.keys() >= _ARRAY_ENTRY.keys() and isinstance(e["array"], str) and _is_shape(e["shape"]):
                continue         # the common case, checked fast: a model may have tens of thousands of entries
            _check_fields(e, _ARRAY_ENTRY, f"{what}, entry {j}")
            raise Malformed(f"{what}, entry {j}: shape {e['shape']!r} is not a list of sizes")
        elif not (isinstance(e, dict) and "py" in e and ("value" in e or e["py"] == "skip")):
            raise Malformed(f"{what}, entry {j}: {e!r} is neither an array nor a Python value")


def _is_shape(x: Any) -> bool:
    return isinstance(x, list) and all(type(n) is int and n >= 0 for n in x)


def read_arrays(path: str, meta: dict, npz: Any, expect: dict) -> dict:
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


def python_value(entry: dict, like_x: Any) -> Any:
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


# ----------------------------------------------------------------------------------------- signatures
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def clean(text: str) -> str:
    """A repr without memory addresses (they differ between processes)."""
    return _ADDRESS.sub("", text)


# 1024 treedefs: a model's parameters mostly share a handful of state structures; the bound only matters to a
# process that saves or loads many different models.
_SIGNATURES = LRU(1024)


def signature(treedef) -> list[str]:
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
        out.append(typ.__qualname__ if aux is None else f"{typ.__qualname__}[{clean(repr(aux))}]")
        for child in td.children():
            walk(child)

    walk(treedef)
    return out


def same_state_structure(saved: list[str], treedef: Any) -> bool:
    """Whether a saved optimiser state's signature is `treedef`'s. Rule states were plain tuples before they were
    named (`AdamState(mu, nu, bt)`): a saved `tuple` node matches a named tuple's node (its arity is the type's),
    so those files still load."""
    like = signature(treedef)
    return saved == like or saved == _walk(treedef, untuple=True)


def same_rule_structure(saved: list[str], rule: Any) -> bool:
    """Whether a saved rule's signature is `rule`'s. A structural field added to a rule class later, with
    default None (`Adam.mu_dtype`), is absent from the files written before it: trailing None entries of a
    node's static data compare as absent, so those files still load."""
    like = signature(jax.tree.structure(rule))
    return saved == like or [_no_trailing_none(a) for a in saved] == [_no_trailing_none(b) for b in like]


def _no_trailing_none(node: str) -> str:
    """`'Adam[(True, None, None)]'` -> `'Adam[(True)]'`, `'Adam[(True,)]'` -> `'Adam[(True)]'`,
    `'Momentum[(None,)]'` -> `'Momentum[()]'`."""
    node = re.sub(r"(,\s*None)*,?\)\]$", ")]", node)
    return re.sub(r"\[\(None\)\]$", "[()]", node)


# ------------------------------------------------------------------------------------ dtypes and keys
# 64 dtype names: far more than a checkpoint holds (numpy looks dtypes up slowly).
_DTYPES = LRU(64)


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


def dtype_named(name: Any, what: str) -> np.dtype:
    """The dtype the file names `name` for `what`."""
    dt = _storable_dtype(name)
    if dt is None:
        raise Malformed(f"{what}: unknown dtype {name!r}")
    return dt


def dtype_name(dtype: Any) -> str:
    """`jnp.dtype(dtype).name`, cached (numpy computes names slowly); typed PRNG keys' dtypes ('key<fry>'),
    which are not numpy dtypes, by their str."""
    try:
        name = _DTYPE_NAMES.get(dtype)
    except TypeError:       # an unhashable dtype-like: not cached
        name = None
    if name is None:
        name = str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else jnp.dtype(dtype).name
        with contextlib.suppress(TypeError):
            _DTYPE_NAMES[dtype] = name
    return name


# 64 dtypes: far more than a checkpoint holds (numpy computes names slowly).
_DTYPE_NAMES = LRU(64)


def key_type(impl: str, shape: tuple, dtype: Any) -> tuple | None:
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


ARRAYS = (jax.Array, np.ndarray, np.generic)      # what a checkpoint stores as arrays
