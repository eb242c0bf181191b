"""Field contracts declared on the field (`optim.fields.nonneg(0.1)`, optim/_rules/fields.py) and read by `Rule`.

The new form, the older class tuples (still read, also mixed with the new form), inheritance (a contract goes
with the field's name: a subclass that gives a plain new default keeps it) and the `TypeError`s raised when a
class declares contracts that cannot hold.
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


def test_the_old_form_still_works_and_gives_the_same_class():
    class Old(optim.Rule):
        lr: Any = 0.1
        beta: Any = (0.9, 0.99)
        on: bool = True
        dtype: Any = None
        _static = ("on", "dtype")
        _flags = ("on",)
        _nonneg = ("lr",)
        _unit = ("beta",)

    class New(optim.Rule):
        lr: Any = optim.fields.nonneg(0.1)
        beta: Any = optim.fields.unit((0.9, 0.99))
        on: bool = optim.fields.flag(True)
        dtype: Any = optim.fields.static(None)

    assert tuples(Old) == tuples(New)
    with pytest.raises(ValueError, match="Old: lr must be >= 0"):
        Old(-1.0)
    assert len(jax.tree_util.tree_leaves(Old())) == 3


def test_the_two_forms_mix():
    class Mixed(optim.Rule):
        lr: Any = optim.fields.nonneg(0.1)
        eps: Any = 1e-8
        on: bool = optim.fields.flag(False)
        _nonneg = ("eps",)
        _static = ("on",)       # redundant with flag: accepted

    assert tuples(Mixed) == {"_nonneg": ("lr", "eps"), "_static": ("on",), "_flags": ("on",)}


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


def test_an_old_form_subclass_of_a_new_form_rule_keeps_the_inherited_contracts():
    class More(optim.AdamW):
        scale: Any = 2.0
        _nonneg = ("scale",)
        _static = ("mu_dtype",)

    assert More._nonneg == ("lr", "weight_decay", "eps", "scale")
    assert More._static == ("couple", "mu_dtype", "nu_dtype") and More._flags == ("couple",)


def test_two_contracts_are_refused():
    with pytest.raises(TypeError, match=r"Two: field 'lr' has two contracts \(nonneg on the field, unit in the "
                                        r"class tuples\)"):
        class Two(optim.Rule):
            lr: Any = optim.fields.nonneg(0.1)
            _unit = ("lr",)
    with pytest.raises(TypeError, match=r"Twice: field 'lr' has two contracts \(_nonneg, _unit\)"):
        class Twice(optim.Rule):
            lr: Any = 0.1
            _nonneg = ("lr",)
            _unit = ("lr",)
    with pytest.raises(TypeError, match=r"Both: field 'dtype' has two contracts \(_static, _nonneg\)"):
        class Both(optim.Rule):
            dtype: Any = None
            _static = ("dtype",)
            _nonneg = ("dtype",)


def test_a_flag_must_be_static():
    with pytest.raises(TypeError, match=r"Loose: field 'on' is a flag but not static"):
        class Loose(optim.Rule):
            on: bool = False
            _flags = ("on",)


def test_a_contract_on_a_name_that_is_not_a_field_is_refused():
    with pytest.raises(TypeError, match=r"Typo: 'lrr' declared with a contract but not a field of Typo "
                                        r"\(fields: lr\)"):
        class Typo(optim.Rule):
            lr: Any = 0.1
            _nonneg = ("lrr",)
    with pytest.raises(TypeError, match=r"Bare: 'lr' is a field but has no type annotation"):
        class Bare(optim.Rule):
            lr = optim.fields.nonneg(0.1)
