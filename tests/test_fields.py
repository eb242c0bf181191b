"""Field contracts declared on the field (`optim.fields.nonneg(0.1)`, optim/_rules/fields.py) and read by `Rule`.

The field form, inheritance (a contract goes with the field's name: a subclass that gives a plain new default
keeps it) and the `TypeError`s raised when a class declares contracts the old way (class tuples, dropped) or on
a name that is not a field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import optim
from optim._rules.fields import KEY

TUPLES = ("_static", "_nonneg", "_unit", "_decay", "_signed", "_counts", "_steps", "_flags")


def tuples(cls) -> dict[str, tuple[str, ...]]:
    return {a: getattr(cls, a) for a in TUPLES if getattr(cls, a)}


class Every(optim.Rule):
    """One field of each contract."""

    lr: Any = optim.fields.nonneg(0.1)
    beta: Any = optim.fields.unit((0.9, 0.99))
    rho: Any = optim.fields.decay(0.5)
    f: Any = optim.fields.signed(-1.0)
    n: Any = optim.fields.count(2)
    warmup: Any = optim.fields.steps(0)
    dtype: Any = optim.fields.static(None)
    on: bool = optim.fields.flag(True)
    plain: Any = 3

    def apply(self, state, x, dx, *dxs):
        return state, self.lr * dx


def test_each_contract_lands_in_its_tuple():
    assert tuples(Every) == {"_static": ("dtype", "on"), "_nonneg": ("lr",), "_unit": ("beta",),
                             "_decay": ("rho",), "_signed": ("f",), "_counts": ("n",), "_steps": ("warmup",),
                             "_flags": ("on",)}
    assert Every._tuples == {"beta": (0.9, 0.99)}
    assert dataclasses.fields(Every)[0].metadata[KEY] == "nonneg"


def test_the_new_form_checks_converts_and_keeps_static_fields_out_of_the_leaves():
    r = Every(lr=1, n=3, warmup=4)
    assert r.lr == 1.0 and isinstance(r.lr, float) and r.n == 3 and isinstance(r.n, int) and r.plain == 3.0
    # the repr shows the values, not the Field objects (and leaves out an option at its default None)
    assert repr(Every()) == "Every(lr=0.1, beta=(0.9, 0.99), rho=0.5, f=-1, n=2, warmup=0, on=True, plain=3)"
    leaves, treedef = jax.tree_util.tree_flatten(Every())
    assert len(leaves) == 8 and jax.tree_util.tree_unflatten(treedef, leaves) == Every()   # dtype, on: static
    assert Every(on=False) != Every() and jax.tree_util.tree_structure(Every(on=False)) != treedef
    for bad, match in [(dict(lr=-1.0), "Every: lr must be >= 0 and finite, got -1.0"),
                       (dict(beta=(0.9, 1.0)), r"Every: beta\[1\] must be in \[0, 1\) and finite"),
                       (dict(rho=1.5), r"Every: rho must be in \[0, 1\]"),
                       (dict(f=float("inf")), "Every: f must be a number and finite, got inf")]:
        with pytest.raises(ValueError, match=match):
            Every(**bad)
    with pytest.raises((TypeError, ValueError), match="Every: n"):
        Every(n=0)
    with pytest.raises(TypeError, match="Every: on"):
        Every(on="no")
    x = jnp.array([1.0, 2.0])
    state = optim.setup(Every(), x)
    with pytest.raises(ValueError, match="Every: lr must be >= 0"):
        optim.adjust(state, lr=-0.5)
    assert optim.adjust(state, lr=0.5).rule.lr == 0.5


@pytest.mark.parametrize("attr, names, contract", [("_nonneg", ("lr",), "nonneg"), ("_static", ("dtype",), "static"),
                                                   ("_flags", ("on",), "flag"), ("_unit", ("beta",), "unit"),
                                                   ("_initial", ("lr",), "initial"), ("_counts", ("n",), "count")])
def test_a_class_tuple_is_refused_with_the_field_form(attr, names, contract):
    """The class tuples are derived from the fields; set by hand (the form before the field markers) they are
    refused, and the message gives the field form to write."""
    body = {"__annotations__": {n: Any for n in names}, **{n: 0.1 for n in names}, attr: names}
    with pytest.raises(TypeError, match=rf"Old: the class tuple {attr} = \('{names[0]}',\) is not read .*"
                                        rf"`{names[0]}: \.\.\. = optim\.fields\.{contract}\(<its default>\)`"):
        type("Old", (optim.Rule,), body)
    # Beside field markers too, and in a subclass of a rule declared with them.
    with pytest.raises(TypeError, match=r"Mixed: the class tuple _nonneg"):
        class Mixed(optim.Rule):
            lr: Any = optim.fields.nonneg(0.1)
            eps: Any = 1e-8
            _nonneg = ("eps",)
    with pytest.raises(TypeError, match=r"More: the class tuple _static"):
        class More(optim.AdamW):
            _static = ("mu_dtype",)


def test_a_subclass_inherits_the_contracts_by_name():
    class Faster(optim.Adam):
        lr: Any = 0.01      # a plain new default: still nonneg

    assert tuples(Faster) == tuples(optim.Adam)
    assert Faster().lr == 0.01 and Faster().mu_dtype is None
    with pytest.raises(ValueError, match="Faster: lr must be >= 0 and finite, got -1.0"):
        Faster(-1.0)
    assert jax.tree_util.tree_structure(Faster()).num_leaves == 4   # lr, beta pair, eps; not the dtypes

    class Signed(optim.Adam):
        lr: Any = optim.fields.signed(-0.01)     # a new contract replaces the inherited one

    assert Signed._signed == ("lr",) and Signed._nonneg == ("eps",) and Signed(-1.0).lr == -1.0

    class Extra(optim.AdamW):
        gamma: Any = optim.fields.decay(0.5)

    assert Extra._static == optim.AdamW._static and Extra._flags == ("couple",) and Extra._decay == ("gamma",)
    assert Extra._nonneg == optim.AdamW._nonneg and Extra._tuples == {"beta": (0.9, 0.999)}


def test_a_subclass_adds_contracts_and_keeps_the_inherited_ones():
    class More(optim.AdamW):
        scale: Any = optim.fields.nonneg(2.0)

    assert More._nonneg == ("lr", "weight_decay", "eps", "scale")
    assert More._static == optim.AdamW._static and More._flags == ("couple",)
    with pytest.raises(ValueError, match="More: scale must be >= 0"):
        More(scale=-1.0)


def test_a_contract_on_a_name_without_an_annotation_is_refused():
    with pytest.raises(TypeError, match=r"Bare: 'lr' is a field but has no type annotation"):
        class Bare(optim.Rule):
            lr = optim.fields.nonneg(0.1)
