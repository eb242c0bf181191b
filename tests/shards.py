"""`python tests/shards.py [-n N] [--record] [pytest args]`: the whole suite as N pytest processes at once (`make
test`; N defaults to one more than the machine's cores, at most 4).

Most of the suite's time is XLA compiling programs, one thread at a time, so processes at once share the cores;
one more process than cores keeps them busy while a process waits on a subprocess or a file (measured on 2
cores: 3 processes 612 s, 2 processes 654 s, one `pytest` 17-19 min).
Test files are dealt to the processes longest first, each to the least loaded (the times in `durations.json`,
per file, from an earlier run; a file not listed counts as 10 s). Each process writes its report to a file; they
are printed one after the other when all have finished, then one line with the totals. The exit status is the
worst of the processes'. `--record` rewrites `durations.json` from this run's reports (JUnit XML).

Nothing else changes: each process is a plain `pytest` run (the same test paths, conftest and options) told to
`--ignore` the test files dealt to the others; the doctests (`optim/` and the helper modules of `tests/`) run in
the first. Every test runs exactly once (`tests/test_tables.py` checks the split collects what `pytest` does).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
DURATIONS = HERE / "durations.json"
UNKNOWN_S = 10.0
DOCTESTS = "doctests"     # the key of the doctests' time in durations.json


def deal(files: list[str], seconds: dict[str, float], n: int) -> list[list[str]]:
    """`files` in `n` groups of about equal total time: longest first, each to the group with the least so far
    (the first starts with the doctests' time, which it runs)."""
    groups: list[list[str]] = [[] for _ in range(n)]
    load = [seconds.get(DOCTESTS, 0.0)] + [0.0] * (n - 1)
    for f in sorted(files, key=lambda f: (-seconds.get(f, UNKNOWN_S), f)):
        k = load.index(min(load))
        groups[k].append(f)
        load[k] += seconds.get(f, UNKNOWN_S)
    return [sorted(g) for g in groups if g]


def commands(groups: list[list[str]], pytest_args: list[str]) -> list[list[str]]:
    """The pytest command line of each group: all test paths, less the test files of the other groups, and (but
    for the first) less the doctests of `optim/` and of the helper modules in `tests/`."""
    every = [f for g in groups for f in g]
    helpers = sorted(f.name for f in HERE.glob("*.py") if not f.name.startswith("test_") and f.name != "conftest.py")
    out = []
    for k, group in enumerate(groups):
        ignore = [f"tests/{f}" for f in every if f not in group]
        # The others name `tests` alone (`--ignore` does not apply to a path pytest is given, such as the
        # configured test path `optim`).
        paths = ["tests"] if k else []
        if k:
            ignore += [f"tests/{f}" for f in helpers]
        out.append([sys.executable, "-m", "pytest", *pytest_args, *(f"--ignore={p}" for p in ignore), *paths])
    return out


def file_seconds(junit: Path) -> dict[str, float]:
    """Per test file (`test_x.py`), the sum of its tests' times in a JUnit XML report; the doctests' under
    `DOCTESTS`."""
    out: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((m for m in module if m.startswith("test_")), None)
        out[f"{name}.py" if name else DOCTESTS] += float(case.get("time", 0))
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/shards.py", description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=min(4, (os.cpu_count() or 1) + 1), help="pytest processes at once")
    p.add_argument("--record", action="store_true", help="rewrite durations.json from this run")
    args, pytest_args = p.parse_known_args(argv)
    files = sorted(f.name for f in HERE.glob("test_*.py"))
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    groups = deal(files, seconds, max(1, args.n))
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for k, (group, cmd) in enumerate(zip(groups, commands(groups, pytest_args))):
            log, junit = Path(tmp) / f"{k}.log", Path(tmp) / f"{k}.xml"
            cmd = [*cmd, f"--junitxml={junit}"]
            runs.append((group, log, junit, subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                                             cwd=HERE.parent)))
            guess = sum(seconds.get(f, UNKNOWN_S) for f in group) + (seconds.get(DOCTESTS, 0.0) if k == 0 else 0)
            print(f"process {k + 1}: {len(group)} test files{' and the doctests' if k == 0 else ''}, about "
                  f"{guess:.0f} s", flush=True)
        codes, totals, measured = [], defaultdict(int), {}
        for k, (group, log, junit, proc) in enumerate(runs):
            codes.append(proc.wait())
            text = log.read_text()
            print(f"\n===== process {k + 1} of {len(runs)} (exit {codes[-1]}): {' '.join(group)}\n{text}", end="")
            last = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
            for count, what in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?|warnings?)",
                                          last[-1] if last else ""):
                totals[what.rstrip("s") if what.startswith(("error", "warning")) else what] += int(count)
            if junit.exists():
                measured.update(file_seconds(junit))
    summary = ", ".join(f"{v} {k}" for k, v in totals.items())
    print(f"\n===== all {len(runs)} processes: {summary or 'no tests ran'} in {time.monotonic() - start:.0f} s")
    if args.record:
        DURATIONS.write_text(json.dumps({f: round(measured[f], 1) for f in sorted(measured)}, indent=1) + "\n")
    # pytest's exit 5 (no tests collected) in one process is not a failure of the suite.
    return max((c for c in codes if c != 5), default=0)


if __name__ == "__main__":
    sys.exit(main())
