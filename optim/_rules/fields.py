"""`optim.fields`: constructors that put a hyperparameter's contract on the field itself.

    class Adam(Rule):
        lr: Hyper = fields.nonneg(0.001)
        beta: tuple[Hyper, Hyper] = fields.unit((0.9, 0.999))
        mu_dtype: Any = fields.static(None)

Each is `dataclasses.field(default=..., metadata={KEY: contract})`. `Rule.__init_subclass__` reads the contracts
(`contract_tuples`) into the class tuples `_static`, `_nonneg`, ... that the constructor, `adjust` and the pytree
registration read. Those tuples are derived, never declared: a class that sets one by hand (the form before
the field markers) is refused, with the field form to write.

A rule's state is a named tuple; its fields that hold a few numbers per parameter, whatever the parameter's
shape, carry the annotation `Small` (`bt: Small`), read by `small_fields`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any

from .._base.cache import memoize

__all__ = ["nonneg", "initial", "unit", "decay", "signed", "count", "steps", "static", "flag", "Small",
           "small_fields"]

KEY = "optim"   # the metadata key; its value is one contract, a key of TUPLES

# contract -> the class tuples that list a field with it (a flag is static too: it picks the program)
TUPLES: dict[str, tuple[str, ...]] = {
    "nonneg": ("_nonneg",), "initial": ("_nonneg", "_initial"), "unit": ("_unit",), "decay": ("_decay",),
    "signed": ("_signed",), "count": ("_counts",), "steps": ("_steps",), "static": ("_static",),
    "flag": ("_static", "_flags"),
}
NAMES = ("_static", "_nonneg", "_initial", "_unit", "_decay", "_signed", "_counts", "_steps", "_flags")
_CONTRACT = {v: k for k, v in TUPLES.items()}   # ("_static", "_flags") -> "flag", ...


def _field(contract: str, default: Any) -> Any:
    return dataclasses.field(default=default, metadata={KEY: contract})


def nonneg(default: Any = dataclasses.MISSING) -> Any:
    """A hyperparameter that is finite and >= 0 (`lr`, `eps`); with a tuple default, each of its numbers."""
    return _field("nonneg", default)


def initial(default: Any = dataclasses.MISSING) -> Any:
    """A value only `init` reads (`Rprop`'s initial step size): finite and >= 0, a number or an array but not a
    schedule, whose values after step 0 would never be read (refused at construction, naming the field).

    >>> import optim
    >>> optim.Rprop._initial
    ('lr',)
    >>> optim.Rprop(lr=optim.Constant(1e-3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: Rprop: lr is read once, by init, so a schedule's values after step 0 would never be read; ...
    """
    return _field("initial", default)


def unit(default: Any = dataclasses.MISSING) -> Any:
    """A decay rate in [0, 1), one a rule bias-corrects for (`beta`); with a tuple default, each number."""
    return _field("unit", default)


def decay(default: Any = dataclasses.MISSING) -> Any:
    """A decay rate in [0, 1], 1 included (`rho`)."""
    return _field("decay", default)


def signed(default: Any = dataclasses.MISSING) -> Any:
    """A hyperparameter that is finite, of any sign (`Scale`'s `f`)."""
    return _field("signed", default)


def count(default: Any = dataclasses.MISSING) -> Any:
    """An integer >= 1, kept an integer (`AccumGrad`'s `n`)."""
    return _field("count", default)


def steps(default: Any = dataclasses.MISSING) -> Any:
    """A number of steps: an integer >= 0, kept an integer (a warmup)."""
    return _field("steps", default)


def static(default: Any = dataclasses.MISSING) -> Any:
    """A structural field (a dtype, a size): fixed at construction, part of the treedef, not a leaf that
    `adjust` could change."""
    return _field("static", default)


def flag(default: Any = dataclasses.MISSING) -> Any:
    """A structural switch (static): True or False, nothing else (a string such as "no" would be true)."""
    return _field("flag", default)


_SMALL = "optim: a few numbers per parameter"

Small = Annotated[Any, _SMALL]
"""The annotation of a state field that holds a few numbers per parameter, whatever the parameter's shape:
`bt: Small` in `AdamState` (the products of the decay rates, 2 per parameter), step counts. A state is a named
tuple, whose fields carry no defaults to mark, so the mark is the field's type. Such leaves are packed, many
parameters' rows in one array (`optim._engine.pack`), also where one parameter's part happens to have the
parameter's shape (a 2-element parameter's `bt`), and the fused CPU kernel reads them only from packs."""


@memoize(1024)
def small_fields(cls: type) -> tuple[str, ...]:
    """The fields of state class `cls` (a named tuple) annotated `Small`, in field order; `()` for a class that
    is not a named tuple."""
    names = getattr(cls, "_fields", None)
    if not isinstance(cls, type) or not issubclass(cls, tuple) or not isinstance(names, tuple):
        return ()
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001 (an annotation that does not resolve: read the text, `Small` or `x.Small`)
        raw = {n: getattr(a, "__forward_arg__", a) for n, a in getattr(cls, "__annotations__", {}).items()}
        marked = {n for n, a in raw.items() if isinstance(a, str) and a.rsplit(".", 1)[-1] == "Small"}
    else:
        marked = {n for n, h in hints.items() if typing.get_origin(h) is Annotated and _SMALL in h.__metadata__}
    return tuple(n for n in names if n in marked)


def declared(cls: type) -> dict[str, str]:
    """`{field name: contract}` of the fields `cls` itself declares with a constructor above; read from the class
    body before the dataclass machinery replaces each `Field` by its default."""
    return {n: v.metadata[KEY] for n, v in vars(cls).items()
            if isinstance(v, dataclasses.Field) and KEY in v.metadata}


def contract_tuples(cls: type, own: dict[str, str], fields: list[str]) -> dict[str, tuple[str, ...]]:
    """The class tuples of `cls`, a dataclass by now, by name: each field's contract is the one declared nearest
    to `cls` (its own `Field`s, else what its bases derived), so a subclass that gives a field a new plain
    default keeps the field's contract, and one that declares another contract replaces it. `own` is
    `declared(cls)`, `fields` the names of its fields (in order: the tuples list them in that order). A class
    that sets a tuple itself is refused: the tuples are derived from the fields."""
    owner = cls.__name__
    by_hand = [a for a in NAMES if a in vars(cls)]
    if by_hand:
        a = by_hand[0]
        names = vars(cls)[a]
        contract = next(c for c, attrs in TUPLES.items() if attrs[-1] == a)
        field = names[0] if names else "name"
        raise TypeError(f"{owner}: the class tuple {a} = {names!r} is not read (the form before the field markers, "
                        f"dropped): declare the contract on each field, `{field}: ... = "
                        f"optim.fields.{contract}(<its default>)`")
    inherited = {a: next((vars(b)[a] for b in cls.__mro__[1:] if a in vars(b)), ()) for a in NAMES}
    merged = {**_inherited(inherited), **own}
    return {a: tuple(n for n in fields if a in TUPLES.get(merged.get(n), ())) for a in NAMES}


def _inherited(tuples: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """`{name: contract}` from a base's derived tuples (a name in a contract's every tuple: a flag in `_static`
    and `_flags`, an initial value in `_nonneg` and `_initial`)."""
    where: dict[str, list[str]] = {}
    for attr in NAMES:
        for n in tuples.get(attr, ()):
            where.setdefault(n, []).append(attr)
    return {n: _CONTRACT[tuple(attrs)] for n, attrs in where.items()}
