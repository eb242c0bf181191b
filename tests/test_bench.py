"""The benchmark suite runs (quick mode: tiny sizes, seconds), so it cannot rot. Speed is never asserted here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick_mode_runs(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--no-torch", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    for row in ("optim eager", "optim jit", "optax", "probe"):
        assert f"| {row} |" in text, row
    assert (tmp_path / "RESULTS.json").exists()


def test_bench_rules_quick_mode_runs(tmp_path):
    """`python -m bench.rules --quick` on one of its sections (Adafactor; the Muon, bfloat16 and 1000x16k sections
    run the same code on other rules and sizes and add ~13 s each): every row, with finite numbers, and the
    numerical check (optim against optax, 3 steps on an untied model) passed."""
    import json
    import math

    out = tmp_path / "RULES.md"
    proc = subprocess.run([sys.executable, "-m", "bench.rules", "--quick", "--only", "adafactor",
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "RULES.json").read_text())
    assert set(data["sections"]) == {"adafactor"}

    def finite(v):
        if isinstance(v, (list, tuple)):
            return all(finite(x) for x in v)
        return isinstance(v, (int, float)) and math.isfinite(v)

    for name, sec in data["sections"].items():
        rows = sec["rows"]
        assert sorted(rows) == sorted(sec["expected_rows"]) and len(rows) >= 5, (name, sorted(rows))
        for cand, row in rows.items():
            assert "error" not in row, (name, cand, row)
            ratios = [k for k in row if k.startswith("vs_") and not k.endswith("_iqr")]
            assert ratios, (name, cand)
            need = ["step_s", "state_ratio", *ratios, *(f"{k}_iqr" for k in ratios)]
            if cand in sec["first_candidates"]:
                need += ["first_s", "peak_rss_mb"]
            for k in need:
                assert finite(row.get(k)), (name, cand, k, row.get(k))
        checks = sec["raw"]["checks"]
        assert checks, name
        for c in checks:
            assert finite(c["max_rel_update_diff"]) and c["passed"], (name, c)
    text = out.read_text()
    assert "| optim jit |" in text and "| optax |" in text
