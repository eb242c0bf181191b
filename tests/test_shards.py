"""`tests/shards.py`, which `make test` runs: the suite split over processes runs every test exactly once."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import shards  # noqa: E402


def test_files_are_dealt_once_each_longest_first_to_the_least_loaded():
    seconds = {"test_a.py": 100, "test_b.py": 60, "test_c.py": 50, "test_d.py": 10, shards.DOCTESTS: 5}
    groups = shards.deal(["test_a.py", "test_b.py", "test_c.py", "test_d.py", "test_e.py"], seconds, 2)
    assert sorted(f for g in groups for f in g) == ["test_a.py", "test_b.py", "test_c.py", "test_d.py", "test_e.py"]
    # The first starts with the doctests' 5 s: a (100) goes to the second, b (60) and c (50) to the first (5, then
    # 65 < 100), d (10) to the second (100 < 115), e (unknown: 10 s) too (110 < 115).
    assert groups == [["test_b.py", "test_c.py"], ["test_a.py", "test_d.py", "test_e.py"]]
    assert shards.deal(["test_a.py"], seconds, 4) == [["test_a.py"]]     # no empty process


def test_each_test_file_runs_in_one_process_and_the_doctests_in_the_first():
    files = sorted(f.name for f in HERE.glob("test_*.py"))
    groups = shards.deal(files, {}, 3)
    cmds = shards.commands(groups, ["-q"])
    ignored = [{a.split("=", 1)[1] for a in c if a.startswith("--ignore=")} for c in cmds]
    for f in files:
        runs = [k for k, ig in enumerate(ignored) if f"tests/{f}" not in ig]
        assert len(runs) == 1, (f, runs)
    # The first is a plain `pytest` (the configured paths: tests and optim's doctests); the others name `tests`,
    # without its helper modules (their doctests run in the first).
    assert cmds[0][-1].startswith("--ignore=") and all(c[-1] == "tests" for c in cmds[1:])
    assert all("tests/rule_cases.py" in ig and "tests/conftest.py" not in ig for ig in ignored[1:])
    assert "tests/rule_cases.py" not in ignored[0]


def test_junit_times_add_up_per_file(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="x" time="1.5"/>'
                   '<testcase classname="tests.test_a.TestK" name="y" time="2"/>'
                   '<testcase classname="optim._rules.adam" name="Adam" time="0.5"/></testsuite></testsuites>')
    assert shards.file_seconds(xml) == {"test_a.py": 3.5, shards.DOCTESTS: 0.5}
