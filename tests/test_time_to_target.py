"""scripts/time_to_target.py: first crossings, means over the seeds that reached a level, the plot."""

import json

import pytest
from script_module import load_script

ttt = load_script("time_to_target")


def _study(path, name, seed, accuracies, split="test"):
    points = [{"epoch": 15 * i, "cpu_minutes": 2.0 * i, "samples": 960 * i, "accuracy": a,
               "latent_diversity": 1.0 + 0.1 * i} for i, a in enumerate(accuracies)]
    path.write_text(json.dumps({"name": name, "seed": seed, "split": split, "points": points}))


def test_a_level_counts_at_the_first_evaluation_after_training_began_and_averages_the_seeds_that_reached_it(tmp_path):
    _study(tmp_path / "a-s0.json", "a", 0, [0.50, 0.40, 0.46, 0.52])  # the untrained point never counts
    _study(tmp_path / "a-s1.json", "a", 1, [0.50, 0.47, 0.44, 0.48])
    _study(tmp_path / "a-s2.json", "a", 2, [0.50, 0.41, 0.42, 0.43], split="validation")  # ignored: not test
    (row,) = ttt.table(ttt.curves_from_study([str(tmp_path / "*.json")]), [0.45, 0.5, 0.6])
    assert row["seeds"] == 2 and row["final_mean"] == pytest.approx(0.50) and row["final_sd"] == pytest.approx(0.0283, abs=1e-4)
    assert row["levels"]["0.45"] == {"reached": 2, "cpu_minutes": pytest.approx(3.0), "samples": pytest.approx(1440)}
    assert row["levels"]["0.50"] == {"reached": 1, "cpu_minutes": pytest.approx(6.0), "samples": pytest.approx(2880)}
    assert row["levels"]["0.60"] == {"reached": 0, "cpu_minutes": None, "samples": None}
    assert row["latent_diversity"] == {"seeds": 2, "before": pytest.approx(1.0), "after": pytest.approx(1.3)}
    assert row["jpeg_compressibility"] is None  # not recorded by these runs
    assert "(1/2 seeds)" in ttt.markdown([row], [0.45, 0.5, 0.6])


def test_the_plot_is_written_for_runs_of_several_seeds_and_of_one(tmp_path):
    _study(tmp_path / "a-s0.json", "a", 0, [0.40, 0.45])
    _study(tmp_path / "a-s1.json", "a", 1, [0.40, 0.47])
    _study(tmp_path / "b-s0.json", "b", 0, [0.40, 0.42])
    out = tmp_path / "plot.png"
    ttt.plot(ttt.curves_from_study([str(tmp_path / "*.json")]), str(out))
    assert out.stat().st_size > 0


def test_labels_name_and_order_the_rows_and_unlabelled_runs_follow_as_named(tmp_path):
    for name in ("a", "b", "c"):
        _study(tmp_path / f"{name}-s0.json", name, 0, [0.40, 0.45])
    curves = ttt.relabel(ttt.curves_from_study([str(tmp_path / "*.json")]), {"c": "method C", "a": "method A", "z": "absent"})
    assert list(curves) == ["method C", "method A", "b"]
    assert [r["method"] for r in ttt.table(curves, [0.45])] == ["method C", "method A", "b"]
