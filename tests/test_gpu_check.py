"""scripts/gpu_check.py's CPU subset, run here so the GPU check cannot rot before a GPU runs it;
and its fail-soft rule: a section or case that raises is recorded and the rest still runs."""

import json

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def test_the_cpu_subset_runs_every_section_and_writes_one_json(gpu_check, tmp_path):
    out = tmp_path / "check.json"
    results = gpu_check.main(["--cpu-subset", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results, default=str))
    assert results["mode"] == "cpu-subset"
    for name in ("environment", "precision", "attention", "checkpointing", "compile", "launch", "rollout_overhead"):
        assert "error" not in results[name], (name, results[name])
    step = results["precision"]["cases"]["tiny_sd3/fp32"]
    assert results["precision"]["ok"] and step["log_prob_dtype"] == "float32" and step["stats_finite"]
    assert step["loss_terms"]["train/ratio"] == pytest.approx(1.0)  # on-policy at the first update
    assert step["attention"] == {"JointAttnProcessor2_0": 2}  # the processors in use are recorded
    assert set(results["checkpointing"]["cases"]) == {"tiny_sd3/off", "tiny_sd3/on"}
    assert all("error" not in c for c in results["checkpointing"]["cases"].values())
    assert "tiny_sd3/sdpa" in results["attention"]["cases"]
    assert "CUDA" in results["launch"]["skipped"]
    assert "skipped" in results["compile"]
    overhead = results["rollout_overhead"]
    assert overhead["ratio"] == pytest.approx(overhead["rollout_s"] / overhead["pipeline_s"])


def test_a_section_or_case_that_raises_is_recorded_and_the_rest_runs(gpu_check, tmp_path):
    out, results = tmp_path / "partial.json", {}

    def broken():
        raise RuntimeError("flash kernel not built for sm_90")

    gpu_check.run_section(results, "broken", broken, out)
    gpu_check.run_section(results, "fine", lambda: {"value": 1}, out)
    assert results["broken"]["error"] == "RuntimeError: flash kernel not built for sm_90"
    assert results["fine"]["value"] == 1 and "seconds" in results["broken"]
    assert json.loads(out.read_text())["fine"]["value"] == 1  # rewritten after every section

    def case(x):
        if x == "bad":
            raise ValueError("no such backend")
        return {"x": x}

    rows = gpu_check.each({"a": ("good",), "b": ("bad",), "c": ("good",)}, case)
    assert rows == {"a": {"x": "good"}, "b": {"error": "ValueError: no such backend"}, "c": {"x": "good"}}
