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


DEMO = "configs/shapes_flow_grpo.yaml"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: a bad config must stop before one."""
    import flowalign.model_setup
    import pipelines

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(flowalign.model_setup, "load_adapter", refuse)
    monkeypatch.setattr(pipelines, "load_adapter", refuse)


def _bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("\n   \n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a red circle"}\n{"prompt": \n')
    (tmp_path / "prompts.tsv").write_text("a red circle\n")
    (tmp_path / "headless.csv").write_text("a red circle\n")
    (tmp_path / "a-file").write_text("")
    return [  # (override, what the message must name besides the override)
        (f"data.train_prompts={tmp_path / 'empty.txt'}", "data.train_prompts: .*empty.txt holds no prompts"),
        (f"data.eval_prompts={tmp_path / 'empty.txt'}", "data.eval_prompts: .*holds no prompts"),
        (f"data.train_prompts={tmp_path / 'bad.jsonl'}", "bad.jsonl: line 2 is not JSON"),
        (f"data.eval_prompts={tmp_path / 'prompts.tsv'}", "prompts.tsv: prompt files must be .txt .* got .tsv"),
        (f"data.eval_prompts={tmp_path / 'headless.csv'}", "headless.csv: the first line must be a header naming a \"prompt\" column"),
        ("data.train_prompts=shapes:trian", "data.train_prompts shapes:trian: split must be"),
        ("checkpoint_every=-1", "checkpoint_every must be ≥ 0"),
        ("checkpoints_kept=-2", "checkpoints_kept must be ≥ 0"),
        ("eval.every=-1", "eval.every must be ≥ 0"),
        ("eval.batch_size=0", "eval.batch_size must be ≥ 1"),
        ("eval.seeds=0", "eval.seeds must be ≥ 1"),
        ("train.inner_epochs=0", "train.inner_epochs must be ≥ 1"),
        (f"output_dir={tmp_path / 'a-file'}", "output_dir: .*a-file is a file, not a folder"),
        (f"output_dir={tmp_path / 'a-file' / 'run'}", "output_dir: .*a-file is a file"),
        ("train.learning_rate=-1e-4", "train.learning_rate must be a finite number ≥ 0"),
        ("train.learning_rate=.nan", "train.learning_rate must be a number, got NaN"),
        ("reward.kwargs={min_area:", "the value is not valid YAML"),
        ("model.path=shapes-sd33", "model.path: 'shapes-sd33' is not a built-in demo model \\(did you mean "
                                   "'shapes-sd3'\\? built-in: .*shapes-sd3"),
        ("reward.timeout_s=0", "reward.timeout_s must be > 0"),
        ("reward.name=shapez", "reward.name: unknown reward 'shapez'"),
        ("model.family=sd4", "model.family: unknown model family 'sd4'"),
        ("reward.on_error=ignore", "reward.on_error must be one of raise, nan"),
        ("train.max_nan_epochs=-1", "train.max_nan_epochs must be ≥ 0"),
    ]


def test_bad_values_exit_2_naming_the_override_before_any_model_loads(tmp_path, capsys, no_model_loads):
    import re
    import time

    for override, named in _bad_inputs(tmp_path):
        began = time.time()
        assert main(["train", DEMO, override, f"output_dir={tmp_path / 'run'}"][: 3 if "output_dir" in override
                                                                                else 4]) == 2, override
        err = capsys.readouterr().err
        assert err.startswith(f"flowalign: error: override {override!r}") and re.search(named, err), (override, err)
        assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
        assert time.time() - began < 20, override  # a misspelled demo name never tries the hub


def test_a_bad_value_in_the_file_names_the_file(tmp_path, capsys, no_model_loads):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path / 'run'}\neval:\n  every: -1\n")
    assert main(["train", str(recipe)]) == 2
    assert f"flowalign: error: {recipe}: eval.every must be ≥ 0" in capsys.readouterr().err
    # the same file with the bad value overridden by a good one passes that check, and a bad override
    # of another key names the override, not the file
    assert main(["train", str(recipe), "eval.every=2", "eval.seeds=0"]) == 2
    assert "override 'eval.seeds=0': eval.seeds must be ≥ 1" in capsys.readouterr().err


def test_an_unreachable_hub_id_gives_an_actionable_message(monkeypatch):
    from pipelines.base import ModelNotFoundError, load_with_hub_fallback

    def offline(path, **kwargs):  # what diffusers raises with no network: the root cause is two levels down
        try:
            try:
                raise OSError("[Errno -2] Name or service not known")
            except OSError as dns:
                raise ConnectionError("Couldn't connect to the Hub") from dns
        except ConnectionError as connect:
            raise OSError(f"Cannot load model {path}: the model is not fully cached locally. Please check out the "
                          "root cause in the stacktrace above.") from connect

    with pytest.raises(ModelNotFoundError) as error:
        load_with_hub_fallback(offline, "someone/some-model")
    message = str(error.value)
    assert "stacktrace" not in message and "Name or service not known" in message
    assert "huggingface-cli download someone/some-model" in message and "network" in message


def test_a_missing_prompt_file_stops_training_and_the_dry_run(tmp_path, capsys, no_model_loads):
    missing = tmp_path / "absent.txt"
    assert main(["train", DEMO, f"data.train_prompts={missing}", f"output_dir={tmp_path / 'run'}"]) == 2
    assert f"data.train_prompts: prompt file not found: tried {missing}" in capsys.readouterr().err
    assert main(["train", DEMO, f"data.train_prompts={missing}", "--dry-run"]) == 2  # the report, then the error
    out, err = capsys.readouterr()
    assert "absent.txt" in out and f"missing here: data.train_prompts {missing}" in err


def test_help_and_recipes_answer_before_torch_loads():
    # scripts/benchmark_cli_startup.py times it; here: nothing heavy is imported to print help or list recipes
    import subprocess
    import sys

    code = ("import sys\nfrom flowalign.cli import main\n"
            "for argv in (['--help'], ['train', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0\n"
            "assert main(['recipes']) == 0\n"
            "assert main(['recipes', '--show', 'no_such_recipe']) == 2\n"  # the error path loads nothing either
            "heavy = [m for m in ('torch', 'diffusers', 'accelerate', 'flowalign.trainer', 'flowalign.config') "
            "if m in sys.modules]\nassert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "docs/config.md" in out.stdout  # train --help says where every key is documented
    out = subprocess.run([sys.executable, "-m", "flowalign", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "flowalign train" in out.stdout
