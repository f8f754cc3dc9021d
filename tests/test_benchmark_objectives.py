"""scripts/benchmark_objectives.py's efficiency ratios (the papers' "N× fewer steps" claims) on
hand-made curves: the level is Flow-GRPO's final accuracy, each method's first evaluation after
training began at or above it gives its samples and minutes."""

from script_module import load_script


def _bench():
    return load_script("benchmark_objectives")


def _curve(*points):
    return {"model": "shapes-sd3", "points": [
        {"label": f"p{i}", "minutes": m, "samples": s, "accuracy": a, "accuracy_category_mean": a,
         "latent_diversity": 1.0, "jpeg_compressibility": -1.0} for i, (m, s, a) in enumerate(points)]}


def test_ratios_use_flow_grpos_final_level_and_each_methods_first_crossing(tmp_path, capsys):
    bench = _bench()
    results = {
        "flow_grpo": _curve((0, 0, 0.40), (5, 1000, 0.45), (10, 2000, 0.42), (15, 3000, 0.44)),
        # GDRO-like: the untrained "before" point already carries its generation cost and samples
        "gdro": _curve((2, 1500, 0.40), (4, 1500, 0.39), (6, 1500, 0.47)),
        "nft": _curve((0, 0, 0.40), (2, 250, 0.44), (4, 500, 0.50)),
        "slow": _curve((0, 0, 0.40), (15, 3000, 0.41)),
    }
    bench.report(results, 15, tmp_path)
    out = capsys.readouterr().out
    # level 0.44, first reached by Flow-GRPO at 1000 samples / 5 min (not its final point)
    assert "Flow-GRPO: 1000 samples, 5.0 min" in out
    assert "| nft | 250 | 2.0 | 4.0× | 2.5× |" in out
    assert "| gdro | 1500 | 6.0 | 0.7× | 0.8× |" in out  # its dip below the level at 4 min is no crossing
    assert "| slow | not reached |" in out
    assert (tmp_path / "objectives.png").is_file() and (tmp_path / "objectives.json").is_file()


def test_no_ratio_when_flow_grpo_did_not_rise(tmp_path, capsys):
    bench = _bench()
    bench.report({"flow_grpo": _curve((0, 0, 0.40), (15, 3000, 0.39)),
                  "nft": _curve((0, 0, 0.40), (2, 250, 0.44))}, 15, tmp_path)
    assert "not above its baseline 0.400: no ratio" in capsys.readouterr().out
