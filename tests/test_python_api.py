"""The Python API, used as a notebook user would: only names exported by ``flowalign``."""

import subprocess
import sys

import pytest

import flowalign


def brightness(samples, prompts, metadata):
    """A plain reward function: a tensor [B] (the component "score")."""
    return samples.mean(dim=(1, 2, 3))


def tiny_run_config(tiny_sd3_dir, out, **train):
    """A RunConfig built in Python, section by section (no YAML, no overrides)."""
    return flowalign.RunConfig(
        output_dir=str(out), tracker="none", checkpoint_every=0,
        model=flowalign.ModelConfig(path=str(tiny_sd3_dir), lora_rank=4),
        sampling=flowalign.SamplingConfig(num_steps=4),
        train=flowalign.TrainConfig(**{"epochs": 2, "groups_per_epoch": 2, "group_size": 4, "sample_batch_size": 8,
                                       "train_batch_size": 8, "learning_rate": 1e-3, **train}),
        eval=flowalign.EvalConfig(every=0, seeds=2, grid_prompts=2, grid_seeds=1))


def test_import_is_cheap_and_exports_the_api():
    code = ("import sys, flowalign; assert 'torch' not in sys.modules, 'torch loaded'; "
            "print(flowalign.__version__); from flowalign import train, load_config, Trainer; "
            "assert 'torch' in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == flowalign.__version__


def test_train_two_epochs_with_a_reward_function_and_a_prompt_list(tiny_sd3_dir, tmp_path):
    prompts = ["a photo of a red circle", "a photo of a blue square", "a photo of a green triangle"]
    summary = flowalign.train(tiny_run_config(tiny_sd3_dir, tmp_path), reward=brightness, prompts=prompts,
                              eval_prompts=prompts[:2])
    assert summary["epochs"] == 2
    before, after = summary["before"], summary["after"]
    assert before["samples"] == after["samples"] == 4  # 2 eval prompts × 2 seeds
    assert 0 <= before["score"] <= 1 and 0 <= after["score"] <= 1
    assert summary["delta"]["score"] == pytest.approx(after["score"] - before["score"])
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").is_file()
    written = (tmp_path / "config.json").read_text()
    assert "python:brightness" in written and "python:3 prompts" in written
    card = (tmp_path / "final" / "README.md").read_text()  # the model card names what was passed
    assert "the reward `python:brightness`" in card and "| train prompts | python:3 prompts |" in card
    assert f"| score | {before['score']:.4f} | {after['score']:.4f} |" in card


def test_a_reward_object_and_a_loaded_adapter(tiny_sd3_dir, tmp_path):
    from pipelines import load_adapter

    class Redness(flowalign.Reward):
        components = ("redness",)

        def __call__(self, samples, prompts, metadata):
            return {"redness": samples[:, 0].mean((1, 2)) - samples[:, 1:].mean((1, 2, 3))}

    config = tiny_run_config(tiny_sd3_dir, tmp_path, epochs=1)
    config.model.path = "shapes-sd3"  # not read: the adapter is given
    config.reward.weights = {"redness": 1.0}
    adapter = load_adapter("sd3", str(tiny_sd3_dir))
    summary = flowalign.train(config, reward=Redness(), prompts=["a photo of a red circle"] * 2, adapter=adapter)
    assert "redness" in summary["after"]
    assert any("lora" in name for name, _ in adapter.trainable().named_parameters())  # trained in place


def test_a_runconfig_built_in_python_is_checked_like_a_file(tiny_sd3_dir, tmp_path):
    config = tiny_run_config(tiny_sd3_dir, tmp_path)
    config.train.epochs = "2"
    with pytest.raises(flowalign.ConfigError, match=r"RunConfig: train.epochs must be int, got str '2'"):
        flowalign.train(config, reward=brightness)
    config = tiny_run_config(tiny_sd3_dir, tmp_path)
    config.sampling.step_mode = "some"
    with pytest.raises(flowalign.ConfigError, match="sampling.step_mode must be one of"):
        flowalign.Trainer(config)
    config = tiny_run_config(tiny_sd3_dir, tmp_path)
    config.model = {"path": "x"}
    with pytest.raises(flowalign.ConfigError, match="model must be a ModelConfig"):
        flowalign.train(config)
    config = tiny_run_config(tiny_sd3_dir, tmp_path, inner_epochs=0)  # a cross-field rule, as for a file
    with pytest.raises(flowalign.ConfigError, match="train.inner_epochs must be ≥ 1"):
        flowalign.train(config, reward=brightness)


def test_a_plain_function_registers_as_is_with_its_options(tiny_sd3_dir, tmp_path):
    import torch

    from reward_models.base import build_reward

    def scaled_brightness(samples, prompts, metadata, scale=1.0):
        return {"bright": scale * samples.mean(dim=(1, 2, 3))}

    assert flowalign.register_reward("test_api_scaled_brightness")(scaled_brightness) is scaled_brightness
    flowalign.register_reward("test_api_scaled_brightness")(scaled_brightness)  # registering again is harmless
    reward = build_reward("test_api_scaled_brightness", scale=2.0)
    assert torch.equal(reward(torch.ones(2, 3, 4, 4), ["a", "b"], [{}, {}])["bright"], torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="already registered"):
        flowalign.register_reward("test_api_scaled_brightness")(brightness)
    # its options are checked against its signature before any model loads
    config = tiny_run_config(tiny_sd3_dir, tmp_path)
    config.reward.name, config.reward.kwargs = "test_api_scaled_brightness", {"sclae": 2.0}
    with pytest.raises(flowalign.ConfigError, match="takes no argument 'sclae'; it accepts: scale"):
        flowalign.train(config)
