"""The fault sweep (scripts/fault_sweep.py) as tests: every case of every class (config domains,
data files, weights and model folders, checkpoints and resume, reward plug-ins, the reward server,
the other commands, the environment) runs as a user would meet it, in a forked child under a
deadline, and must end CLEAN: a non-zero exit with one line naming the culprit, no traceback,
nothing of an earlier run lost (or, for the cases that should work, exit 0). The sweep runs once,
in its own process (forking a test process that holds other tests' threads could deadlock a
child); each case is then one test. The slow case (the default reward deadline, 2 minutes) runs in
the script only; the tmpfs cases run where the sweep may mount (root on Linux)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from script_module import SCRIPTS

_spec = importlib.util.spec_from_file_location("fault_sweep", SCRIPTS / "fault_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
sys.modules["fault_sweep"] = sweep  # its dataclass looks its module up there
_spec.loader.exec_module(sweep)
CASES = [c for c in sweep.all_cases() if not c.slow]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sweep forks a child per case (POSIX only)")


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "sweep.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPTS / "fault_sweep.py"), "--skip-slow", "--out", str(out)],
                          cwd=SCRIPTS.parent, env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["id"]: r for r in json.loads(out.read_text())["results"]}


def test_the_sweep_covers_every_class_with_enough_cases():
    counts = {cls: sum(c.cls == cls for c in sweep.all_cases()) for cls in sweep.CLASSES}
    assert sum(counts.values()) >= 200 and min(counts.values()) >= 10, counts


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_or_fault_ends_clean(case, verdicts):
    result = verdicts.get(case.id)
    if result is None or result["verdict"] == "SKIP":
        pytest.skip(f"not run here ({result['why'] if result else 'a tmpfs case: mounting needs root on Linux'})")
    assert result["verdict"] == "CLEAN", f"{case.id}: {result['verdict']}: {result['why']}"
