"""Tie groups: which leaf positions of a model are one parameter.

Positions holding the same array object when `setup` runs are tied (JAX's `jit` would split them into separate
buffers, so identity is only meaningful outside `jit`). Explicit ties `{path: canonical_path}` add more. The
canonical member of a group is the target of an explicit tie if there is one, else the first in flatten order.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .._base.tree import describe, show, suggest, unique_index


def tie_groups(paths: Any, leaves: list[Any], trainable: list[bool],
               ties: Mapping[str, str] | None = None) -> dict[int, tuple[int, ...]]:
    """Map each canonical position to its group's positions (canonical first, then flatten order)."""
    groups = identity_groups(leaves, trainable)
    if not ties:
        return {c: tuple(m) for c, m in groups.items()}
    return _merge_explicit(groups, paths, leaves, trainable, ties)


def identity_groups(leaves: Sequence[Any], trainable: Sequence[bool]) -> dict[int, list[int]]:
    """The trainable positions grouped by object identity: each group's first position (in flatten order) maps to
    all of its positions, in flatten order; groups in the order of their first positions."""
    first: dict[int, int] = {}
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trainable):
        if t:
            groups.setdefault(first.setdefault(id(leaves[i]), i), []).append(i)
    return groups


def _merge_explicit(groups: dict[int, list[int]], paths: Any, leaves: list[Any], trainable: list[bool],
                    ties: Mapping[str, str]) -> dict[int, tuple[int, ...]]:
    parent = {i: c for c, members in groups.items() for i in members}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    index = unique_index(paths)
    targets: set[int] = set()
    for src, dst in ties.items():
        tie_positions(index, leaves, trainable, src, dst)
        a, b = leaves[index[src]], leaves[index[dst]]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"ties: {show(src)} ({describe(a)}) and {show(dst)} ({describe(b)}) "
                             "must have the same shape and dtype to be one parameter")
        parent[find(index[src])] = find(index[dst])
        targets.add(index[dst])

    merged: dict[int, list[int]] = {}
    for i in sorted(parent):
        merged.setdefault(find(i), []).append(i)
    out = {}
    for members in merged.values():
        explicit = [i for i in members if i in targets and paths[i] not in ties]
        canon = min(explicit) if explicit else members[0]
        out[canon] = (canon,) + tuple(i for i in members if i != canon)
    return dict(sorted(out.items()))


def tie_positions(index: Mapping[str, int], leaves: list[Any], trainable: list[bool], *paths: str) -> list[int]:
    """The positions of the paths named in a tie, each of which must be a trainable leaf of the model."""
    out = []
    for p in paths:
        if p not in index:
            raise ValueError(f"ties: {show(p)} is not a leaf of the model{suggest(p, list(index))}")
        if not trainable[index[p]]:
            raise ValueError(f"ties: {show(p)} is not trainable ({describe(leaves[index[p]])}); "
                             "only floating or complex arrays can be tied")
        out.append(index[p])
    return out
