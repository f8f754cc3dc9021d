"""The shipped UNet demo model shapes-sd15 (scripts/pretrain_shapes.py --family sd): it loads by
name through the SD adapter, decodes as plain diffusers does (no latent shift), and a DDPO epoch
of configs/shapes_ddpo.yaml runs on it."""

import pytest
import torch
from diffusers import StableDiffusionPipeline

from flowalign.config import load_config
from flowalign.trainer import Trainer
from pipelines import load_adapter, resolve_model_path



@pytest.fixture(scope="module")
def adapter():
    return load_adapter("sd", "shapes-sd15")


def test_loads_by_name_with_the_shapes_sd3_vae_and_sd1_latents(adapter):
    assert resolve_model_path("shapes-sd15").endswith("demo_models/shapes-sd15")
    assert isinstance(adapter.pipe, StableDiffusionPipeline)
    assert (adapter.height, adapter.width) == (32, 32)
    assert adapter.latent_shape() == (4, 16, 16)
    assert adapter.pipe.vae.config.shift_factor is None  # SD1.x decodes latents / scaling_factor, no shift
    assert adapter.prediction_type == "epsilon" and adapter.clip_sample_range is None
    weights = sum(p.numel() * p.element_size() for m in adapter.pipe.components.values()
                  if isinstance(m, torch.nn.Module) for p in m.parameters())
    assert weights <= 8e6


def test_adapter_decodes_as_the_pipeline(adapter):
    x0 = torch.randn(2, *adapter.latent_shape(), generator=torch.Generator().manual_seed(0))
    vae = adapter.pipe.vae
    with torch.no_grad():
        expected = (vae.decode(x0 / vae.config.scaling_factor).sample / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(adapter.decode(x0), expected)


def test_a_ddpo_epoch_runs_on_it(tmp_path):
    config = load_config("configs/shapes_ddpo.yaml", [
        f"output_dir={tmp_path}", "tracker=none", "checkpoint_every=0", "model.lora_rank=4",
        "sampling.num_steps=4", "train.epochs=1", "train.groups_per_epoch=1", "train.group_size=4",
        "train.sample_batch_size=4", "train.train_batch_size=4", "eval.every=0", "eval.seeds=1",
        "eval.grid_prompts=2", "eval.grid_seeds=1"])
    trainer = Trainer(config)
    trainer.train()
    first = trainer.history[0]
    assert first["train/ratio"] == pytest.approx(1.0, abs=1e-6)  # one update per rollout: on policy
    assert first["train/grad_norm"] > 0
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_a_folder_of_another_family_is_named_before_any_weight_loads(tmp_path):
    from flowalign.config import ConfigError
    from pipelines import folder_family

    assert folder_family("shapes-sd15") == "sd" and folder_family("shapes-sd3") == "sd3"
    assert folder_family("stabilityai/stable-diffusion-3.5-medium") is None  # a hub id: nothing to read
    with pytest.raises(ConfigError, match=r"StableDiffusionPipeline \(model family 'sd'\).*model.family=sd"):
        Trainer(load_config("configs/shapes_flow_grpo.yaml", ["model.path=shapes-sd15", "tracker=none",
                                                              f"output_dir={tmp_path}"]))


def test_flowalign_sample_reads_the_family_from_the_folder(tmp_path):
    from flowalign.cli import main

    out = tmp_path / "circle-{seed}.png"
    assert main(["sample", "--model", "shapes-sd15", "a photo of a red circle", "--steps", "2", "--seeds", "0",
                 "--out", str(out)]) == 0
    assert (tmp_path / "circle-0.png").is_file()
