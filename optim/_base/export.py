"""optim's pytree types registered for `jax.export`'s serialization of a program's input and output trees.

`jax.export` writes the tree structure of an exported function's arguments and results (a train step's takes
and returns an optim `State`, whose leaves sit under the rules, the stored state and their named tuples). Each
node type in it must be registered under a stable name. optim registers its own: the state, every `Rule` and
`Schedule` subclass (a user's too, when it is defined), and the named tuples of the rules' states. A user rule
whose state is a named tuple of its own registers it with `jax.export.register_namedtuple_serialization`.

The static part of a node (a rule's structural options, the state's `Layout` with the model's tree structure)
is written with `pickle`: read an exported train step only from a source you would unpickle from.
"""

from __future__ import annotations

import logging
import pickle

import jax

__all__ = ["register_for_export"]

_log = logging.getLogger("optim")


def register_for_export(cls: type) -> type:
    """Register the pytree class `cls` for `jax.export` under `optim:<module>.<qualname>` (a named tuple by its
    fields, another class with its static data pickled). A class defined again under the same name (a notebook
    cell run twice) takes the name over from the older one, as its name in the module does."""
    name = f"optim:{cls.__module__}.{cls.__qualname__}"
    try:
        _register(cls, name)
    except ValueError:       # the name is taken: by an older definition of the class
        from jax._src.export import _export as registries    # jax has no public way to unregister
        old = registries.deserialization_registry.pop(name)[0]
        registries.serialization_registry.pop(old, None)
        _log.debug("optim: %s registered for jax.export in place of an older class of that name", name)
        _register(cls, name)
    return cls


def _register(cls: type, name: str) -> None:
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        jax.export.register_namedtuple_serialization(cls, serialized_name=name)
    else:
        jax.export.register_pytree_node_serialization(
            cls, serialized_name=name, serialize_auxdata=pickle.dumps, deserialize_auxdata=pickle.loads)
