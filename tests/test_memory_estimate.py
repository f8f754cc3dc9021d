"""The dry run answers "can I run this?": every real-model recipe prints its parameters (its
shipped config built on the meta device), a memory estimate and the download size, with no
weight and no download; the estimate's parts follow the formula in flowalign/memory_estimate.py."""

import pytest
import torch

from flowalign.cli import main
from flowalign.config import load_config
from flowalign.memory_estimate import build_on_meta, denoiser_configs, estimate, lora_parameters
from test_recipes import HUB_IDS, USER_FILES, USER_PROMPTS, no_loading  # noqa: F401  (a fixture)

PUBLISHED = {  # hub id → parameters of the trained denoiser, in billions (the model cards' sizes)
    "stabilityai/stable-diffusion-3.5-medium": 2.24, "black-forest-labs/FLUX.1-dev": 11.9,
    "stable-diffusion-v1-5/stable-diffusion-v1-5": 0.86, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": 1.42,
    "Qwen/Qwen-Image": 20.4, "Tongyi-MAI/Z-Image-Turbo": 6.15, "Wan-AI/Wan2.2-TI2V-5B-Diffusers": 5.0,
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": 2 * 14.29, "black-forest-labs/FLUX.2-klein-base-4B": 3.88}


@pytest.mark.parametrize("recipe", sorted(HUB_IDS))
def test_every_real_model_recipes_dry_run_says_what_it_needs(recipe, no_loading, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    missing = recipe in USER_PROMPTS or recipe in USER_FILES
    assert main(["train", f"{__file__.rsplit('/tests/', 1)[0]}/configs/{recipe}", "--dry-run"]) == (2 if missing else 0)
    out = capsys.readouterr().out
    assert "  parameters       denoiser " in out and "(its config on the meta device)" in out
    assert "  memory estimate  ≈ " in out and " GB per process on the accelerator" in out
    assert "  download         ≈ " in out and " GB (every component at 16 bits per weight)" in out


@pytest.mark.parametrize("hub_id, billions", sorted(PUBLISHED.items()))
def test_the_shipped_configs_build_the_published_sizes(hub_id, billions):
    configs = denoiser_configs(hub_id)
    total = sum(p.numel() for cfg in configs.values() for p in build_on_meta(cfg).parameters())
    assert total / 1e9 == pytest.approx(billions, rel=0.01)
    assert all(p.is_meta for cfg in configs.values() for p in build_on_meta(cfg).parameters())


def test_the_lora_count_is_what_peft_adds(tiny_sd3_dir):
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    from pipelines.sd3 import SD3Adapter

    model = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer")
    expected = lora_parameters(model, 4, SD3Adapter.lora_targets)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(SD3Adapter.lora_targets)))
    added = sum(p.numel() for name, p in model.named_parameters() if "lora" in name)
    assert expected == added > 0


def test_the_estimate_is_the_formula():
    config = load_config("configs/sd35m_flow_grpo_pickscore.yaml")
    e = estimate(config, None)
    frozen = sum(e["frozen"].values())
    assert e["weights"] == (frozen + e["denoiser"]) * 2  # bfloat16 frozen weights, the LoRA'd transformer too
    assert e["optimizer"] == e["trained"] * (4 + 4 + 8 + 4)  # float32 LoRA, its gradient, AdamW, the EMA
    assert e["tokens"] == (512 // 16) ** 2 + 128 + 77 and e["batch"] == 72 * 2  # 32×32 patches, T5 + CLIP; CFG
    assert e["activations"] == 24 * 17 * e["tokens"] * e["batch"] * 1536 * 2
    checkpointed = estimate(load_config("configs/sd35m_flow_grpo_pickscore.yaml",
                                        ["model.gradient_checkpointing=true", "model.offload_text_encoders=true"]), None)
    assert checkpointed["activations"] == (24 + 17) * e["tokens"] * e["batch"] * 1536 * 2  # block inputs + one block
    assert checkpointed["weights"] < e["weights"] and checkpointed["weights"] == pytest.approx(
        (e["denoiser"] + e["frozen"]["vae"]) * 2)
    full = estimate(load_config("configs/sd35m_flow_grpo_pickscore.yaml", ["model.lora_rank=0",
                                                                            "train.optimizer=adamw8bit"]), None)
    assert config.train.kl_beta > 0  # full fine-tuning then keeps a bfloat16 reference copy as well
    assert full["trained"] == full["denoiser"] and full["optimizer"] == full["denoiser"] * (4 + 4 + 2 + 4 + 2)
    assert e["download"] == pytest.approx((frozen + e["denoiser"]) * 2)
    assert torch.device("meta")  # nothing above allocated a weight: every model was built on the meta device


def test_a_built_in_model_counts_its_own_folder():
    e = estimate(load_config("configs/shapes_nft.yaml"), None)
    assert set(e["frozen"]) == {"text_encoder", "text_encoder_2", "vae"} and all(v > 0 for v in e["frozen"].values())
    assert e["download"] is None
