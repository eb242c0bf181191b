"""Tie groups: which leaf positions of a model are one parameter.

Positions holding the same array object when `setup` runs are tied (JAX's `jit` would split them into separate
buffers, so identity is only meaningful outside `jit`). Explicit ties `{path: canonical_path}` add more. The
canonical member of a group is the target of an explicit tie if there is one, else the first in flatten order.
"""

from __future__ import annotations

from typing import Any, Mapping

from ._tree import describe, show


def tie_groups(paths: list[str], leaves: list[Any], trainable: list[bool],
               ties: Mapping[str, str] | None = None) -> dict[int, tuple[int, ...]]:
    """Map each canonical position to its group's positions (canonical first, then flatten order)."""
    parent = {i: i for i, t in enumerate(trainable) if t}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_by_id: dict[int, int] = {}
    for i in parent:
        j = first_by_id.setdefault(id(leaves[i]), i)
        if j != i:
            parent[find(i)] = find(j)

    targets: set[int] = set()
    if ties:
        index = {p: i for i, p in enumerate(paths)}
        for src, dst in ties.items():
            if not isinstance(dst, str):
                raise TypeError(f"ties[{src!r}]: expected a dotted path string, got {type(dst).__name__} "
                                "(transformed ties such as (path, jnp.transpose) are not supported yet)")
            for p in (src, dst):
                if p not in index:
                    raise ValueError(f"ties: {show(p)} is not a leaf of the model")
                if not trainable[index[p]]:
                    raise ValueError(f"ties: {show(p)} is not trainable ({describe(leaves[index[p]])}); "
                                     "only floating or complex arrays can be tied")
            a, b = leaves[index[src]], leaves[index[dst]]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"ties: {show(src)} ({describe(a)}) and {show(dst)} ({describe(b)}) "
                                 "must have the same shape and dtype to be one parameter")
            parent[find(index[src])] = find(index[dst])
            targets.add(index[dst])

    groups: dict[int, list[int]] = {}
    for i in parent:
        groups.setdefault(find(i), []).append(i)
    out = {}
    for members in groups.values():
        explicit = [i for i in members if i in targets and not _is_source(i, ties, paths)]
        canon = min(explicit) if explicit else min(members)
        out[canon] = (canon,) + tuple(i for i in members if i != canon)
    return dict(sorted(out.items()))


def _is_source(i: int, ties: Mapping[str, str] | None, paths: list[str]) -> bool:
    return bool(ties) and paths[i] in ties
