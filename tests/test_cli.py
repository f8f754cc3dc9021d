"""The ``flowalign`` command as a user runs it: help and clear errors (grid, sample, eval and report:
test_evaluation.py)."""

import subprocess
import sys

import pytest

from flowalign.cli import main


def test_help_teaches_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "flowalign.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for text in ("train", "grid", "eval", "report", "sample", "configs/shapes_flow_grpo.yaml", "accelerate launch"):
        assert text in out.stdout
    out = subprocess.run([sys.executable, "-m", "flowalign.cli", "train", "--help"], capture_output=True, text=True)
    assert "key.sub=value" in out.stdout and "resume=auto" in out.stdout


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
