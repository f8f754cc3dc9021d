"""The ``flowalign`` command as a user runs it: help, grid, sample, and clear errors."""

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from flowalign.cli import main


def test_help_teaches_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "flowalign.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for text in ("train", "grid", "sample", "configs/shapes_flow_grpo.yaml", "accelerate launch"):
        assert text in out.stdout
    out = subprocess.run([sys.executable, "-m", "flowalign.cli", "train", "--help"], capture_output=True, text=True)
    assert "key.sub=value" in out.stdout and "resume=auto" in out.stdout


def test_grid_and_sample_agree_on_a_local_model(tiny_sd3_dir, tmp_path):
    prompts = ["a photo of a red circle", "a photo of two squares"]
    args = ["--model", str(tiny_sd3_dir), "--steps", "3", "--seeds", "0,1"]
    grid_path = tmp_path / "grid.png"
    assert main(["grid", *args, "--prompt", prompts[0], "--prompt", prompts[1], "--out", str(grid_path)]) == 0
    grid = np.asarray(Image.open(grid_path))
    assert (tmp_path / "grid.txt").read_text().splitlines() == [f"row {i}: {p}" for i, p in enumerate(prompts)]
    assert main(["sample", *args, prompts[1], "--out", str(tmp_path / "s-{seed}.png")]) == 0
    sample = np.asarray(Image.open(tmp_path / "s-1.png"))  # row 1, column 1 of the grid
    h, w = sample.shape[:2]
    scale = -(-96 // max(h, w))
    cell = grid[2 + 1 * (h * scale + 2):][:h * scale:scale, 2 + 1 * (w * scale + 2):][:, :w * scale:scale]
    assert grid.shape == (2 * (h * scale + 2) + 2, 2 * (w * scale + 2) + 2, 3)
    np.testing.assert_array_equal(cell, sample)


def test_errors_exit_2_with_the_reason(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trian: {}\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'trian'" in err and str(bad) in err
    assert main(["grid", "--model", str(tmp_path / "no-such-model"), "--prompt", "x"]) == 2
    assert "no-such-model" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["frobnicate"], []])
def test_unknown_subcommand_is_an_argparse_error(argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
