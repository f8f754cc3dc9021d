"""Image-conditioned generation (FLUX.1-Kontext) end to end: prompt records carrying a
conditioning image (jsonl and CSV) → the adapter's conditioning → rollouts equal to the diffusers
pipeline given the same image → training with every flow objective → rewards receiving the image in
their metadata (the edit-fidelity reward on tiny random CLIP weights in the real layout) → the
evaluation grid showing each input beside its outputs; the LoRA loads in plain diffusers."""

import json
import math
import random

import numpy as np
import pytest
import torch
from adapter_checks import (FLOW_METHODS, assert_on_policy_at_init, assert_trained, reference_predictions,
                            rescored_gradients, train_once)
from diffusers import FluxKontextPipeline
from PIL import Image
from test_neural_rewards import clip_dir, load_clip  # noqa: F401 (the tiny CLIP folder fixture)

from flowalign.config import load_config
from flowalign.prompts import load_prompts
from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from flowalign.trainer import Trainer
from reward_models.worlds.shapes import prompt_split, render_scene, vocabulary
from pipelines import adapter_class
from pipelines.base import PromptEmbeddingCache, encode_records, load_condition_image
from pipelines.tiny import build_tiny_flux_pipeline
from reward_models.base import Reward, build_reward, register_reward


SIZE, STEPS, TOKENS, GUIDANCE = 16, 3, 16, 2.5
EDITS = ["make the red circle blue", "move the square to the left"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny FluxKontextPipeline folder and a prompt set: two shapes scenes (PNG) with an edit each."""
    root = tmp_path_factory.mktemp("kontext")
    words = vocabulary() + sorted({w for edit in EDITS for w in edit.split()})
    FluxKontextPipeline(**build_tiny_flux_pipeline(words).components).save_pretrained(root / "model")
    (root / "inputs").mkdir()
    for i, spec in enumerate(prompt_split("train")[:2]):
        render_scene(spec, random.Random(i), size=SIZE).save(root / "inputs" / f"scene{i}.png")
    (root / "edits.jsonl").write_text("".join(json.dumps({"prompt": p, "image": f"inputs/scene{i}.png"}) + "\n"
                                              for i, p in enumerate(EDITS)))
    return root


def _adapter(world, **kwargs):
    return adapter_class("flux_kontext").from_pretrained(str(world / "model"), height=SIZE, width=SIZE,
                                                         max_sequence_length=TOKENS, **kwargs)


def _records(world):
    return load_prompts(str(world / "edits.jsonl"))


def _pipeline_latents(world, records, seed, pipe=None, with_image=True):
    pipe = pipe or FluxKontextPipeline.from_pretrained(world / "model")
    pipe.set_progress_bar_config(disable=True)
    images = [Image.open(r["image"]).convert("RGB") for r in records] if with_image else None
    return pipe(image=images, prompt=[r["prompt"] for r in records], height=SIZE, width=SIZE, max_area=SIZE * SIZE,
                _auto_resize=False, num_inference_steps=STEPS, guidance_scale=GUIDANCE, output_type="latent",
                max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(seed)).images


def _samples(adapter, records, seed, eta=0.0):
    generator = torch.Generator().manual_seed(seed)
    noise = adapter.initial_noise(len(records), generator)
    traj = rollout(adapter, encode_records(adapter.encode, records), noise, adapter.schedule(STEPS),
                   plan_steps(STEPS, len(records), eta), guidance_scale=GUIDANCE, generator=generator)
    return traj, adapter.pipe._pack_latents(traj.samples, *traj.samples.shape)


def _perturb(model, std=0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * std)


def test_prompt_records_carry_resolved_conditioning_images(world, tmp_path):
    records = _records(world)
    assert [r["image"] for r in records] == [str(world / "inputs" / f"scene{i}.png") for i in range(2)]
    (tmp_path / "edits.csv").write_text("prompt,image,tag\n" + "".join(
        f"{p},{world / 'inputs' / f'scene{i}.png'},edit\n" for i, p in enumerate(EDITS)))
    assert load_prompts(str(tmp_path / "edits.csv")) == [{**r, "tag": "edit"} for r in records]
    (tmp_path / "missing.jsonl").write_text(json.dumps({"prompt": "x", "image": "nowhere.png"}) + "\n")
    with pytest.raises(FileNotFoundError, match="nowhere.png"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    # several input images (Qwen-Image-Edit-Plus): a jsonl list or "|" in a CSV, each path resolved
    scenes = [str(world / "inputs" / f"scene{i}.png") for i in range(2)]
    (world / "several.jsonl").write_text(json.dumps({"prompt": EDITS[0], "image": ["inputs/scene1.png",
                                                                                   "inputs/scene0.png"]}) + "\n")
    assert load_prompts(str(world / "several.jsonl")) == [{"prompt": EDITS[0], "image": scenes[::-1]}]
    (tmp_path / "several.csv").write_text(f"prompt,image\n{EDITS[0]},{scenes[0]} | {scenes[1]}\n")
    assert load_prompts(str(tmp_path / "several.csv")) == [{"prompt": EDITS[0], "image": scenes}]
    (tmp_path / "one-missing.csv").write_text(f"prompt,image\nx,{scenes[0]}|nowhere.png\n")
    with pytest.raises(FileNotFoundError, match="nowhere.png"):
        load_prompts(str(tmp_path / "one-missing.csv"))


def test_eta_zero_rollout_reproduces_the_pipeline_with_the_same_image(world):
    adapter = _adapter(world)
    records = _records(world)
    expected = _pipeline_latents(world, records, seed=3)
    traj, got = _samples(adapter, records, seed=3)
    assert (got - expected).abs().max().item() <= 1e-5
    # guards: the conditioning image matters at this tolerance, and the cache gives the same conditioning
    plain = _pipeline_latents(world, records, seed=3, with_image=False)
    assert (got - plain).abs().max().item() > 1e-3
    cached = encode_records(PromptEmbeddingCache(adapter, size=4), records)
    assert all((cached.tensors[k] - traj.cond.tensors[k]).abs().max() <= 1e-5 for k in traj.cond.tensors)


def test_text_only_families_refuse_conditioning_images(world, tiny_adapter):
    with pytest.raises(ValueError, match="takes none"):
        encode_records(tiny_adapter.encode, _records(world))


def test_rescoring_reference_and_lora_round_trip(world, tmp_path):
    adapter = _adapter(world)
    records = _records(world)
    base, trained, reference = reference_predictions(adapter, EDITS, STEPS, GUIDANCE, _perturb)
    assert (trained - base).abs().max() > 1e-3 and torch.equal(reference, base)
    traj, _ = _samples(adapter, records, seed=2, eta=1.0)
    assert any(g is not None and g.abs().sum() > 0 for g in rescored_gradients(adapter, traj, STEPS - 1,
                                                                               GUIDANCE).values())
    adapter.save_trained(tmp_path / "lora")
    pipe = FluxKontextPipeline.from_pretrained(world / "model")
    pipe.load_lora_weights(tmp_path / "lora")  # FluxKontextPipeline's own LoRA loader (FluxLoraLoaderMixin)
    expected = _pipeline_latents(world, records, seed=0, pipe=pipe)
    assert (_samples(adapter, records, seed=0)[1] - expected).abs().max().item() <= 1e-5


SEEN = []


@register_reward("test_sees_the_input")
class _SeesTheInput(Reward):
    """Records the metadata it gets; scores the output's mean distance to its input image."""

    components = ("closeness",)
    modality = "image"

    def __call__(self, samples, prompts, metadata):
        SEEN.append([m.get("image") for m in metadata])
        h, w = samples.shape[-2:]
        first = [m["image"][0] if isinstance(m["image"], list) else m["image"] for m in metadata]  # Edit-Plus: several
        inputs = torch.stack([torch.from_numpy(np.array(load_condition_image(image, h, w)))
                              for image in first]).permute(0, 3, 1, 2).float() / 255
        return {"closeness": -(samples - inputs).abs().mean(dim=(1, 2, 3))}


def _config(world, out, *overrides):
    prompts = world / "edits.jsonl"
    return load_config(None, [
        f"output_dir={out}", "model.family=flux_kontext", f"model.path={world / 'model'}", "model.lora_rank=4",
        f"model.height={SIZE}", f"model.width={SIZE}", f"model.kwargs={{max_sequence_length: {TOKENS}}}",
        f"sampling.guidance_scale={GUIDANCE}", "tracker=none", f"sampling.num_steps={STEPS}", "train.epochs=1",
        "train.groups_per_epoch=2", "train.group_size=2", "train.sample_batch_size=4", "train.train_batch_size=4",
        "train.learning_rate=1e-2", f"data.train_prompts={prompts}",
        f"data.eval_prompts={prompts}", "eval.seeds=2", "eval.grid_prompts=2", "eval.grid_seeds=2",
        "checkpoint_every=0", "reward.name=test_sees_the_input", "reward.weights={closeness: 1.0}", *overrides])


@pytest.mark.parametrize("method", sorted(FLOW_METHODS))
def test_each_objective_trains_with_the_input_in_the_rewards_metadata(world, tmp_path, method):
    SEEN.clear()
    trainer, initial = train_once(_config(world, tmp_path, *FLOW_METHODS[method], "eval.every=0"))
    assert_trained(trainer, initial)
    assert_on_policy_at_init(trainer.history[0], method)
    inputs = {r["image"] for r in _records(world)}
    assert SEEN and all(image in inputs for batch in SEEN for image in batch)


def test_the_eval_grid_shows_each_input_beside_its_outputs(world, tmp_path):
    trainer = Trainer(_config(world, tmp_path, *FLOW_METHODS["flow_grpo"], "eval.every=1", "train.epochs=1"))
    trainer.train()
    grid = Image.open(tmp_path / "grids" / "before.png")
    cell = 96 + 2  # to_pil_grid's minimum cell (96 px) and its padding
    assert grid.width >= 3 * cell - 2 and grid.height >= 2 * cell - 2  # the input column, then 2 seeds; 2 rows
    first = torch.from_numpy(np.array(grid.convert("RGB"))).float()
    scene = Image.open(_records(world)[0]["image"]).convert("RGB").resize((96, 96), Image.NEAREST)
    corner = first[2:2 + 96, 2:2 + 96] if first.shape[0] > 96 else first[:96, :96]
    assert (corner.mean() - torch.from_numpy(np.array(scene)).float().mean()).abs() < 20


def test_edit_fidelity_blends_input_similarity_and_text_alignment(world, clip_dir):
    model, processor = load_clip(clip_dir)
    records = _records(world)
    samples = torch.rand(2, 3, SIZE, SIZE)
    reward = build_reward("edit_fidelity", model=str(clip_dir), input_weight=0.25, device="cpu")
    out = reward(samples, EDITS, records)

    def unit(x):
        x = x.pooler_output if hasattr(x, "pooler_output") else x
        return x / x.norm(dim=-1, keepdim=True)

    with torch.no_grad():
        to8 = (samples * 255).round().to(torch.uint8)
        o = unit(model.get_image_features(pixel_values=processor(images=to8, return_tensors="pt")["pixel_values"]))
        i = unit(model.get_image_features(pixel_values=processor(
            images=[Image.open(r["image"]).convert("RGB") for r in records], return_tensors="pt")["pixel_values"]))
        text = processor(text=EDITS, padding=True, return_tensors="pt")
        p = unit(model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"]))
    torch.testing.assert_close(out["input_similarity"], (o * i).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["text_alignment"], (o * p).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["edit_fidelity"], 0.25 * (o * i).sum(-1) + 0.75 * (o * p).sum(-1),
                               rtol=1e-5, atol=1e-5)
    same = reward(torch.stack([torch.from_numpy(np.array(Image.open(r["image"]).convert("RGB")))
                               .permute(2, 0, 1).float() / 255 for r in records]), EDITS, records)
    assert (same["input_similarity"] > 0.999).all()  # the input itself is perfectly similar
    assert torch.isnan(reward(samples, EDITS, [{}, records[1]])["edit_fidelity"][0])  # no input: dropped
    # several inputs (Edit-Plus): the mean of the similarities to each
    several = reward(samples, EDITS, [{"image": [r["image"] for r in records]}, records[1]])
    torch.testing.assert_close(several["input_similarity"][0], (o[0] * i).sum(-1).mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(several["input_similarity"][1], out["input_similarity"][1], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- Wan image-to-video

VIDEO = {"height": 32, "width": 32, "num_frames": 5}


@pytest.fixture(scope="module")
def wan_world(tmp_path_factory):
    """Tiny WanImageToVideoPipeline folders (Wan 2.1 with its CLIP image encoder; Wan 2.2 A14B's two
    experts) and an animation prompt set: one 32 px scene as every prompt's first frame."""
    from diffusers import WanImageToVideoPipeline  # noqa: F401 (the class the folders hold)

    from pipelines.tiny_zoo import build_tiny_wan_i2v_pipeline

    root = tmp_path_factory.mktemp("wan-i2v")
    for layout in ("wan21", "a14b"):
        build_tiny_wan_i2v_pipeline(vocabulary(), layout).save_pretrained(root / layout)
    render_scene(prompt_split("train")[0], random.Random(0), size=32).save(root / "scene.png")
    prompts = ["a photo of a red circle", "a photo of two squares"]
    (root / "animate.jsonl").write_text("".join(json.dumps({"prompt": p, "image": "scene.png"}) + "\n"
                                                for p in prompts))
    return root


def _wan_pipeline_latents(root, layout, records, seed, guidance, pipe=None):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    pipe = pipe or WanImageToVideoPipeline.from_pretrained(root / layout)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)  # the adapter's steps
    pipe.set_progress_bar_config(disable=True)
    return pipe(image=Image.open(records[0]["image"]).convert("RGB"), prompt=[r["prompt"] for r in records],
                num_inference_steps=4, guidance_scale=guidance, output_type="latent", max_sequence_length=TOKENS,
                generator=torch.Generator().manual_seed(seed), **VIDEO).frames


def _wan_samples(adapter, records, seed, guidance, eta=0.0):
    generator = torch.Generator().manual_seed(seed)
    noise = adapter.initial_noise(len(records), generator)
    return rollout(adapter, encode_records(adapter.encode, records), noise, adapter.schedule(4),
                   plan_steps(4, len(records), eta), guidance_scale=guidance, generator=generator)


@pytest.mark.parametrize("layout", ["wan21", "a14b"])
def test_wan_i2v_rollout_reproduces_the_pipeline_and_its_lora_loads(wan_world, layout, tmp_path):
    records = load_prompts(str(wan_world / "animate.jsonl"))
    adapter = adapter_class("wan_i2v").from_pretrained(str(wan_world / layout), max_sequence_length=TOKENS, **VIDEO)
    expected = _wan_pipeline_latents(wan_world, layout, records, 3, 3.0)
    assert (_wan_samples(adapter, records, 3, 3.0).samples - expected).abs().max().item() <= 1e-5
    adapter.add_lora(rank=4)
    _perturb(adapter.model)
    traj = _wan_samples(adapter, records, 2, 3.0, eta=1.0)
    assert any(g is not None and g.abs().sum() > 0 for g in rescored_gradients(adapter, traj, 3, 3.0).values())
    with torch.no_grad(), adapter.reference():
        assert (_wan_samples(adapter, records, 3, 3.0).samples - expected).abs().max().item() <= 1e-5
    adapter.save_trained(tmp_path / "lora")
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(wan_world / layout)
    pipe.load_lora_weights(tmp_path / "lora")  # diffusers' Wan loader (WanLoraLoaderMixin)
    if layout == "a14b":
        pipe.load_lora_weights(tmp_path / "lora" / "transformer_2_lora", load_into_transformer_2=True)
    loaded = _wan_pipeline_latents(wan_world, layout, records, 0, 3.0, pipe=pipe)
    assert (_wan_samples(adapter, records, 0, 3.0).samples - loaded).abs().max().item() <= 1e-5
    assert (loaded - _wan_pipeline_latents(wan_world, layout, records, 0, 3.0)).abs().max().item() > 1e-3


@pytest.mark.parametrize("method", sorted(FLOW_METHODS))
def test_wan_i2v_trains_with_every_objective(wan_world, tmp_path, method):
    SEEN.clear()
    prompts = wan_world / "animate.jsonl"
    trainer = Trainer(load_config(None, [
        f"output_dir={tmp_path}", "model.family=wan_i2v", f"model.path={wan_world / 'a14b'}", "model.lora_rank=4",
        *[f"model.{k}={v}" for k, v in VIDEO.items()], f"model.kwargs={{max_sequence_length: {TOKENS}}}",
        "sampling.guidance_scale=3.0", "tracker=none", "sampling.num_steps=4", "train.epochs=1",
        "train.groups_per_epoch=2", "train.group_size=2", "train.sample_batch_size=4", "train.train_batch_size=4",
        "train.learning_rate=1e-2", f"data.train_prompts={prompts}",
        f"data.eval_prompts={prompts}", "eval.seeds=1", "eval.grid_prompts=2", "eval.grid_seeds=1",
        f"eval.every={1 if method == 'flow_grpo' else 0}", "checkpoint_every=0", "reward.name=per_frame",
        "reward.kwargs={reward: test_sees_the_input}", "reward.weights={closeness: 1.0}", *FLOW_METHODS[method]]))
    initial = [p.detach().clone() for p in trainer.params]
    trainer.train()
    stats = trainer.history[0]
    assert math.isfinite(stats["train/policy_loss"]) and stats["train/grad_norm"] > 0
    assert any((p.detach() - p0).abs().max() > 0 for p, p0 in zip(trainer.params, initial))
    assert SEEN and all(image == str(wan_world / "scene.png") for batch in SEEN for image in batch)
    if method == "flow_grpo":  # the grid: the input frame, then the video's contact sheet
        grid = Image.open(tmp_path / "grids" / "before.png")
        assert grid.width > grid.height


# --------------------------------------------------------------------------- Qwen-Image-Edit(-Plus)

# the pipelines encode each input at 1024² pixels (the real checkpoints'): 4096 tokens of this tiny model per
# input at every step. Here adapter and pipeline alike encode it at 64² (calculate_dimensions' target area,
# patched in both), which exercises the same code at 1/256 of the cost.
CONDITION_AREA = 64 * 64


@pytest.fixture
def small_condition(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    from pipelines.qwen_image_edit import QwenImageEditAdapter
    from pipelines.qwen_image_edit_plus import QwenImageEditPlusAdapter

    original = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",  # QwenImageEditPipeline's inline 1024²
                        lambda area, ratio: original(CONDITION_AREA if area == 1024 * 1024 else area, ratio))
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", CONDITION_AREA)
    monkeypatch.setattr(QwenImageEditAdapter, "condition_area", CONDITION_AREA)
    monkeypatch.setattr(QwenImageEditPlusAdapter, "condition_area", CONDITION_AREA)


@pytest.fixture(scope="module")
def qwen_edit(world, tmp_path_factory):
    """Tiny QwenImageEditPipeline and QwenImageEditPlusPipeline folders (the same weights); the prompt
    sets are ``world``'s (scenes with edits) and, for Edit-Plus, each edit with both scenes as inputs."""
    from pipelines.tiny_zoo import build_tiny_qwen_image_edit_pipeline

    root = tmp_path_factory.mktemp("qwen-edit")
    words = vocabulary() + sorted({w for e in EDITS for w in e.split()})
    for family, plus in (("qwen_image_edit", False), ("qwen_image_edit_plus", True)):
        build_tiny_qwen_image_edit_pipeline(words, plus=plus).save_pretrained(root / family)
    scenes = [str(world / "inputs" / f"scene{i}.png") for i in range(2)]
    (root / "plus.jsonl").write_text("".join(json.dumps({"prompt": p, "image": scenes[i:] + scenes[:i]}) + "\n"
                                             for i, p in enumerate(EDITS)))
    return root


def _qwen_edit_records(world, qwen_edit, family):
    return load_prompts(str(qwen_edit / "plus.jsonl") if family.endswith("plus") else str(world / "edits.jsonl"))


def _qwen_edit_latents(path, records, seed, family, pipe=None):
    pipe = pipe or adapter_class(family).pipeline_class.from_pretrained(path / family)
    pipe.set_progress_bar_config(disable=True)
    out = []
    for r in records:  # the pipelines take one prompt per call
        images = r["image"] if isinstance(r["image"], list) else [r["image"]]
        images = [Image.open(i).convert("RGB") for i in images]
        out.append(pipe(image=images if family.endswith("plus") else images[0], prompt=[r["prompt"]], height=32,
                        width=32, num_inference_steps=STEPS, true_cfg_scale=4.0, negative_prompt=" ",
                        output_type="latent", max_sequence_length=64,
                        generator=torch.Generator().manual_seed(seed)).images)
    return out


@pytest.mark.parametrize("family", ["qwen_image_edit", "qwen_image_edit_plus"])
def test_qwen_image_edit_reproduces_the_pipeline_trains_and_its_lora_loads(world, qwen_edit, tmp_path, family,
                                                                           small_condition):
    records = _qwen_edit_records(world, qwen_edit, family)
    adapter = adapter_class(family).from_pretrained(str(qwen_edit / family), height=32, width=32,
                                                    max_sequence_length=64)

    def samples(seed, eta=0.0, records=records):  # each record alone: the pipeline's noise for one prompt per call
        out = []
        for r in records:
            generator = torch.Generator().manual_seed(seed)
            traj = rollout(adapter, encode_records(adapter.encode, [r]), adapter.initial_noise(1, generator),
                           adapter.schedule(STEPS), plan_steps(STEPS, 1, eta), guidance_scale=4.0, generator=generator)
            out.append((traj, adapter.pipe._pack_latents(traj.samples, *traj.samples.shape)))
        return out

    expected = _qwen_edit_latents(qwen_edit, records, 3, family)
    got = samples(3)
    assert all((g - exp).abs().max().item() <= 1e-5 for (_, g), exp in zip(got, expected))
    tokens = {"qwen_image_edit": 16, "qwen_image_edit_plus": 32}[family]  # 4×4 tokens of each 64² input
    assert got[0][0].cond.tensors["image_latents"].shape[1] == tokens
    if family.endswith("plus"):  # guard: both inputs, in their order, matter at this tolerance
        swapped = [{**r, "image": r["image"][::-1]} for r in records]
        assert (samples(3, records=swapped)[0][1] - expected[0]).abs().max() > 1e-4  # 10× the tolerance
        with pytest.raises(ValueError, match="number and aspect ratios"):
            adapter.encode(["x"], images=[[records[0]["image"][0]]])
    adapter.add_lora(rank=4)
    _perturb(adapter.model)
    traj, _ = samples(2, eta=1.0)[0]
    assert any(g is not None and g.abs().sum() > 0 for g in rescored_gradients(adapter, traj, STEPS - 1, 4.0).values())
    adapter.save_trained(tmp_path / "lora")
    pipe = adapter_class(family).pipeline_class.from_pretrained(qwen_edit / family)
    pipe.load_lora_weights(tmp_path / "lora")  # the pipeline's own loader (QwenImageLoraLoaderMixin)
    loaded = _qwen_edit_latents(qwen_edit, records, 0, family, pipe=pipe)
    assert all((g - exp).abs().max().item() <= 1e-5 for (_, g), exp in zip(samples(0), loaded))

    SEEN.clear()
    prompts = qwen_edit / "plus.jsonl" if family.endswith("plus") else world / "edits.jsonl"
    trainer = Trainer(load_config(None, [
        f"output_dir={tmp_path / 'run'}", f"model.family={family}", f"model.path={qwen_edit / family}",
        "model.lora_rank=4", "model.height=32", "model.width=32", "model.kwargs={max_sequence_length: 64}",
        "sampling.guidance_scale=1.0", "tracker=none", f"sampling.num_steps={STEPS}", "train.epochs=1",
        "train.groups_per_epoch=2", "train.group_size=2", "train.sample_batch_size=4", "train.train_batch_size=4",
        "train.learning_rate=1e-2", f"data.train_prompts={prompts}",
        f"data.eval_prompts={prompts}", "eval.seeds=1", "eval.grid_prompts=2", "eval.grid_seeds=1", "eval.every=0",
        "checkpoint_every=0", "reward.name=test_sees_the_input", "reward.weights={closeness: 1.0}",
        *FLOW_METHODS["flow_grpo"]]))
    trainer.train()
    stats = trainer.history[0]
    assert stats["train/ratio"] == pytest.approx(1.0, abs=1e-6) and stats["train/grad_norm"] > 0
    given = {str(r["image"]) for r in records}
    assert SEEN and all(str(image) in given for batch in SEEN for image in batch)


def test_flowalign_eval_conditions_on_the_records_images(world, tmp_path):
    from flowalign.evaluation import Policy, evaluate

    SEEN.clear()
    summary = evaluate([Policy("base", None)], _records(world), {"seen": build_reward("test_sees_the_input")},
                       tmp_path / "eval", model=str(world / "model"), family="flux_kontext", seeds=[0, 1], steps=STEPS,
                       guidance=GUIDANCE, loading={"height": SIZE, "width": SIZE,
                                                   "options": {"max_sequence_length": TOKENS}})
    assert SEEN and all(image in {r["image"] for r in _records(world)} for batch in SEEN for image in batch)
    assert summary


def test_flowalign_grid_shows_each_records_input_beside_its_outputs(world, tmp_path):
    from flowalign.cli import main

    recipe = tmp_path / "kontext.yaml"
    recipe.write_text(f"model:\n  family: flux_kontext\n  path: {world / 'model'}\n  height: {SIZE}\n  width: {SIZE}\n"
                      f"  kwargs: {{max_sequence_length: {TOKENS}}}\n")
    common = ["grid", "--config", str(recipe), "--seeds", "0,1", "--steps", "2", "--guidance", str(GUIDANCE)]
    assert main([*common, "--prompts", str(world / "edits.jsonl"), "--out", str(tmp_path / "grid.png")]) == 0
    grid = np.array(Image.open(tmp_path / "grid.png").convert("RGB"))
    cell = SIZE * 6  # to_pil_grid upscales 16-pixel samples 6× (its 96-pixel minimum), with 2-pixel padding
    body_width = 3 * (cell + 2) + 2  # the input column, then 1 policy × 2 seeds
    top, left = 2 * (12 + 6), grid.shape[1] - body_width  # under labelled_grid's two header lines, right-aligned
    for row, record in enumerate(_records(world)):
        scene = np.array(Image.open(record["image"]).convert("RGB").resize((cell, cell), Image.NEAREST))
        y, x = top + 2 + row * (cell + 2), left + 2
        assert np.array_equal(grid[y:y + cell, x:x + cell], scene), row  # each row's own input, first
        assert not np.array_equal(grid[y:y + cell, x + cell + 2:x + 2 * cell + 2], scene)  # then the outputs
    # --prompt with --image: the same grid as the prompt file's records
    pairs = [arg for r in _records(world) for arg in ("--prompt", r["prompt"], "--image", r["image"])]
    assert main([*common, *pairs, "--out", str(tmp_path / "flags.png")]) == 0
    assert np.array_equal(np.array(Image.open(tmp_path / "flags.png").convert("RGB")), grid)
    assert main([*common, "--prompt", EDITS[0], "--image", "nowhere.png", "--out", str(tmp_path / "x.png")]) == 2
