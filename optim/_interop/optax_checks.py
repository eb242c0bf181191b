"""What `from_optax` refuses, and why: reading an optax transformation (its components and their names), the
list of known whole-tree transformations with the tie-aware replacement of each, and `check`, which runs the
probes of `optax_probe.py` once per transformation, dtype and number of dimensions.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from .._base.cache import LRU
from .optax_probe import cross_leaf, update_orientation

__all__ = ["WholeTreeError", "optax_module", "normalise", "is_transformation", "transformation_name", "label",
           "check"]


class WholeTreeError(TypeError):
    """An optax transformation that looks at the whole tree was given to `from_optax`."""


_DESTRUCTURE = ("run it with plain optax on the deduplicated parameters instead: `flat, rebuild = "
                "optim.destructure(model)` holds each tied array once, and the loss of `rebuild(flat)` has the "
                "summed gradient")

# optax transformations (the function that builds them) that combine all arrays of the tree, and what to use.
_WHOLE_TREE: dict[str, str] = {
    "clip_by_global_norm": "use optim.ClipGlobalNorm(max_norm) before it in an optim.chain, e.g. "
                           "optim.chain(optim.ClipGlobalNorm(1.0), optim.from_optax(optax.adam(1e-3))): it counts "
                           "each tied parameter once, with its summed gradient",
    "per_example_global_norm_clip": "clip the per-example gradients before calling optim.update",
    "differentially_private_aggregate": "clip the per-example gradients before calling optim.update",
    "apply_if_finite": "use optim.SkipNonFinite(rule), which skips the whole step",
    "skip_not_finite": "use optim.SkipNonFinite(rule), which skips the whole step",
    "skip_large_updates": _DESTRUCTURE,
    "normalize_by_update_norm": _DESTRUCTURE,
    "scale_by_polyak": _DESTRUCTURE,
    "scale_by_lbfgs": _DESTRUCTURE,
    "scale_by_zoom_linesearch": _DESTRUCTURE,
    "scale_by_backtracking_linesearch": _DESTRUCTURE,
    "scale_by_dowg": _DESTRUCTURE,
    "dadapt_adamw": _DESTRUCTURE,
    "prodigy": _DESTRUCTURE,
    "mechanize": _DESTRUCTURE,
    "momo": _DESTRUCTURE,
    "momo_adam": _DESTRUCTURE,
    "sam": _DESTRUCTURE,
    "normalize": _DESTRUCTURE,          # optax.contrib's, used by sam
}


def optax_module():
    try:
        import optax
    except ImportError as e:  # optax is not a dependency of optim itself
        raise ImportError("optim's optax interop needs optax: pip install optax") from e
    return optax


def normalise(tx: Any) -> Any:
    """Any optax transformation as one whose `update` accepts extra keyword arguments."""
    optax = optax_module()
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        return tx
    if hasattr(tx, "gradient_transformation"):          # optax.MultiSteps
        return tx.gradient_transformation()
    if isinstance(tx, optax.GradientTransformation):
        return optax.with_extra_args_support(tx)
    return tx


def is_transformation(tx: Any) -> bool:
    return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def _root_name(fn: Any) -> str | None:
    """`'clip_by_global_norm'` for optax's `clip_by_global_norm.<locals>.update_fn`; None for non-optax code."""
    mod = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None)
    if not mod.startswith("optax") or not isinstance(qual, str):
        return None
    return qual.split(".<locals>")[0].split(".")[0]


def _reachable(root: Any, max_depth: int, *, attributes: bool = True,
               stop: Callable[[Any], bool] = lambda obj: False) -> Iterator[Any]:
    """`root` and the objects reachable from it, depth-first, each once (cycles end), at most `max_depth` steps
    away. optax builds a transformation as functions closing over its settings and inner transformations, so the
    steps are: a function's closure cells, a tuple's or list's items, a dict's values and, with `attributes`, a
    bound method's instance, a partial's function and arguments and an optax object's attributes. An object for
    which `stop` is true is yielded but not looked inside."""
    seen: set = set()

    def walk(obj: Any, depth: int) -> Iterator[Any]:
        if depth > max_depth or id(obj) in seen:
            return
        seen.add(id(obj))
        yield obj
        if not stop(obj):
            for part in _children(obj, attributes):
                yield from walk(part, depth + 1)

    return walk(root, 0)


def _children(obj: Any, attributes: bool) -> Iterator[Any]:
    """The objects one step inside `obj`, for `_reachable`."""
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
        if attributes and isinstance(obj, types.MethodType):
            yield obj.__self__
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield contents
    elif isinstance(obj, (tuple, list)):
        yield from obj
    elif isinstance(obj, dict):
        yield from obj.values()
    elif not attributes:
        return
    elif isinstance(obj, functools.partial):
        yield obj.func
        yield from (*obj.args, *obj.keywords.values())
    elif _is_optax_object(obj):
        yield from vars(obj).values()


def _is_optax_object(obj: Any) -> bool:
    """An instance of a class of optax's with attributes (`MultiSteps`, ...), not a container or partial."""
    return (not isinstance(obj, (functools.partial, tuple, list, dict))
            and (type(obj).__module__ or "").startswith("optax") and hasattr(obj, "__dict__"))


def _optax_names(tx: Any) -> list[str]:
    """Names of the optax builders reachable from a transformation (through closures, chains, wrappers): each
    function's builder (`_root_name`) and each optax object's class."""
    names: list[str] = []
    for obj in _reachable(tx, 10):
        if isinstance(obj, (types.FunctionType, types.MethodType)):
            name = _root_name(obj.__func__ if isinstance(obj, types.MethodType) else obj)
            if name is not None:
                names.append(name)
        elif _is_optax_object(obj):
            names.append(type(obj).__name__)
    return names


def _components(tx: Any) -> list[Any]:
    """The transformations directly inside `tx` (a chain's stages, a wrapper's inner transformation): those
    reachable from `tx.update` through closures and containers, not looking inside them."""
    def inner(obj: Any) -> bool:
        return is_transformation(obj) and not isinstance(obj, type)

    return [obj for obj in _reachable(getattr(tx, "update", None), 3, attributes=False, stop=inner) if inner(obj)]


def transformation_name(tx: Any) -> str:
    """A readable name for a transformation: the optax builder that made it, else its type."""
    upd = getattr(tx, "update", None)
    fn = upd.__func__ if isinstance(upd, types.MethodType) else upd
    qual = getattr(fn, "__qualname__", None)
    if isinstance(upd, types.MethodType):
        return type(tx).__name__
    if isinstance(qual, str):
        return qual.split(".<locals>")[0]
    return type(tx).__name__


def _describe(tx: Any) -> str:
    """`chain(scale_by_adam, scale_by_learning_rate)` for `optax.adam(...)`."""
    name = transformation_name(tx)
    if name in ("chain", "named_chain"):
        return f"{name}({', '.join(_describe(c) for c in _components(tx))})"
    return name


# 1024 checks (per transformation and dtype, and per number of dimensions): a model needs a few; a miss only
# runs the probes again.
_CHECKED = LRU(1024)


def check(rule: Any, x: Any) -> None:
    """Refuse whole-tree transformations and gradient-like ones not declared so (see `from_optax`). The
    dependency check runs once per transformation, dtype and number of dimensions, the orientation check (one
    small compiled update) once per transformation and dtype; both also while `setup` traces `init`."""
    base = (rule.tx, rule.static_kwargs, rule.gradient_like, jnp.dtype(x.dtype))
    key = base + (len(x.shape),)
    if _CHECKED.get(key):
        return
    with jax.ensure_compile_time_eval():   # build and probe concretely
        _check_now(rule, rule.transformation(), x, orient=not _CHECKED.get(base))
    _CHECKED[key] = _CHECKED[base] = True


def label(tx: Any) -> str:
    """How messages and reprs name a wrapped transformation or factory."""
    if is_transformation(tx):
        return _describe(tx)
    return getattr(tx, "__name__", None) or getattr(getattr(tx, "func", None), "__name__", None) or repr(tx)


def _check_now(rule: Any, tx: Any, x: Any, orient: bool = True) -> None:
    name = label(rule.tx)
    known = [n for n in _optax_names(tx) if n in _WHOLE_TREE]
    if known:
        inside = "" if known[0] == name else f" (inside {name})"
        raise WholeTreeError(f"from_optax: optax's {known[0]}{inside} works on the whole tree, but from_optax runs "
                             f"the transformation on each parameter separately, so it would silently compute "
                             f"per-parameter results; {_WHOLE_TREE[known[0]]}")
    shape = tuple(x.shape) if int(np.prod(x.shape)) > 0 else (3,)
    extra = dict(rule.extra_args or {})
    args = (shape, x.dtype, extra, rule.tree_args)
    try:
        cross = cross_leaf(tx, *args)
        orientation = update_orientation(tx, *args) if orient else 0
    except Exception as e:  # the transformation cannot run on single arrays (or needs extra arguments)
        raise TypeError(
            f"from_optax: could not run {name} on single parameters to check that it works per parameter "
            f"({type(e).__name__}: {e}). If it needs extra arguments, give example values with "
            f"extra_args={{...}}; a transformation that needs the whole tree (a loss function, a tree-shaped "
            f"mask or label tree) cannot be wrapped; check=False skips this check") from e
    if cross:
        culprit = name
        for c in _components(tx):
            try:
                if cross_leaf(normalise(c), *args):
                    culprit = f"{label(c)} (inside {name})"
                    break
            except Exception:
                continue
        raise WholeTreeError(
            f"from_optax: {culprit} combines the arrays of the tree (one array's update depends on another's "
            f"values, gradient or state), but from_optax runs it on each parameter separately, so it would "
            f"silently compute per-parameter results; {_DESTRUCTURE}. check=False skips this check (for a "
            f"transformation that only reshapes the tree, such as optax.flatten, wrap its inner one instead)")
    if orientation > 0 and not rule.gradient_like:
        raise TypeError(
            f"from_optax: {name}'s updates point along the gradient, so adding them to the parameters would climb "
            f"the loss: it is a gradient transformation without the final learning-rate stage (like "
            f"optax.scale_by_adam() or optax.clip(1.0)). Give a complete optimiser (e.g. optax.chain(tx, "
            f"optax.scale_by_learning_rate(lr)) or optax.adam(lr)), or, to use it as a stage of an optim chain "
            f"whose step is its output, pass gradient_like=True (check=False skips this check)")
    if orientation < 0 and rule.gradient_like:
        raise TypeError(
            f"from_optax: {name}'s updates point against the gradient (a complete optimiser such as optax.adam(lr), "
            f"whose updates are added to the parameters), but gradient_like=True says they point along it; "
            f"drop gradient_like=True (check=False skips this check)")
