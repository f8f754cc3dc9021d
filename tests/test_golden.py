"""Golden numbers: a short run of each shipped world's recipe, started as a user starts it, gives
the numbers recorded in ``tests/golden/`` to the last digit, while a CPU-bound process competes
for the cores. A change that moves a number fails here and must rerun
``python scripts/record_golden.py`` in the same commit, saying why.

The numbers depend on the seed, the thread count (pinned by the recipe's ``threads``), torch's
version, the CPU instruction set of torch's kernels and the CPU's numeric extensions (AMX, AVX512-BF16/FP16
pick other matrix kernels); where any of the last three differ from the recorded ones the comparison
cannot be exact and the test says so and skips."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flowalign.trainer import run_environment
from script_module import load_script

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
record_golden = load_script("record_golden")


def _first_difference(got, want, path="") -> str | None:
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(set(want) | set(got)):
            if key not in got or key not in want:
                return f"{path}{key}: {'missing' if key not in got else 'not in the golden file'}"
            found = _first_difference(got[key], want[key], f"{path}{key}.")
            if found:
                return found
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return f"{path[:-1]}: {len(got)} entries, golden {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            found = _first_difference(g, w, f"{path}{i}.")
            if found:
                return found
        return None
    return None if got == want or (_undefined(got) and _undefined(want)) else f"{path[:-1]}: {got!r}, golden {want!r}"


def _undefined(value) -> bool:
    """NaN, or null: the outputs write an undefined metric as null (strict JSON), older files as NaN."""
    return value is None or (isinstance(value, float) and value != value)


def test_first_difference_names_the_key():
    assert _first_difference({"a": [{"x": 1.0}]}, {"a": [{"x": 1.0}]}) is None
    assert _first_difference({"a": [{"x": 1.0000001}]}, {"a": [{"x": 1.0}]}) == "a.0.x: 1.0000001, golden 1.0"
    assert _first_difference({"a": float("nan")}, {"a": float("nan")}) is None
    assert _first_difference({"a": None}, {"a": float("nan")}) is None
    assert _first_difference({"a": None}, {"a": 0.0}) == "a: None, golden 0.0"


@pytest.mark.parametrize("name", sorted(record_golden.RUNS))
def test_short_run_repeats_the_golden_numbers_under_load(name, tmp_path):
    golden = json.loads((ROOT / "tests" / "golden" / f"{name}.json").read_text())
    recorded = golden["environment"]
    here = {k: v for k, v in run_environment().items() if k != "threads"}
    differs = {k: (recorded.get(k, "not recorded"), v) for k, v in here.items() if recorded.get(k) != v}
    if differs:
        pytest.skip(f"golden numbers recorded under {differs} (recorded, here): floating-point results differ "
                    "by design; rerun scripts/record_golden.py on this machine to compare here")
    if name.startswith("chess") and not (shutil.which("stockfish") or Path("/usr/games/stockfish").is_file()):
        pytest.skip("Stockfish is not installed (apt-get install stockfish)")
    # a CPU-bound competitor on the cores: the numbers must not depend on the machine's load
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        got = record_golden.run(name, tmp_path / name)
    finally:
        competitor.kill()
        competitor.wait()
    assert got["environment"]["threads"] == record_golden.THREADS
    difference = _first_difference({k: got[k] for k in ("history", "evals")},
                                   {k: golden[k] for k in ("history", "evals")})
    assert difference is None, (
        f"{name}: the short run no longer gives the golden numbers ({difference}). If the change is meant "
        f"to move results, rerun `python scripts/record_golden.py --only {name}` and commit the new "
        f"tests/golden/{name}.json with the reason.")
