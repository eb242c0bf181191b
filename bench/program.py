"""`python -m bench.program [--quick] [--out bench/PROGRAM.md]`: the size of one compiled Adam step.

For each workload, lowers and compiles one `optim.Adam` step inside a user's `jax.jit(optim.update,
donate_argnums=(0, 1))` on (state, model, grads), and one `optax.adam` step plus `optax.apply_updates` under
`jax.jit(..., donate_argnums=(0, 1))` on (params, opt_state, grads), as the main bench's `optim jit` and `optax`
candidates (`bench/candidates.py`). From `compiled.as_text()` it counts, in the ENTRY computation only: inputs
(`parameter` instructions), fusions, copies, and other non-trivial instructions, in total and per trainable leaf.
Each row also has the lower + compile wall time: one measurement in a fresh `jax.jit` object, so indicative only.

`--quick` runs 4x16k and 100x1.6k (seconds) and prints the markdown unless `--out` is given; the full run writes
`bench/PROGRAM.md` and the raw rows next to it as `PROGRAM.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import candidates as C
from . import runner, workloads

HERE = Path(__file__).resolve().parent

# Instructions that are no work of their own: inputs, literals, and (un)packing or reinterpreting buffers.
TRIVIAL = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})
CANDIDATES = ["optim jit", "optax"]
QUICK = ["4x16k", "100x1.6k"]
COLUMNS = ["workload", "candidate", "leaves", "inputs", "fusions", "copies", "other ops", "fusions per leaf",
           "copies per leaf", "compile s"]


# ------------------------------------------------------------------------------------------------ HLO text
def _opcode(line: str) -> str | None:
    """The opcode of one HLO instruction line (`[ROOT] %name = <shape> opcode(operands), attrs`), or None."""
    _, sep, rest = line.partition(" = ")
    if not sep:
        return None
    rest = rest.lstrip()
    if rest.startswith("("):
        # A tuple shape: skip to its closing parenthesis (shapes nest; `/*index=5*/` comments hold no parens).
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rest = rest[i + 1:]
                break
        else:
            return None
    else:
        # An array shape has no spaces (`f32[16,16]{1,0}`, TPU layouts `{1,0:T(8,128)}` included).
        _, _, rest = rest.partition(" ")
    rest = rest.lstrip()
    head, paren, _ = rest.partition("(")
    return head.strip() if paren and head.strip() else None


def entry_counts(hlo_text: str) -> dict[str, int]:
    """Counts the instructions of the ENTRY computation of an HLO module's text.

    Args:
      hlo_text: `compiled.as_text()` (or any HLO module text).

    Returns:
      `{"inputs", "fusions", "copies", "other", "instructions"}`: `parameter`, `fusion` and `copy` instructions,
      the remaining ones except constant, tuple, get-tuple-element and bitcast, and all instructions.
    """
    counts = {"inputs": 0, "fusions": 0, "copies": 0, "other": 0, "instructions": 0}
    in_entry = False
    for line in hlo_text.splitlines():
        s = line.strip()
        if not in_entry:
            # Only the header line of the entry starts with `ENTRY` (fused computations come before it).
            in_entry = s.startswith("ENTRY ") and s.endswith("{")
            continue
        if s == "}":
            break
        op = _opcode(s)
        if op is None:
            continue
        counts["instructions"] += 1
        if op == "parameter":
            counts["inputs"] += 1
        elif op == "fusion":
            counts["fusions"] += 1
        elif op == "copy":
            counts["copies"] += 1
        elif op not in TRIVIAL:
            counts["other"] += 1
    if not in_entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return counts


# ------------------------------------------------------------------------------------------------ programs
def _leaves(n: int, shape: tuple[int, ...]) -> tuple[dict, dict]:
    """A model of `n` distinct float32 leaves and its gradients (values do not matter: only compiled)."""
    import jax

    rng = np.random.default_rng(0)
    model = {"layers": [{"w": jax.device_put(rng.standard_normal(shape, np.float32) * np.float32(0.02))}
                        for _ in range(n)]}
    grads = {"layers": [{"w": jax.device_put(rng.standard_normal(shape, np.float32) * np.float32(1e-3))}
                        for _ in range(n)]}
    return model, grads


def _workload(name: str) -> Callable[[], tuple[Any, Any]]:
    def build():
        wl = workloads.build(name)
        return wl.model, wl.grads
    return build


# name -> () -> (model, grads). 1000x16k and tied-lm are the main bench's (full size); the others have no
# workload there at these sizes. 16k = (128, 128) and 1.6k = (40, 40), as in `bench/workloads.py`.
WORKLOADS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "4x16k": lambda: _leaves(4, (128, 128)),
    "1000x16k": _workload("1000x16k"),
    "100x1.6k": lambda: _leaves(100, (40, 40)),
    "3000x1.6k": lambda: _leaves(3000, (40, 40)),
    "tied-lm": _workload("tied-lm"),
}


def _n_params(tree) -> int:
    """Distinct leaves: optim takes one array object at several positions as one parameter (a tie)."""
    import jax

    return len({id(x) for x in jax.tree.leaves(tree)})


def optim_program(model, grads) -> tuple[Any, float, int]:
    """`(compiled, lower + compile seconds, parameters)` for one Adam step of optim inside a user's jit."""
    import jax
    import optim

    state = optim.setup(optim.Adam(C.LR), model)
    n = _n_params(model)
    # As the `optim jit` candidate: a tied model's positions become distinct buffers so they could be donated.
    state, model = C.unalias((state, model))
    # A fresh function object: jax caches traces per function, and each measurement should trace anew.
    fn = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = fn.lower(state, model, grads).compile()
    return compiled, time.perf_counter() - t0, n


def optax_program(model, grads) -> tuple[Any, float, int]:
    """`(compiled, lower + compile seconds, parameters)` for one `optax.adam` step + `apply_updates` under jit."""
    import jax
    import optax

    tx = optax.adam(C.LR)
    # As the `optax` candidate: tied positions are separate parameters for optax.
    params = C.unalias(C._copy_tree(model))
    opt_state = tx.init(params)

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    fn = jax.jit(step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = fn.lower(params, opt_state, grads).compile()
    return compiled, time.perf_counter() - t0, _n_params(params)


PROGRAMS = {"optim jit": optim_program, "optax": optax_program}


def measure(candidate: str, model, grads) -> dict:
    """One row: the entry counts of `candidate`'s compiled step, per leaf too, and its compile time."""
    compiled, seconds, n = PROGRAMS[candidate](model, grads)
    row: dict[str, Any] = {"candidate": candidate, "leaves": n, **entry_counts(compiled.as_text())}
    row.update(fusions_per_leaf=row["fusions"] / n, copies_per_leaf=row["copies"] / n,
               kernels_per_leaf=(row["fusions"] + row["copies"] + row["other"]) / n, compile_s=seconds)
    return row


def run(names: list[str], log=print) -> list[dict]:
    """Measures every candidate on every named workload (in this process, one after another)."""
    import gc

    rows = []
    for name in names:
        model, grads = WORKLOADS[name]()
        for cand in CANDIDATES:
            row = {"workload": name, **measure(cand, model, grads)}
            rows.append(row)
            log(f"{name:>10} {cand:>9}: {row['fusions']} fusions, {row['copies']} copies, {row['other']} other, "
                f"{row['compile_s']:.2f} s", flush=True)
            gc.collect()           # drop the executable before the next compile (3000-leaf programs are large)
        del model, grads
    return rows


# ------------------------------------------------------------------------------------------------ report
def render(rows: list[dict], meta: dict) -> str:
    """The markdown table with its header."""
    optim = meta["optim"]
    if meta.get("optim_end", optim) != optim:
        optim += f" (optim/ changed to {meta['optim_end']} during the run)"
    out = ["# Compiled program size: one Adam step, optim vs optax", "",
           "Generated by `python -m bench.program` (do not edit; notes go in `bench/NOTES.md`). Each row compiles",
           "one float32 Adam step with `jax.jit(...).lower(...).compile()`: `optim jit` = `optim.update` inside",
           "`jax.jit(..., donate_argnums=(0, 1))` on (state, model, grads); `optax` = `optax.adam` update +",
           "`optax.apply_updates` under `jax.jit(..., donate_argnums=(0, 1))` on (params, opt_state, grads).",
           "Counted in the ENTRY computation of `compiled.as_text()` only (the top-level program: each fusion, copy",
           "or other op is one kernel at run time; the bodies of fused computations are not counted): *inputs* =",
           "`parameter` instructions; *fusions* = `fusion`; *copies* = `copy`; *other ops* = every other instruction",
           "except parameter, constant, tuple, get-tuple-element and bitcast. *leaves* = the parameters the candidate",
           "updates (a tied array counts once for optim, once per position for optax); the per-leaf columns divide",
           "by it. *compile s* = lower + compile wall time, one measurement in a fresh `jax.jit` object, all rows in",
           "one process in table order (indicative only; the machine is shared).",
           "",
           f"Measured {meta['date']}: optim {optim}, jax {meta['jax']}, jaxlib {meta['jaxlib']}, "
           f"optax {meta['optax']}, backend {meta['backend']}, load average {meta['loadavg'][0]:.1f} -> "
           f"{meta['loadavg'][1]:.1f}.",
           "",
           "| " + " | ".join(COLUMNS) + " |",
           "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
    for r in rows:
        cells = [r["workload"], r["candidate"], r["leaves"], r["inputs"], r["fusions"], r["copies"], r["other"],
                 f"{r['fusions_per_leaf']:.2f}", f"{r['copies_per_leaf']:.2f}", f"{r['compile_s']:.2f}"]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def metadata() -> dict:
    from importlib.metadata import version

    import jax

    return {"date": runner._now(), "optim": runner.optim_version(), "jax": version("jax"),
            "jaxlib": version("jaxlib"), "optax": version("optax"), "backend": jax.default_backend(),
            "loadavg": [os.getloadavg()[0]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.program", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} (seconds)")
    ap.add_argument("--out", default=None, help="markdown output (default bench/PROGRAM.md; quick: stdout unless "
                                                "given); the raw rows go next to it as .json")
    opts = ap.parse_args(argv)
    out = opts.out if opts.out is not None or opts.quick else str(HERE / "PROGRAM.md")
    meta = metadata()
    rows = run(QUICK if opts.quick else list(WORKLOADS), log=lambda *a, **k: print(*a, file=sys.stderr, **k))
    meta["loadavg"].append(os.getloadavg()[0])
    meta["optim_end"] = runner.optim_version()    # another checkout's edits mid-run would change what is measured
    runner.write_report(None if out is None else Path(out), render(rows, meta), {"meta": meta, "rows": rows},
                        log=lambda m: print(m, file=sys.stderr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
