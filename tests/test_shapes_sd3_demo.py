"""The shipped demo model shapes-sd3 (scripts/pretrain_shapes.py): it loads by name as a plain
StableDiffusion3Pipeline folder, fits the size budget, and its recorded baseline is the one the
demo config's first evaluation measures (same prompts, seeds and sampling)."""

import json

import torch
from diffusers import StableDiffusion3Pipeline

from flowalign.config import load_config
from reward_models.worlds.shapes import CATEGORIES, prompt_split
from pipelines import load_adapter
from pipelines.base import DEMO_MODELS_DIR

FOLDER = DEMO_MODELS_DIR / "shapes-sd3"


def test_loads_by_name_and_fits_the_size_budget():
    assert sum(f.stat().st_size for f in FOLDER.rglob("*") if f.is_file()) <= 20 * 2**20
    adapter = load_adapter("sd3", "shapes-sd3")
    assert isinstance(adapter.pipe, StableDiffusion3Pipeline)
    assert (adapter.height, adapter.width) == (32, 32) and adapter.latent_shape() == (4, 16, 16)
    image = adapter.pipe("a photo of a red circle", num_inference_steps=2, guidance_scale=1.0, output_type="pt",
                         generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


def test_baseline_was_measured_with_the_demo_configs_evaluation():
    baseline = json.loads((FOLDER / "baseline.json").read_text())
    config = load_config(baseline["config"], baseline["overrides"])
    assert config.model.path == "shapes-sd3" and config.data.eval_prompts == "shapes:test"
    assert baseline["samples"] == len(prompt_split("test")) * config.eval.seeds
    assert set(baseline["accuracy_by_category"]) == set(CATEGORIES)
    assert 0 <= baseline["accuracy"] <= 1


def test_pretraining_record_describes_the_shipped_transformer():
    """pretraining.json must be the record of these weights: a retrained model with a stale record
    (another depth or width) fails here."""
    settings = json.loads((FOLDER / "pretraining.json").read_text())
    transformer = json.loads((FOLDER / "transformer" / "config.json").read_text())
    assert settings["family"] == "sd3" and settings["flow_steps"] > 0 and settings["minutes"] > 0
    assert (transformer["num_layers"], transformer["num_attention_heads"], transformer["attention_head_dim"]) == (
        settings["layers"], settings["heads"], settings["head_dim"])
