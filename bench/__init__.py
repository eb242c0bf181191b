"""Benchmark suite for `optim` (issue 5): Adam steps side by side with optax and torch.

Run from the repository root:

    python -m bench                      # everything; writes bench/RESULTS.md (+ RESULTS.json)
    python -m bench --quick              # tiny sizes, a few seconds; the test suite runs this
    python -m bench --only 1x16M,tied    # some sections; merged into the saved results
    python -m bench --skip many          # all but the slow-compiling 10000-leaf workload
    python -m bench --only many --timeout 300 --rounds 7

Needs jax, optax and optim; torch==2.13.0 (CPU) is optional (its candidates are skipped without it).
Layout: `workloads` (models), `candidates` (the Adam steps), `worker` (child-process measurements),
`runner` (orchestration, timeouts, ratios), `report` (markdown). `NOTES.md`, if present, is appended to
RESULTS.md (hand-written analysis that survives regeneration).
"""
