"""`python -m bench [--quick] [--only ...] [--rounds N] [--timeout S] ...`: see `bench/__init__.py`."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

from . import candidates as C
from . import report, runner
from .workloads import ORDER, canonical

HERE = Path(__file__).resolve().parent
SECTIONS = ORDER + ["overhead", "setup"]
DEFAULT_SKIP: list[str] = []


def parse(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="Adam step benchmarks: optim vs optax vs torch, interleaved in one process per workload.")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, few rounds, a few seconds: 1000x16k and tied-lm shrunk, overhead, setup, "
                         "all in one "
                         "process plus two first-call processes; checks that the suite runs (numbers meaningless)")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated sections to run: {', '.join(SECTIONS)} (aliases big, medium, many, "
                         "tied, untied); default all")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
    ap.add_argument("--candidates", default=None,
                    help=f"comma-separated candidates (default all available): {', '.join(C.ALL)}; "
                         "optax and probe are always added (ratios need them)")
    ap.add_argument("--first", default=None,
                    help="candidates that get a first-call/RSS subprocess (default: all that run)")
    ap.add_argument("--no-torch", action="store_true", help="leave the torch candidates out")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads for the torch candidates (default: torch's own, = cores). On a "
                         "busy machine, 2 OpenMP threads on 2 cores can be 10x slower than 1")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per workload (default 15; quick 3)")
    ap.add_argument("--target", type=float, default=None,
                    help="seconds per timed sample (default 0.2; quick 0.005)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds allowed per first-call subprocess (default 400; quick 60); the step process "
                         "gets a budget derived from the measured first calls")
    ap.add_argument("--out", default=None,
                    help="markdown output (default bench/RESULTS.md; quick: none unless given). The raw results "
                         "go next to it as .json, and a partial run merges into them")
    ap.add_argument("--fresh", action="store_true", help="discard previously saved sections instead of merging")
    ap.add_argument("--render", action="store_true",
                    help="measure nothing: re-render the markdown from the saved .json (e.g. after editing NOTES.md)")
    a = ap.parse_args(argv)
    a.rounds = a.rounds or (3 if a.quick else 15)
    a.target = a.target or (0.005 if a.quick else 0.2)
    a.timeout = a.timeout or (60.0 if a.quick else 400.0)
    if a.out is None and not a.quick:
        a.out = str(HERE / "RESULTS.md")
    return a


def _sections(opts) -> list[str]:
    def norm(s):
        return s if s in ("overhead", "setup") else canonical(s)

    default = ["1000x16k", "tied-lm", "overhead", "setup"] if opts.quick else SECTIONS
    chosen = default if opts.only is None else [norm(s.strip()) for s in opts.only.split(",") if s.strip()]
    skip = {norm(s.strip()) for s in opts.skip.split(",") if s.strip()}
    return [s for s in SECTIONS if s in chosen and s not in skip]


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.torch_threads:
        os.environ["BENCH_TORCH_THREADS"] = str(opts.torch_threads)
    t_start = time.perf_counter()
    log = (lambda m: print(m, flush=True))
    names = C.available(None if opts.candidates is None else opts.candidates.split(","), torch=not opts.no_torch)
    for must in (C.REFERENCE, "probe"):
        if must not in names:
            names.append(must)
    if opts.first is not None:
        opts.first = set(opts.first.split(","))
    if not C.torch_available() and not opts.no_torch:
        log("torch is not importable: torch candidates skipped (pip install torch==2.13.0 for them)")

    sections = {}
    chosen = [] if opts.render else _sections(opts)
    if opts.quick:
        log(f"quick: {', '.join(chosen)} (tiny sizes; the numbers mean nothing)")
        sections.update(runner.run_quick([s for s in chosen if s in ORDER], names, opts, log))
        chosen = []
    for s in chosen:
        log(f"[{time.perf_counter() - t_start:6.1f} s] {s}")
        if s == "overhead":
            sections[s] = runner.run_overhead(opts, log)
        elif s == "setup":
            sections[s] = runner.run_setup(opts, log)
        else:
            sections.update(runner.run_workloads([s], names, opts, log))

    data = {"sections": {}}
    out = Path(opts.out) if opts.out else None
    if out is not None and not opts.fresh:
        data = runner.load(out.with_suffix(".json")) or data
    data["sections"].update(sections)
    if not opts.render:
        data["machine"] = runner.machine_info()
        data["date"] = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        data["command"] = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    notes = HERE / "NOTES.md"
    data["notes"] = notes.read_text() if notes.exists() and not opts.quick else ""
    md = report.render(data)
    runner.write_report(out, md, data, log)
    log(f"total {time.perf_counter() - t_start:.1f} s")
    bad = [s for s, sec in sections.items() if "rows" not in sec]
    if bad:
        log(f"sections without results: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
