"""Evaluation tools on a real (tiny) run: policy resolution, comparable grids, resumable eval
tables with two rewards, and the HTML report rendered by headless Chromium."""

import csv
import json
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.cli import main
from flowalign.evaluation import load_policy, paired_change, resolve_policies, sample_images, summarize
from flowalign.trainer import Trainer
from helpers import tiny_config


@pytest.fixture(scope="module")
def tiny_run(tiny_sd3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    Trainer(tiny_config(tiny_sd3_dir, out, "tracker=tensorboard", "checkpoint_every=1", "eval.every=1",
                        "train.epochs=2", "train.learning_rate=3e-2")).train()
    return out


def test_a_run_resolves_to_its_checkpoints_then_final(tiny_run, tmp_path):
    labels = [p.label for p in resolve_policies(["base", str(tiny_run)])]
    assert labels == ["base", "epoch-1", "final"]  # epoch-2 is final's checkpoint: listed once
    assert [p.label for p in resolve_policies([str(tiny_run / "checkpoints" / "epoch-000001")])] == ["epoch-1"]
    with pytest.raises(FileNotFoundError, match="no-such-run"):
        resolve_policies([str(tmp_path / "no-such-run")])
    # named policies; two weights folders called final/ in folders of the same name cannot be told apart
    named = resolve_policies([f"a={tiny_run}", f"b={tiny_run / 'final'}"])
    assert [(p.label, p.weights) for p in named] == [("a/epoch-1", tiny_run / "checkpoints" / "epoch-000001" / "policy"),
                                                     ("a/final", tiny_run / "final"), ("b", tiny_run / "final")]
    for seed in (1, 2):
        (tmp_path / f"s{seed}" / "run" / "final").mkdir(parents=True)
    with pytest.raises(ValueError, match="LABEL=FOLDER"):
        resolve_policies([str(tmp_path / f"s{seed}" / "run" / "final") for seed in (1, 2)])


def test_final_equals_the_last_checkpoint_policy_and_differs_from_base(tiny_run, tiny_sd3_dir):
    policies = {p.label: p for p in resolve_policies(["base", str(tiny_run / "checkpoints" / "epoch-000002"),
                                                      str(tiny_run)])}
    images = {label: sample_images(load_policy(policies[label], str(tiny_sd3_dir)), ["a photo of a red circle"],
                                   [0, 1], steps=3, guidance=1.0)
              for label in ("base", "epoch-2", "final")}
    torch.testing.assert_close(images["final"], images["epoch-2"], rtol=0, atol=1e-6)
    assert (images["final"] - images["base"]).abs().max() > 1e-3  # training moved the policy


def _find_tile(grid: np.ndarray, tile: np.ndarray) -> list[tuple[int, int]]:
    """Every (y, x) at which ``tile`` appears in ``grid`` exactly."""
    h, w = tile.shape[:2]
    hits = []
    ys, xs = np.nonzero(np.all(grid[: grid.shape[0] - h + 1, : grid.shape[1] - w + 1] == tile[0, 0], axis=-1))
    for y, x in zip(ys, xs):
        if np.array_equal(grid[y:y + h, x:x + w], tile):
            hits.append((int(y), int(x)))
    return hits


def test_grid_cells_are_the_samples_each_policy_draws_from_the_same_seed(tiny_run, tiny_sd3_dir, tmp_path):
    prompts = ["a photo of a red circle", "a photo of two squares"]
    common = ["--model", str(tiny_sd3_dir), "--steps", "3", "--seeds", "0,1"]
    grid_path = tmp_path / "grid.png"
    assert main(["grid", *common, "--policies", "base", str(tiny_run / "final"),
                 "--prompt", prompts[0], "--prompt", prompts[1], "--out", str(grid_path)]) == 0
    grid = np.asarray(Image.open(grid_path).convert("RGB"))
    positions = {}
    for name, weights in (("base", []), ("final", ["--weights", str(tiny_run / "final")])):
        assert main(["sample", *common, *weights, prompts[1], "--out", str(tmp_path / f"{name}-{{seed}}.png")]) == 0
        sample = np.asarray(Image.open(tmp_path / f"{name}-1.png"))
        scale = -(-96 // max(sample.shape[:2]))
        hits = _find_tile(grid, sample.repeat(scale, 0).repeat(scale, 1))
        assert len(hits) == 1, f"{name} seed 1 should appear exactly once in the grid"
        positions[name] = hits[0]
    # row 1 (second prompt); the final policy's columns come after base's two seeds
    assert positions["base"][0] == positions["final"][0]
    assert positions["final"][1] > positions["base"][1]
    assert (tmp_path / "grid.txt").read_text().splitlines() == [f"row {i}: {p}" for i, p in enumerate(prompts)]


def test_eval_scores_two_rewards_per_category_and_resumes(tiny_run, tiny_sd3_dir, tmp_path):
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(tiny_sd3_dir), "--steps", "3", "--seeds", "0,1", "--max-prompts", "6",
            "--policies", "base", str(tiny_run / "final"), "--rewards", "shapes,jpeg_compressibility",
            "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["base", "final"]
    for entry in summary.values():
        assert entry["samples"] == 6 * 2
        for metric in ("shapes/accuracy", "shapes/score", "jpeg_compressibility/jpeg_compressibility"):
            assert np.isfinite(entry[metric])
            assert entry[f"{metric}_category_mean"] == pytest.approx(
                np.mean(list(entry[f"{metric}_by_category"].values())))
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and len({(r["policy"], r["index"], r["seed"]) for r in rows}) == 24
    base_rows = [r for r in rows if r["policy"] == "base"]
    assert summary["base"]["shapes/score"] == pytest.approx(np.mean([r["shapes/score"] for r in base_rows]))
    # the paired change of final against base, by hand from the sample lines
    # (seeds 0 and 1: two clusters, so the standard error is the spread of the two seeds' mean changes)
    score = {(r["policy"], r["index"], r["seed"]): r["shapes/score"] for r in rows}
    diffs = {s: [score["final", i, s] - score["base", i, s] for p, i, ss in score if p == "base" and ss == s]
             for s in (0, 1)}
    assert "reference" not in summary["base"] and summary["final"]["reference"] == "base"
    assert summary["final"]["shapes/score_change"] == pytest.approx(np.mean(diffs[0] + diffs[1]))
    assert summary["final"]["shapes/score_change_se"] == pytest.approx(abs(np.mean(diffs[0]) - np.mean(diffs[1])) / 2)
    with open(out / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert {r["policy"] for r in table} == {"base", "final"}
    assert any(r["metric"] == "shapes/accuracy" and r["category"] == "all" for r in table)
    change = [r for r in table if r["metric"] == "shapes/score" and r["category"].startswith("change")]
    assert {r["category"] for r in change} == {"change vs base", "change_se vs base"}
    assert all(r["policy"] == "final" for r in change)

    # Interrupt: keep 7 lines and half of the 8th, as a crash mid-write leaves them; rerun resumes.
    lines = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    (out / "samples.jsonl").write_text("".join(lines[:7]) + lines[7][:20])
    assert main(argv) == 0
    after = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert after[:7] == rows[:7] and len(after) == 24  # the cut line dropped, only the missing 17 redone
    assert sorted((r["policy"], r["index"], r["seed"]) for r in after) == sorted(
        (r["policy"], r["index"], r["seed"]) for r in rows)
    again = json.loads((out / "summary.json").read_text())
    for label in summary:
        for metric in ("shapes/score", "jpeg_compressibility/jpeg_compressibility"):
            assert again[label][metric] == pytest.approx(summary[label][metric], abs=1e-6)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium; .ci/run installs it)")
def test_report_renders_images_and_charts_in_headless_chromium(tiny_run, tiny_sd3_dir, tmp_path):
    eval_dir = tmp_path / "eval"
    assert main(["eval", "--model", str(tiny_sd3_dir), "--steps", "2", "--seeds", "0", "--max-prompts", "2",
                 "--policies", "base", str(tiny_run), "--rewards", "shapes,jpeg_compressibility",
                 "--out", str(eval_dir)]) == 0
    page = tmp_path / "report" / "index.html"
    assert main(["report", str(tiny_run), "--eval", str(eval_dir), "--out", str(page)]) == 0
    html = page.read_text()
    assert "training reward" in html and "epoch-1" in html and "shapes/accuracy" in html
    run = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                          "--v=0", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    body = run.stdout[run.stdout.index("<body"):][:300]
    assert 'data-status="ok"' in body, body
    n_images = int(body.split('data-images="')[1].split('"')[0])
    assert n_images >= 3  # before, after, epoch grids and before_after
    assert int(body.split('data-charts="')[1].split('"')[0]) >= 4
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console


def test_video_cells_are_contact_sheets_and_gifs_keep_every_frame(tmp_path):
    from flowalign.grids import as_image_cells, save_gif

    video = torch.stack([torch.full((3, 8, 8), t / 5) for t in range(6)])  # frame t has value t/5
    sheet = as_image_cells(video[None])[0]
    assert sheet.shape == (3, 8, 32)
    assert [round(sheet[0, 0, 8 * k].item(), 3) for k in range(4)] == [0.0, 0.4, 0.6, 1.0]  # frames 0, 2, 3, 5
    save_gif(video, tmp_path / "v.gif")
    gif = Image.open(tmp_path / "v.gif")
    assert gif.n_frames == 6
    gif.seek(5)
    assert np.asarray(gif.convert("RGB"))[0, 0, 0] == 255


def test_spectrogram_strip_puts_a_tone_at_its_frequency():
    from flowalign.grids import as_image_cells

    rate, height = 8000, 64
    t = torch.arange(rate) / rate
    strips = as_image_cells(torch.stack([torch.sin(2 * torch.pi * f * t) for f in (1000.0, 3000.0)]))
    assert strips.shape[:2] == (2, 3)
    for strip, f in zip(strips, (1000.0, 3000.0)):
        brightest = strip[0].mean(-1).argmax().item()  # row 0 is the top: the highest frequency
        expected = (1 - f / (rate / 2)) * (height - 1)
        assert abs(brightest - expected) <= 2
    with pytest.raises(ValueError, match="cannot draw"):
        as_image_cells(torch.zeros(2, 3, 4))


def test_paired_change_pairs_samples_by_prompt_and_seed():
    rows = [{"policy": "base", "index": 0, "seed": 0, "r/x": 0.5}, {"policy": "base", "index": 0, "seed": 1, "r/x": 0.0},
            {"policy": "base", "index": 1, "seed": 0, "r/x": 1.0}, {"policy": "base", "index": 1, "seed": 1, "r/x": 3.0},
            # listed in another order; (1, 1) is NaN and (2, 0) has no base sample: both are left out
            {"policy": "new", "index": 1, "seed": 0, "r/x": 2.0}, {"policy": "new", "index": 0, "seed": 1, "r/x": 0.0},
            {"policy": "new", "index": 0, "seed": 0, "r/x": 1.0}, {"policy": "new", "index": 1, "seed": 1, "r/x": float("nan")},
            {"policy": "new", "index": 2, "seed": 0, "r/x": 9.0}]
    entry = summarize(rows, ["base", "new"])["new"]
    # differences 0.5 (seed 0), 0.0 (seed 1), 1.0 (seed 0): mean 0.5; clustered by seed, the residual
    # sums are 0 + 0.5 (seed 0) and −0.5 (seed 1): var = 2/1 · (0.25 + 0.25) / 3², se = 1/3
    assert entry["r/x_change"] == pytest.approx(0.5)
    assert entry["r/x_change_se"] == pytest.approx(1 / 3)
    # one pair per cluster: the textbook sd / √n (differences 0.5, 0.0, 1.0: sd 0.5)
    assert paired_change([(1.0, 0.5, 0), (0.0, 0.0, 1), (2.0, 1.0, 2)])[1] == pytest.approx(0.5 / np.sqrt(3))
    assert all(np.isnan(paired_change([(1.0, 0.0, 0), (2.0, 0.0, 0)])))  # one cluster: no standard error


def test_each_evaluation_reports_its_paired_change_against_before(tiny_run):
    metrics = json.loads((tiny_run / "metrics.json").read_text())
    before = torch.load(tiny_run / "eval_samples" / "before.pt")
    after = torch.load(tiny_run / "eval_samples" / "after.pt")
    assert not any(k.endswith("_change") for k in metrics["before"])
    for name in ("accuracy", "score"):
        diff = (after[name] - before[name]).double().numpy()  # the same noise per sample: one cluster each
        assert name == "accuracy" or np.any(diff != 0)  # the training moved the continuous score
        assert metrics["after"][f"{name}_change"] == pytest.approx(diff.mean())
        assert metrics["after"][f"{name}_change_se"] == pytest.approx(diff.std(ddof=1) / np.sqrt(len(diff)))
        assert metrics["after"][name] == pytest.approx(after[name].mean().item())
    assert (tiny_run / "eval_samples" / "epoch-1.pt").is_file()  # eval.every=1: every evaluation is kept


def test_flowalign_eval_draws_what_the_runs_own_evaluation_draws(tiny_run, tiny_sd3_dir, tmp_path):
    """One noise convention (flowalign.evaluation.held_out_noise): `flowalign eval` of the base model
    on the run's held-out prompts with seeds 0 … S − 1 scores exactly the run's "before" samples."""
    from flowalign.evaluation import Policy, evaluate
    from flowalign.prompts import load_prompts
    from reward_models.base import build_reward

    before = torch.load(tiny_run / "eval_samples" / "before.pt")  # eval.seeds=1, sampling.num_steps=4
    evaluate([Policy("base", None)], load_prompts("shapes:test"), {"shapes": build_reward("shapes")}, tmp_path,
             model=str(tiny_sd3_dir), seeds=[0], steps=4, guidance=1.0, batch_size=64)
    rows = sorted((json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()),
                  key=lambda row: row["index"])
    assert [row["shapes/score"] for row in rows] == before["score"].tolist()
