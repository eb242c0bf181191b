"""`python -m bench.soap [--quick] [--rounds N] [--soap PATH] [--out bench/RULES.md]`: optim's SOAP vs the
authors' PyTorch soap.py on this CPU.

Models: `12x256`: 12 matrices of 256 x 256 and their 256-biases (a transformer's same-shaped layers; optim stacks
them: one batched eigh / qr per side); `4x64`: 4 matrices of 64 x 64 and biases. Both optimisers run in float32
with the same hyperparameters (`SOAP(3e-3)`, defaults otherwise: `precondition_frequency=10`, so one step in
ten refreshes the bases). optim's step is `jax.jit(optim.update, donate_argnums=(0, 1))`; torch's is
`opt.step()` after the gradients are assigned, with 1 thread (`torch.set_num_threads(1)`): with its default (one
OpenMP thread per core) torch's threads spin after each step and took the CPU from the candidate timed next
(optim measured 1.2 s a step after it, 25 ms alone), and stalled for up to a second when descheduled on this
loaded machine. Gradients are fixed random arrays, made once per model.

Method: one process; each round times a sample of `reps` steps of every candidate in turn (the order alternates
round by round), a sample of 10 steps covering one refresh; *ratio* is the median over rounds of the per-round
ratio optim / torch (IQR in brackets; lower is faster). *First call*: optim's trace + compile + first two steps
(the first only builds the bases, the second is a full step), torch's first two steps (1 thread), measured once
in this process before the rounds. *State*: the optimiser state's bytes (optim: every array of the `State` once; torch:
every tensor in `opt.state`), and that divided by the parameter bytes. The authors' soap.py is not in this
repository: give its path with `--soap` (see tests/data/make_soap_reference.py for where to get it).

Writes (replaces) the section "SOAP vs the authors' PyTorch soap.py" of `--out`, leaving the others as they are.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import optim

HERE = Path(__file__).resolve().parent
TITLE = "## SOAP vs the authors' PyTorch soap.py (`python -m bench.soap`)"
MODELS = {"12x256": (12, 256), "4x64": (4, 64)}
REPS = 10


def _model(n: int, d: int, seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    params = {f"l{i}.{k}": rng.standard_normal(s).astype(np.float32) * 0.05
              for i in range(n) for k, s in (("w", (d, d)), ("b", (d,)))}
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    return params, grads


def _optim(params: dict, grads: dict):
    model = {k: jnp.asarray(v) for k, v in params.items()}
    g = {k: jnp.asarray(v) for k, v in grads.items()}
    step = jax.jit(optim.update, donate_argnums=(0, 1))
    box = {"state": optim.setup(optim.SOAP(3e-3), model), "model": model}

    def run():
        box["state"], box["model"] = step(box["state"], box["model"], g)

    def block():
        jax.block_until_ready(box["model"])

    def nbytes():
        leaves = {id(a): a for a in jax.tree.leaves(box["state"]) if hasattr(a, "nbytes")}
        return sum(int(a.nbytes) for a in leaves.values())

    return run, block, nbytes, (lambda: None)


def _torch(soap_path: str, params: dict, grads: dict, threads: int | None = None):
    import torch

    spec = importlib.util.spec_from_file_location("authors_soap", soap_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ps = [torch.tensor(v, requires_grad=True) for v in params.values()]
    gs = [torch.tensor(v) for v in grads.values()]
    opt = mod.SOAP(ps, lr=3e-3)

    def run():
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()

    def nbytes():
        seen = {}
        for st in opt.state.values():
            for v in st.values():
                for t in (v if isinstance(v, list) else [v]):
                    for u in (t if isinstance(t, list) else [t]):
                        if isinstance(u, torch.Tensor):
                            seen[id(u)] = u.numel() * u.element_size()
        return sum(seen.values())

    prepare = (lambda: torch.set_num_threads(threads)) if threads else (lambda: None)
    return run, (lambda: None), nbytes, prepare


def measure(name: str, soap_path: str, rounds: int) -> dict:
    n, d = MODELS[name]
    params, grads = _model(n, d)
    pbytes = sum(v.nbytes for v in params.values())
    import torch

    torch.set_num_threads(1)
    cands = {"optim": _optim(params, grads), "torch 1t": _torch(soap_path, params, grads, 1)}
    first = {}
    for k, (run, block, _, prepare) in cands.items():
        prepare()
        t0 = time.perf_counter()
        run()
        run()
        block()
        first[k] = time.perf_counter() - t0
    samples: dict = {k: [] for k in cands}
    names = list(cands)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            run, block, _, prepare = cands[k]
            prepare()
            t0 = time.perf_counter()
            for _ in range(REPS):
                run()
            block()
            samples[k].append((time.perf_counter() - t0) / REPS)
    ratios = {k: np.array(samples["optim"]) / np.array(samples[k]) for k in ("torch 1t",)}
    return {"model": f"{n} matrices {d}x{d} + {n} biases ({pbytes / 1e6:.2f} MB of parameters)", "rounds": rounds,
            "step_ms": {k: 1e3 * float(np.median(v)) for k, v in samples.items()},
            "ratio": {k: [float(np.median(v)), *map(float, np.percentile(v, [25, 75]))] for k, v in ratios.items()},
            "first_s": first, "state_bytes": {k: cands[k][2]() for k in ("optim", "torch 1t")}, "param_bytes": pbytes,
            "load": os.getloadavg()[0]}


def markdown(results: dict, started: str) -> str:
    import torch

    out = [TITLE, "", f"Generated by `python -m bench.soap`, {started}. Machine: {platform.processor() or 'cpu'}, "
           f"cpus {os.cpu_count()}, jax {jax.__version__}, torch {torch.__version__} "
           f"(threads {torch.get_num_threads()}), python {platform.python_version()}.", "",
           __doc__.split("Method: ")[1].split("\n\nWrites")[0].replace("\n", " ").join(("Method: ", "")), "",
           "| model | optim step (ms) | torch step (ms) | optim / torch "
           "| first call optim (s) | torch (s) | state optim (MB) | torch (MB) | state / parameters optim | torch |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results.values():
        s, b, f = r["step_ms"], r["state_bytes"], r["first_s"]
        q = {k: "{:.2f} ({:.2f}–{:.2f})".format(*v) for k, v in r["ratio"].items()}
        out.append(f"| {r['model']} | {s['optim']:.1f} | {s['torch 1t']:.1f} "
                   f"| {q['torch 1t']} | {f['optim']:.2f} | {f['torch 1t']:.2f} "
                   f"| {b['optim'] / 1e6:.2f} | {b['torch 1t'] / 1e6:.2f} "
                   f"| {b['optim'] / r['param_bytes']:.2f}x | {b['torch 1t'] / r['param_bytes']:.2f}x |")
    loads = ", ".join(f"{k}: {r['rounds']} rounds, load average {r['load']:.1f}" for k, r in results.items())
    out += ["", f"Rounds: {loads}.", ""]
    return "\n".join(out)


def write_section(path: Path, text: str) -> None:
    """Replace this benchmark's section of `path` (up to the next `## ` heading), or append it."""
    old = path.read_text() if path.exists() else ""
    if TITLE in old:
        head, rest = old.split(TITLE, 1)
        nxt = rest.find("\n## ")
        tail = rest[nxt + 1:] if nxt >= 0 else ""
        new = head + text + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--soap", default=os.environ.get("SOAP_REFERENCE", "/tmp/authors_soap.py"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="3 rounds of the small model, nothing written")
    ap.add_argument("--out", default=str(HERE / "RULES.md"))
    args = ap.parse_args(argv)
    if not os.path.exists(args.soap):
        raise SystemExit(f"bench.soap: the authors' soap.py is not at {args.soap}; give --soap PATH")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    names = ["4x64"] if args.quick else list(MODELS)
    results = {k: measure(k, args.soap, 3 if args.quick else args.rounds) for k in names}
    text = markdown(results, started)
    print(text)
    if not args.quick:
        write_section(Path(args.out), text)


if __name__ == "__main__":
    main()
