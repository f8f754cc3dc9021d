"""The fault sweep (scripts/fault_sweep.py) as tests: every case of every class (config domains,
data files, weights and model folders, checkpoints and resume, reward plug-ins, the reward server,
the other commands, the environment) runs as a user would meet it, in a forked child under a
deadline, and must end CLEAN: a non-zero exit with one line naming the culprit, no traceback,
nothing of an earlier run lost (or, for the cases that should work, exit 0). The sweep runs once,
in its own process (forking a test process that holds other tests' threads could deadlock a
child); each case is then one test. The slow case (the default reward deadline, 2 minutes) runs in
the script only; the tmpfs cases run where the sweep may mount (root on Linux).

By default the suite runs a representative subset (``SUBSET``: cases of every class and every entry
point: train and its dry run, resume, the Python API, eval, grid, sample, report, push,
generate-groups, recipes, reward-server and its HTTP endpoint), about a minute of CPU; the whole
sweep (330+ cases, 10-15 minutes) runs with ``FLOWALIGN_FULL_SWEEP=1`` set, or as
``python scripts/fault_sweep.py``."""

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
SUBSET = (  # at least one case of every class and of every entry point (the default run)
    "config/train.max_grad_norm=-1", "config/train.nft_beta=0", "config/hub.strategy=bogus", "config/yaml_binary",
    "config/recipe_is_a_folder",
    "data/train_prompts_latin1.txt", "data/eval_prompts_null_prompt.jsonl", "data/api_empty_prompt_list",
    "weights/init_lora_nan", "weights/sample_weights_truncated", "weights/model_missing_weights",
    "weights/grid_policy_lora_nan", "weights/eval_policy_lora_shape",
    "checkpoint/resume_after_changing_method", "checkpoint/rerun_finished_run_without_resume",
    "checkpoint/resume_after_changing_seed", "checkpoint/output_dir_is_a_file",
    "reward/sweep_2d", "reward/kwargs_unknown", "reward/remote_unreachable",
    "server/cli_kwargs_not json", "server/body_not_json", "server/public_bind_without_token",
    "cli/grid_steps_0", "cli/eval_rewards_nope", "cli/sample_steps_0_/s.png", "cli/sample_partial-fen_8 w - - 0 1_x",
    "cli/report_corrupt_metrics", "cli/push_bad_repo_id", "cli/generate_groups_zero", "cli/recipes_show_unknown",
    "environment/train_read_only", "environment/eval_read_only", "environment/python_chess_missing",
    "environment/hub_offline",
)
FULL = os.environ.get("FLOWALIGN_FULL_SWEEP") == "1"
CASES = [c for c in sweep.all_cases() if not c.slow and (FULL or c.id in SUBSET)]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sweep forks a child per case (POSIX only)")


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "sweep.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    only = [] if FULL else ["--only", ",".join(SUBSET)]
    done = subprocess.run([sys.executable, str(SCRIPTS / "fault_sweep.py"), "--skip-slow", *only, "--out", str(out)],
                          cwd=SCRIPTS.parent, env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["id"]: r for r in json.loads(out.read_text())["results"]}


def test_the_sweep_covers_every_class_with_enough_cases():
    counts = {cls: sum(c.cls == cls for c in sweep.all_cases()) for cls in sweep.CLASSES}
    assert sum(counts.values()) >= 200 and min(counts.values()) >= 10, counts


def test_the_default_subset_names_real_cases_of_every_class():
    ids = {c.id for c in sweep.all_cases()}
    assert [i for i in SUBSET if i not in ids or "," in i] == []  # --only takes a comma-separated list
    assert {i.split("/")[0] for i in SUBSET} == set(sweep.CLASSES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_or_fault_ends_clean(case, verdicts):
    result = verdicts.get(case.id)
    if result is None or result["verdict"] == "SKIP":
        pytest.skip(f"not run here ({result['why'] if result else 'a tmpfs case: mounting needs root on Linux'})")
    assert result["verdict"] == "CLEAN", f"{case.id}: {result['verdict']}: {result['why']}"
