"""Dotted paths, leaf classification and structure checks shared by every module."""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cache import LRU
from .export import register_for_export

PyTree = Any


def key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key).strip(".[]'\"")


def dotted(keypath: tuple) -> str:
    """`(DictKey('layers'), SequenceKey(0), GetAttrKey('w'))` -> `'layers.0.w'`."""
    return ".".join(key_name(k) for k in keypath)


def unique_index(paths) -> dict[str, int]:
    """`{dotted path: position}` for the paths that name exactly one leaf (dotted names can collide)."""
    out: dict[str, int] = {}
    for i, p in enumerate(paths):
        out[p] = -1 if p in out else i
    return {p: i for p, i in out.items() if i >= 0}


def suggest(path: str, paths) -> str:
    """`"; did you mean 'a', 'b'?"` naming the paths closest to a mistyped one, or `""`."""
    close = difflib.get_close_matches(path, list(paths), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def suggest_pattern(pattern: str, paths) -> str:
    """`"; did you mean '*.bias'?"` for a path pattern that matches none of `paths`: the closest of the paths
    themselves and of the patterns of the same shape that match one (`'*.bais'` against `'dense.bias'` is
    `'*.bias'`: the path's last parts, with `*` where the pattern has it), or `""`."""
    parts = pattern.split(".")
    shaped = set()
    for p in paths:
        tail = p.split(".")[-len(parts):]
        if len(tail) == len(parts):
            shaped.add(".".join("*" if a == "*" else b for a, b in zip(parts, tail)))
    close = difflib.get_close_matches(pattern, sorted(shaped | set(paths)), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def show(path: str) -> str:
    """A path as error messages print it (the root has the empty path)."""
    return repr(path) if path else "<root>"


def flatten(tree: PyTree, is_leaf=None) -> tuple[list[str], list[Any], Any]:
    """Flatten `tree` into dotted paths, leaves and treedef (JAX's flatten order)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [dotted(kp) for kp, _ in pairs], [leaf for _, leaf in pairs], treedef


# 64 dtypes: far more than a model has; is_trainable asks once per leaf and jnp.issubdtype costs microseconds.
_INEXACT = LRU(64)


def is_trainable(x: Any) -> bool:
    """A trainable leaf is a jax or numpy array with a floating or complex dtype."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        return False
    dt = x.dtype
    ok = _INEXACT.get(dt)
    if ok is None:
        ok = _INEXACT[dt] = bool(jnp.issubdtype(dt, jnp.inexact))
    return ok


def canonical_dtype(d: Any) -> np.dtype:
    """The dtype JAX gives an array of dtype `d`: numpy float64 is float32 unless x64 is enabled."""
    return jax.dtypes.canonicalize_dtype(d)


def describe(x: Any) -> str:
    """A short description of a leaf for error messages and reprs."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


def prefixes(path: str) -> list[str]:
    """Every ancestor of a dotted path, the root ('') first, the path itself last."""
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def structure_diff(expected: list[str], got: list[str], missing: str = "missing",
                   unexpected: str = "unexpected") -> str:
    """Explain how two lists of leaf paths differ, for structure-mismatch errors; `missing` and `unexpected`
    introduce the paths only `expected` has and those only `got` has."""
    expected_set, got_set = set(expected), set(got)
    only_expected = [p for p in expected if p not in got_set]
    only_got = [p for p in got if p not in expected_set]
    parts = []
    for label, only in ((missing, only_expected), (unexpected, only_got)):
        if only:
            parts.append(f"{label} " + ", ".join(show(p) for p in only[:5]) + (" ..." if len(only) > 5 else ""))
    if not parts:
        for a, b in zip(expected, got):
            if a != b:
                return f"leaf order differs at {show(a)} / {show(b)}"
        return "the container types differ (same leaf paths)"
    return "; ".join(parts)


def register_struct(cls: type, static: tuple[str, ...] = ()) -> type:
    """Make `cls` a frozen dataclass and a pytree whose leaves are its non-`static` fields (registered for
    `jax.export` too: `optim._base.export`).

    JAX rebuilds such objects with tracers or placeholders as leaves, so unflattening bypasses `__init__`
    (and its validation). A class already made a dataclass of its own is taken as it is (`Rule` makes it one
    first, to read its fields' metadata: a second pass would lose it).
    """
    if "__dataclass_fields__" not in vars(cls):
        dataclasses.dataclass(frozen=True, repr=False)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    data = tuple(n for n in names if n not in static)
    meta = tuple(n for n in names if n in static)
    order = data + meta

    def flatten_with_keys(obj):
        return [(jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data], tuple(getattr(obj, n) for n in meta)

    def unflatten(aux, children):
        return new_frozen(cls, order, (*children, *aux))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten)
    return register_for_export(cls)


def new_frozen(cls: type, names: Iterable[str], values: Iterable[Any]) -> Any:
    """An instance of the frozen dataclass `cls` with fields `names` set to `values`, built without `__init__`."""
    # Without __init__ on purpose: JAX rebuilds pytrees with tracers or placeholders as leaves, and callers
    # copy objects whose new values were already checked, so __init__'s validation must not run again.
    obj = object.__new__(cls)
    for n, v in zip(names, values):
        object.__setattr__(obj, n, v)
    return obj


def replace_fields(obj: Any, changes: Mapping[str, Any]) -> Any:
    """A copy of the frozen dataclass `obj` with the fields named in `changes` replaced (other names are
    ignored), built without `__init__` (see `new_frozen`)."""
    names = [f.name for f in dataclasses.fields(obj)]
    return new_frozen(type(obj), names, [changes[n] if n in changes else getattr(obj, n) for n in names])


def fmt_value(v: Any) -> str:
    """A hyperparameter as reprs show it: concrete scalars as plain numbers."""
    if isinstance(v, tuple):
        return "(" + ", ".join(fmt_value(u) for u in v) + ")"
    if isinstance(v, (jax.Array, np.ndarray)) and v.ndim == 0:
        try:
            v = v.item()
        except Exception:  # a tracer: show it as it is
            pass
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (type, np.dtype)):
        return jnp.dtype(v).name
    return repr(v)


def struct_repr(obj: Any) -> str:
    import dataclasses

    # An option left at its default None (`mu_dtype`) is not shown: reprs stay as short as the call that made them.
    args = ", ".join(f"{f.name}={fmt_value(getattr(obj, f.name))}" for f in dataclasses.fields(obj)
                     if not (f.default is None and getattr(obj, f.name) is None))
    return f"{type(obj).__name__}({args})"


def match_positions(paths: Sequence[str], pattern: str, candidates: Sequence[int]) -> list[int]:
    """The candidate positions a path pattern selects, as `freeze`, `adjust` and `by_path` read patterns: the
    leaf at that exact dotted path if the model has one (an exact path means that path only: `"w[0]"`, a dict key
    with brackets, is not the glob that also matches `"w0"`); else the candidates below it as a dotted-path
    prefix (`""`: all of them); else those that fnmatch-match it (`*` also crosses dots)."""
    if pattern in paths:
        keep = set(candidates)
        return [i for i, p in enumerate(paths) if p == pattern and i in keep]
    below = [i for i in candidates if pattern == "" or paths[i].startswith(pattern + ".")]
    return below or [i for i in candidates if fnmatch.fnmatchcase(paths[i], pattern)]
