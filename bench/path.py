"""`python -m bench.path`: which of optim's files one eager `update` enters, first call and later call.

For a small model with one tie (`{"emb": w, "head": w, "b": ..., "c": ...}`) and each rule given, `sys.setprofile`
records the Python calls whose code is in a file under `optim/` during one `update` that plans, traces and
compiles (the first call of a structure) and one that only looks the plan up (a later call). *files*: the
distinct files entered; *moves*: the calls whose file differs from the previous recorded call's; *functions*:
the distinct functions called (comprehensions count as functions, as Python runs them as such).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

RULES = ("Adam", "RMSProp", "AdaGrad")


def trace(fn: Callable[[], Any], root: str) -> dict:
    """`fn()`'s calls into files under `root`: `{"files": sorted relative paths, "moves": int, "functions": int}`."""
    files: set = set()
    functions: set = set()
    moves, last = 0, None

    def profile(frame, event, arg):
        nonlocal moves, last
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        rel = os.path.relpath(frame.f_code.co_filename, root)
        files.add(rel)
        functions.add((rel, frame.f_code.co_name, frame.f_code.co_firstlineno))
        moves += rel != last
        last = rel

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {"files": sorted(files), "moves": moves, "functions": len(functions)}


def measure(rule_name: str) -> dict:
    """The first and a later eager `update` of the small tied model with `optim.<rule_name>()`."""
    import jax
    import jax.numpy as jnp

    import optim

    root = os.path.dirname(optim.__file__) + os.sep
    w = jnp.ones(3)
    # A structure of its own per rule name (the plan cache would otherwise make a first call a later one).
    model = {"emb": w, "head": w, "b": jnp.zeros(2), "c": jnp.zeros((2, len(rule_name)))}
    state = optim.setup(getattr(optim, rule_name)(), model)
    grads = jax.tree.map(jnp.ones_like, model)
    out: list = []
    first = trace(lambda: out.append(optim.update(state, model, grads)), root)
    state, model = out[0]
    later = trace(lambda: optim.update(state, model, grads), root)
    return {"rule": rule_name, "first": first, "later": later}


def table(rows: list[dict]) -> str:
    """Two tables, the first call's and a later call's: one of seven columns would not fit the docs' column."""
    out = []
    for call in ("first", "later"):
        out += [f"| {call} call | files | moves | functions |", "| --- | ---: | ---: | ---: |"]
        out += [f"| {r['rule']} | {len(r[call]['files'])} | {r[call]['moves']} | {r[call]['functions']} |"
                for r in rows]
        out.append("")
    return "\n".join(out).rstrip("\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.path", description=__doc__.splitlines()[0])
    p.add_argument("--rules", nargs="*", default=list(RULES))
    p.add_argument("--files", action="store_true", help="also list the files a later call enters")
    args = p.parse_args(argv)
    rows = [measure(r) for r in args.rules]
    print(table(rows))
    if args.files:
        for r in rows:
            print(f"{r['rule']}, later call: {', '.join(r['later']['files'])}")


if __name__ == "__main__":
    main()
