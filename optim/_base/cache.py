"""optim's one cache policy: every module-level cache is bounded and evicts the least recently used entry.

`LRU` is the cache; `memoize(maxsize)` caches a function's results in one, by its positional arguments. Each
cache states its size where it is defined, with why that size. A cache that holds compiled functions frees
them when it evicts them, so a long run that keeps meeting new structures does not grow without bound.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable, Hashable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MISSING = object()


class LRU:
    """A mapping of at most `maxsize` entries; storing one more evicts the least recently used (a `get` that
    finds its key, or a store, is a use). Keys must be hashable: `get` and stores raise `TypeError` otherwise,
    as a dict does. Safe to use from several threads."""

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"LRU: maxsize must be at least 1, got {maxsize}")
        self.maxsize = maxsize
        # key -> [value]: each entry is its own list, so `_mru` (the last entry used) is found by identity
        self._data: collections.OrderedDict[Hashable, list] = collections.OrderedDict()
        self._mru: list | None = None
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value stored for `key` (now the most recently used), or `default`."""
        entry = self._data.get(key)
        if entry is None:
            return default
        if entry is not self._mru:   # a hit on the last entry used needs no reordering (saves hashing the key again)
            with self._lock:
                self._mru = entry
                try:
                    self._data.move_to_end(key)
                except KeyError:     # another thread evicted it meanwhile; the value is still valid
                    pass
        return entry[0]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        """Store `value` for `key` as the most recently used entry, evicting the least recently used beyond
        `maxsize`."""
        entry = [value]
        with self._lock:
            self._data[key] = entry
            self._data.move_to_end(key)
            self._mru = entry
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key` is stored (not a use: the order is unchanged)."""
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def values(self) -> list:
        """The stored values, least recently used first."""
        return [entry[0] for entry in list(self._data.values())]

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._mru = None


def memoize(maxsize: int) -> Callable[[F], F]:
    """Decorator: cache `fn`'s results by its (hashable) positional arguments in an `LRU(maxsize)`, which the
    decorated function exposes as `.cache`."""

    def decorate(fn: F) -> F:
        cache = LRU(maxsize)

        @functools.wraps(fn)
        def cached(*args: Hashable) -> Any:
            hit = cache.get(args, _MISSING)
            if hit is _MISSING:
                hit = fn(*args)
                cache[args] = hit
            return hit

        cached.cache = cache   # type: ignore[attr-defined]
        return cached          # type: ignore[return-value]

    return decorate
