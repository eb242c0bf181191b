"""The tables that must list the whole package or the whole test folder, each checked against what is there:

- the registry of rule cases (`rule_cases.RULES`): an entry per rule class `optim.__all__` exports, each with an
  optax case or the reason it has none, a ZeRO-1 case for every class, ids unique where they name a model key or
  a test;
- `tests/README.md`: every file of `tests/` (test files and their helpers);
- `docs/concepts/internals.md`'s first table (which module owns what): every module of each private folder of
  `optim/`, in its folder's row.
"""

from __future__ import annotations

import re
from pathlib import Path

import optim
from rule_cases import RULES, classes_in, table

ROOT = Path(__file__).resolve().parent.parent


def exported_rule_classes() -> set:
    return {v for v in (getattr(optim, n) for n in optim.__all__)
            if isinstance(v, type) and issubclass(v, optim.Rule) and v is not optim.Rule}


# ----------------------------------------------------------------------------------------------- the registry
def test_every_exported_rule_class_has_one_registry_entry():
    classes = [r.cls for r in RULES]
    assert len(classes) == len(set(classes)), "a rule class with two entries"
    missing = sorted(c.__name__ for c in exported_rule_classes() - set(classes))
    assert not missing, f"rule classes exported by optim with no entry in rule_cases.RULES: {missing}"


def test_every_rule_has_an_optax_case_or_says_why_not():
    """An entry has `optax` (test_parity.py) or `x64_optax` (test_rules.py) cases, or a `no_optax` reason: one
    of the two, not both (a reason beside cases would be stale)."""
    neither = [r.cls.__name__ for r in RULES if not (r.optax or r.x64_optax) and not r.no_optax.strip()]
    both = [r.cls.__name__ for r in RULES if (r.optax or r.x64_optax) and r.no_optax]
    assert not neither, f"no optax case and no `no_optax` reason: {neither}"
    assert not both, f"optax cases and a `no_optax` reason: {both}"
    assert all(c.reason.strip() for c in table("optax_differs"))


def test_zero1_cases_cover_every_exported_rule_class():
    """`zero1_cases.every_rule()` is the registry's `zero1` cases: every exported class is in one (a stateless
    stage in a chain). `test_zero1.py` checks the same in its subprocess; this fails first, without devices."""
    covered = set().union(*(classes_in(c.make()) for c in table("zero1")))
    missing = sorted(c.__name__ for c in exported_rule_classes() - covered)
    assert not missing, f"rule classes in no `zero1` case of rule_cases.RULES: {missing}"


def test_ids_that_name_a_key_are_unique():
    """The `zero1` ids are the ZeRO-1 model's top-level keys and the `kernel` ids `test_fused.py`'s dictionary
    keys: a repeated id would silently drop a case. The optax ids name tests."""
    for field in ("zero1", "kernel", "optax", "optax_differs", "x64_optax"):
        ids = [c.id for c in table(field)]
        assert len(ids) == len(set(ids)), (field, sorted({i for i in ids if ids.count(i) > 1}))
    assert all(re.fullmatch(r"[A-Za-z]\w*", c.id) for c in table("zero1"))


# ----------------------------------------------------------------------------------------------- tests/README.md
def test_tests_readme_names_every_file_of_the_test_folder():
    text = (ROOT / "tests" / "README.md").read_text()
    files = sorted(p.name for p in (ROOT / "tests").glob("*.py"))
    assert "test_rules.py" in files
    missing = [f for f in files if not re.search(rf"\b{re.escape(f)}\b", text)]
    assert not missing, f"tests/README.md does not name: {missing}"


# ----------------------------------------------------------------------------------------------- internals.md
def _first_table(text: str) -> dict:
    """The rows of the first table of a page: first cell (its backticks removed) -> second cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1]
    return rows


def test_internals_first_table_names_every_module_in_its_folder_row():
    """docs/concepts/internals.md's "Which module owns what": a row per private folder of `optim/`, naming each of
    its modules and sources (`.py` but `__init__.py`, `.cc`, `.h`, `.inc`) in backticks; the package's own modules
    are named on the page too."""
    text = (ROOT / "docs" / "concepts" / "internals.md").read_text()
    rows = _first_table(text)
    package = ROOT / "optim"
    folders = sorted(p for p in package.iterdir() if p.is_dir() and p.name.startswith("_") and p.name != "__pycache__")
    assert {f"{p.name}/" for p in folders} == set(rows), sorted(rows)
    missing = [f"{d.name}/{f.name}" for d in folders for f in sorted(d.iterdir())
               if f.suffix in (".py", ".cc", ".h", ".inc") and f.name != "__init__.py"
               and f"`{f.name}`" not in rows[f"{d.name}/"]]
    assert not missing, f"internals.md's first table does not name: {missing}"
    top = [f.name for f in sorted(package.glob("*.py")) if f"`{f.name}`" not in text and
           f"`optim/{f.name}`" not in text]
    assert not top, f"internals.md does not name: {top}"


def test_the_rules_package_docstring_names_every_rule_module():
    """`optim/_rules/__init__.py` is where a reader of the code starts looking for a rule: it names every module."""
    import optim._rules

    doc = optim._rules.__doc__
    missing = [f.name for f in sorted((ROOT / "optim" / "_rules").glob("*.py"))
               if f.name != "__init__.py" and f"`{f.name}`" not in doc]
    assert not missing, f"optim/_rules/__init__.py's docstring does not name: {missing}"
