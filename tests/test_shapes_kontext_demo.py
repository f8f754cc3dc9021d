"""The shipped edit demo model shapes-kontext (scripts/pretrain_shapes_edit.py) and its recipe
configs/shapes_edit_nft.yaml: the shapes_edit:<split> prompt sources, the pre-training's input
conditioning equal to the Kontext adapter's, the model loading by name through the Kontext adapter
with η = 0 rollouts equal to FluxKontextPipeline's, and a DiffusionNFT epoch of the recipe."""

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from flowalign.config import load_config
from flowalign.prompts import load_prompts
from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from flowalign.trainer import Trainer
from pipelines import folder_family, load_adapter
from pipelines.base import DEMO_MODELS_DIR, encode_records
from reward_models.worlds.shapes_edit import draw_objects, edit_prompt_file, edit_split, write_edit_prompts
from script_module import load_script

FOLDER = DEMO_MODELS_DIR / "shapes-kontext"
RECIPE = Path(__file__).resolve().parents[1] / "configs" / "shapes_edit_nft.yaml"
TOKENS = 8  # the recipe's model.kwargs.max_sequence_length


def _script():
    return load_script("pretrain_shapes_edit")


@pytest.fixture(scope="module")
def adapter():
    return load_adapter("flux_kontext", "shapes-kontext", height=32, width=32,
                        options={"max_sequence_length": TOKENS})


def test_the_edit_prompt_source_is_the_written_prompt_file_made_once(tmp_path):
    path = edit_prompt_file("test", cache=tmp_path)
    records = load_prompts(str(path))
    written = load_prompts(str(write_edit_prompts(tmp_path / "by-hand", "test")))
    assert len(records) == len(edit_split("test")) == 189
    strip = lambda r: {k: v for k, v in r.items() if k != "image"}  # noqa: E731
    assert [strip(r) for r in records] == [strip(r) for r in written]
    image = Image.open(records[5]["image"]).convert("RGB")
    assert image.tobytes() == draw_objects(records[5]["objects"]).convert("RGB").tobytes()
    stamp = path.stat().st_mtime_ns
    assert edit_prompt_file("test", cache=tmp_path) == path and path.stat().st_mtime_ns == stamp  # not rewritten
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("flowalign-shapes-edit")] == [path.parent.name]
    builtin = load_prompts("shapes_edit:train")  # the recipe's source (the system's temporary folder)
    assert len(builtin) == len(edit_split("train")) and all(Path(r["image"]).is_file() for r in builtin)
    with pytest.raises(ValueError, match="split"):
        load_prompts("shapes_edit:dev")


def test_pretraining_gives_the_input_image_as_the_kontext_adapter_encodes_it(adapter, tmp_path):
    """The input latents the script trains on are the adapter's "image_latents" of the same scene
    (VAE mode, shifted and scaled, packed): what the model learnt to read is what sampling feeds it."""
    script = _script()
    records = load_prompts(str(write_edit_prompts(tmp_path, "test")))[:3]
    pixels = script.to_tensor([draw_objects(r["objects"]) for r in records])
    latents = script.encode_latents(adapter.pipe.vae, pixels)
    n, c, h, w = latents.shape
    expected = encode_records(adapter.encode, records).tensors["image_latents"]
    torch.testing.assert_close(adapter.pipe._pack_latents(latents, n, c, h, w), expected, atol=1e-5, rtol=1e-5)


def test_loads_by_name_fits_the_budget_and_its_record_describes_it(adapter):
    assert folder_family("shapes-kontext") == "flux_kontext"
    assert isinstance(adapter.pipe, FluxKontextPipeline) and adapter.latent_shape() == (4, 16, 16)
    assert sum(f.stat().st_size for f in FOLDER.rglob("*") if f.is_file()) <= 15 * 2**20
    settings = json.loads((FOLDER / "pretraining.json").read_text())
    transformer = json.loads((FOLDER / "transformer" / "config.json").read_text())
    assert (transformer["num_layers"], transformer["num_single_layers"], transformer["num_attention_heads"],
            transformer["attention_head_dim"]) == (settings["layers"], settings["single_layers"], settings["heads"],
                                                   settings["head_dim"])
    assert settings["steps_done"] > 0 and settings["minutes"] > 0 and settings["edit_accuracy"]


def test_an_ode_rollout_equals_the_kontext_pipeline(adapter, tmp_path):
    records = load_prompts(str(write_edit_prompts(tmp_path, "test")))[:2]
    steps, generator = 3, torch.Generator().manual_seed(7)
    noise = adapter.initial_noise(len(records), generator)
    traj = rollout(adapter, encode_records(adapter.encode, records), noise, adapter.schedule(steps),
                   plan_steps(steps, len(records), 0.0), guidance_scale=1.0)
    pipe = FluxKontextPipeline.from_pretrained(FOLDER)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(image=[Image.open(r["image"]).convert("RGB") for r in records],
                    prompt=[r["prompt"] for r in records], height=32, width=32, max_area=32 * 32,
                    _auto_resize=False, num_inference_steps=steps, guidance_scale=1.0, output_type="latent",
                    max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(7)).images
    torch.testing.assert_close(adapter.pipe._pack_latents(traj.samples, *traj.samples.shape), expected,
                               atol=1e-5, rtol=0)


def test_a_diffusion_nft_epoch_of_the_recipe_runs(tmp_path):
    held_out = load_prompts("shapes_edit:test")[:4]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))  # absolute image paths
    config = load_config(str(RECIPE), [
        f"output_dir={tmp_path / 'run'}", "tracker=none", "checkpoint_every=0", "model.lora_rank=4",
        "sampling.num_steps=3", "train.epochs=1", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "train.noise_draws=1", "eval.every=0",
        "eval.seeds=1", "eval.grid_prompts=2", "eval.grid_seeds=1", f"data.eval_prompts={tmp_path / 'held.jsonl'}"])
    assert config.data.train_prompts == "shapes_edit:train" and config.reward.name == "shapes_edit"
    trainer = Trainer(config)
    initial = [p.detach().clone() for p in trainer.params]
    summary = trainer.train()
    stats = trainer.history[0]
    assert stats["train/grad_norm"] > 0 and stats["train/skipped_nonfinite"] == 0
    assert any((p.detach() - p0).abs().max() > 0 for p, p0 in zip(trainer.params, initial))
    assert summary["after"]["samples"] == 4
    for component in ("edit_accuracy", "instruction", "preserved"):  # every edit judged (NaN: no input image)
        assert 0 <= summary["after"][component] <= 1
    assert (tmp_path / "run" / "final" / "pytorch_lora_weights.safetensors").is_file()
