"""The mistakes that ended in tracebacks: each is one line naming what to fix, exit 2, before
anything loads (a push to an unreachable hub: tests/test_hub_outputs.py); a reward returning TRL's
``(rewards, metadata)`` pair trains."""

import pytest
import torch

from flowalign.cli import main


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flowalign: error: ") and "Traceback" not in err, err
    return err


def test_eval_with_an_unknown_reward(capsys, tmp_path):
    assert main(["eval", "--policies", "base", "--rewards", "shape", "--out", str(tmp_path / "ev")]) == 2
    err = _one_line(capsys)
    assert "--rewards: unknown reward 'shape'" in err and "shapes" in err
    assert not (tmp_path / "ev").exists()


def test_a_reward_server_for_geneval_says_how_to_get_it(capsys):
    assert main(["reward-server", "--reward", "geneval"]) == 2
    err = _one_line(capsys)
    assert "--reward geneval" in err and "plug-in reward named 'geneval'" in err and "flowalign.rewards" in err


@pytest.mark.parametrize("kwargs, expected", [("{bad", "is not valid JSON"), ("[1]", "must be a JSON object"),
                                              ('{"nope": 1}', "takes no argument 'nope'")])
def test_a_reward_server_with_bad_kwargs(kwargs, expected, capsys):
    assert main(["reward-server", "--reward", "shapes", "--kwargs", kwargs]) == 2
    assert expected in _one_line(capsys)


def test_trls_reward_pair_is_read_as_its_rewards():
    from reward_models.base import reward_output

    assert torch.equal(reward_output((torch.tensor([1.0, 2.0]), {}))["score"], torch.tensor([1.0, 2.0]))
    assert torch.equal(reward_output(([0.5, 0.25], [{}, {}]))["score"], torch.tensor([0.5, 0.25]))
    with pytest.raises(TypeError, match="reward 'x' must return .* got str"):
        reward_output("high", "reward 'x'")


def test_a_trl_style_reward_trains(tiny_sd3_dir, tmp_path):
    import flowalign

    def trl_style(samples, prompts, metadata):  # TRL's DDPO reward functions return (rewards, metadata)
        return samples.mean(dim=(1, 2, 3)), {"what": "brightness"}

    class TrlStyle(flowalign.Reward):  # a Reward object doing the same
        components = ("score",)

        def __call__(self, samples, prompts, metadata):
            return trl_style(samples, prompts, metadata)

    for i, reward in enumerate((trl_style, TrlStyle())):
        config = flowalign.load_config(None, [
            f"output_dir={tmp_path / str(i)}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
            "sampling.num_steps=4", "train.epochs=1", "train.groups_per_epoch=2", "train.group_size=4",
            "train.sample_batch_size=8", "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=1",
            "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0"])
        trainer = flowalign.Trainer(config, reward=reward, train_prompts=["a red circle", "a blue square"])
        summary = trainer.train()
        assert summary["after"]["score"] == pytest.approx(summary["after"]["score"])  # a number, not NaN
        assert trainer.history[0]["reward/mean"] > 0


def test_version_and_the_attention_flag_take_what_the_config_takes(capsys):
    from flowalign import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"flowalign {__version__}"
    assert main(["sample", "a red circle", "--attention", "flash-attn", "--out", "x.png"]) == 2
    err = _one_line(capsys)
    assert "model.attention must be one of" in err and "_native_math" in err  # the config's ~30 backends
