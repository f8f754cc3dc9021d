"""The fault sweep (scripts/fault_sweep.py) as tests: every case of every class (config domains,
data files, weights and model folders, checkpoints and resume, reward plug-ins, the reward server,
the other commands, the environment) runs as a user would meet it, in a forked child under a
deadline, and must end CLEAN: a non-zero exit with one line naming the culprit, no traceback,
nothing of an earlier run lost (or, for the cases that should work, exit 0). Cases marked slow
(the default reward deadline, the connection flood) run in the script only."""

import os
import sys

import pytest

from script_module import load_script

sweep = load_script("fault_sweep")
CASES = [c for c in sweep.all_cases() if not c.slow]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sweep forks a child per case (POSIX only)")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return sweep.prepare(tmp_path_factory.mktemp("sweep"))


def test_the_sweep_covers_every_class_with_enough_cases():
    counts = {cls: sum(c.cls == cls for c in sweep.all_cases()) for cls in sweep.CLASSES}
    assert sum(counts.values()) >= 200 and min(counts.values()) >= 10, counts


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_or_fault_ends_clean(case, fixtures, tmp_path):
    if case.cls == "environment" and "disk" in case.id and (os.geteuid() != 0 or sys.platform != "linux"):
        pytest.skip("mounting a small or read-only tmpfs needs root on Linux")
    result = sweep.run_case(case, fixtures, tmp_path / "case")
    assert result["verdict"] == "CLEAN", f"{case.id}: {result['verdict']}: {result['why']}"
