"""Image-to-video families whose input image is the first latent frame: LTX-2 image-to-audio-video
(``LTX2ImageToVideoPipeline``) and Wan 2.2 TI2V-5B's image-to-video mode (``WanImageToVideoPipeline``
with ``expand_timesteps``). Their samples x are the generated frames only (the input frame is
conditioning): η = 0 rollouts equal the pipeline given the same image, decoding (with the input
frame) equals its "pt" output, SDE steps rescore exactly, the reference policy is the base model,
the LoRA loads in plain diffusers, and every flow objective trains through the trainer with the
input in the rewards' metadata and beside the output in the evaluation grid."""

import json
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
from adapter_checks import FLOW_METHODS, assert_on_policy_at_init, assert_trained, rescored_gradients, train_once
from PIL import Image

from flowalign.config import load_config
from flowalign.prompts import load_prompts
from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from pipelines import adapter_class, load_adapter
from pipelines.base import PromptEmbeddingCache, decode_samples, encode_records
from reward_models.base import Reward, register_reward
from reward_models.worlds.shapes import prompt_split, render_scene, vocabulary

PROMPTS = ["a photo of a red circle", "a photo of two squares"]
STEPS, TOKENS, GUIDANCE = 4, 16, 3.0
# the LTX-2 pipeline's call defaults add spatio-temporal and modality guidance and a rescale: off, as the adapter's
LTX_PLAIN = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0,
             "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0, "audio_guidance_scale": 5.0, "image_crf": 0}


def _ltx_build():
    from diffusers import LTX2ImageToVideoPipeline

    from pipelines.tiny import build_tiny_ltx2_pipeline

    return LTX2ImageToVideoPipeline(**build_tiny_ltx2_pipeline(vocabulary()).components)


def _ltx_latents(pipe, out):
    """LTX2ImageToVideoPipeline's latent output → (input frame [B, h·w, C] packed, the adapter's joint
    latent of the generated frames and the audio), both normalised as the pipeline denoises them."""
    vae, audio_vae = pipe.vae, pipe.audio_vae
    video = pipe._normalize_latents(out.frames, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(out.audio), audio_vae.latents_mean,
                                          audio_vae.latents_std)
    return pipe._pack_latents(video[:, :, :1]), torch.cat([pipe._pack_latents(video[:, :, 1:]).flatten(1),
                                                           audio.flatten(1)], dim=1)


def _wan_build():
    from diffusers import WanImageToVideoPipeline

    from pipelines.tiny_zoo import build_tiny_wan22_pipeline

    return WanImageToVideoPipeline(**build_tiny_wan22_pipeline(vocabulary(), "ti2v").components, expand_timesteps=True)


def _wan_pipeline(pipe):
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)  # the adapter's steps
    return pipe


@dataclass
class Variant:
    """family; builder; sizes; adapter options; the pipeline call's extra arguments; ``prepare(pipe)``
    (the pipeline as the adapter steps it); ``latents(pipe, out) → (input frame, samples x)``; the
    conditioning key of the input frame; the LoRA's further loader arguments."""

    family: str
    build: Callable
    sizes: dict
    options: dict
    call: dict
    prepare: Callable
    latents: Callable
    frame_key: str


VARIANTS = {
    "ltx2_i2av": Variant("ltx2_i2av", _ltx_build, {"height": 32, "width": 32, "num_frames": 5},
                         {"frame_rate": 25.0, "audio_guidance_scale": 5.0, "image_crf": 0},
                         {"frame_rate": 25.0, **LTX_PLAIN}, lambda pipe: pipe, _ltx_latents, "image_latents"),
    "wan22_ti2v_i2v": Variant("wan_i2v", _wan_build, {"height": 64, "width": 64, "num_frames": 5}, {}, {},
                              _wan_pipeline, lambda pipe, out: (out.frames[:, :, :1], out.frames[:, :, 1:]),
                              "first_frame"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Each variant's tiny pipeline folder; two shapes scenes (PNG) and prompt records using them."""
    root = tmp_path_factory.mktemp("first-frame")
    for name, variant in VARIANTS.items():
        variant.build().save_pretrained(root / name)
    for i, spec in enumerate(prompt_split("train")[:2]):
        render_scene(spec, random.Random(i), size=64).save(root / f"scene{i}.png")
    (root / "animate.jsonl").write_text("".join(json.dumps({"prompt": p, "image": f"scene{i}.png"}) + "\n"
                                                for i, p in enumerate(PROMPTS)))
    return root


@pytest.fixture(params=sorted(VARIANTS))
def case(request, world):
    return VARIANTS[request.param], world / request.param, world


def _adapter(case, **kwargs):
    variant, path, _ = case
    return adapter_class(variant.family).from_pretrained(str(path), max_sequence_length=TOKENS, **variant.sizes,
                                                         **variant.options, **kwargs)


def _image(world, i: int, size: int):
    return Image.open(world / f"scene{i}.png").convert("RGB").resize((size, size), Image.BICUBIC)


def _pipeline_out(case, scene: int, seed: int, guidance=GUIDANCE, output_type="latent", pipe=None):
    """The pipeline on both prompts with one input image (it takes one per call)."""
    variant, path, world = case
    pipe = variant.prepare(pipe or adapter_class(variant.family).pipeline_class.from_pretrained(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe, pipe(image=_image(world, scene, variant.sizes["height"]), prompt=PROMPTS, num_inference_steps=STEPS,
                      guidance_scale=guidance, output_type=output_type, max_sequence_length=TOKENS,
                      generator=torch.Generator().manual_seed(seed), **variant.sizes, **variant.call)


def _rollout(adapter, world, scene: int, seed: int, guidance=GUIDANCE, eta=0.0):
    generator = torch.Generator().manual_seed(seed)
    noise = adapter.initial_noise(len(PROMPTS), generator)
    cond = adapter.encode(PROMPTS, images=[str(world / f"scene{scene}.png")] * len(PROMPTS))
    return rollout(adapter, cond, noise, adapter.schedule(STEPS), plan_steps(STEPS, len(PROMPTS), eta),
                   guidance_scale=guidance, generator=generator)


def _perturb(model, std=0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * std)


def test_eta_zero_rollout_reproduces_the_pipeline_with_the_same_image(case):
    variant, _, world = case
    adapter = _adapter(case)
    pipe, out = _pipeline_out(case, scene=0, seed=3)
    frame, expected = variant.latents(pipe, out)
    traj = _rollout(adapter, world, scene=0, seed=3)
    got = traj.samples.flatten(1) if variant.family == "ltx2_i2av" else traj.samples
    assert got.shape == expected.shape == (len(PROMPTS), *adapter.latent_shape())  # the generated frames only
    assert (got - expected).abs().max().item() <= 1e-5
    assert (traj.cond.tensors[variant.frame_key] - frame).abs().max().item() <= 1e-5  # the input's latent frame
    # guards: another input image and another guidance scale are each visible at this tolerance
    assert (_rollout(adapter, world, scene=1, seed=3).samples.reshape(got.shape) - expected).abs().max() > 1e-3
    assert (_rollout(adapter, world, 0, 3, guidance=GUIDANCE + 2).samples.reshape(got.shape)
            - expected).abs().max() > 1e-3
    # the prompt cache (one prompt-image pair at a time) gives the same conditioning
    records = [{"prompt": p, "image": str(world / "scene0.png")} for p in PROMPTS]
    cached = encode_records(PromptEmbeddingCache(adapter, size=4), records)
    assert all((cached.tensors[k] - traj.cond.tensors[k]).abs().max() <= 1e-5 for k in traj.cond.tensors)


def test_decode_puts_the_input_frame_back_and_matches_the_pipelines_pt_output(case):
    variant, _, world = case
    adapter = _adapter(case)
    traj = _rollout(adapter, world, scene=1, seed=4)
    _, expected = _pipeline_out(case, scene=1, seed=4, output_type="pt")
    decoded = decode_samples(adapter, traj.samples, traj.cond)
    video, expected_video = (decoded.video, expected.frames) if variant.family == "ltx2_i2av" else (decoded,
                                                                                                   expected.frames)
    assert video.shape == expected_video.shape == (len(PROMPTS), 5, 3, variant.sizes["height"],
                                                   variant.sizes["width"])
    assert (video - expected_video).abs().max().item() <= 1e-5
    if variant.family == "ltx2_i2av":
        assert (decoded.audio - expected.audio.float()).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="conditioning"):
        decode_samples(adapter, traj.samples)


def test_rescoring_reference_and_lora_round_trip(case, tmp_path):
    variant, path, world = case
    adapter = _adapter(case)
    cond = adapter.encode(PROMPTS, images=[str(world / "scene0.png")] * 2)
    x = adapter.initial_noise(2, torch.Generator().manual_seed(0))
    t = adapter.schedule(STEPS).timesteps[1]
    with torch.no_grad():
        base = adapter.predict(x, t, cond, GUIDANCE)
        assert base.shape == x.shape
        adapter.add_lora(rank=4, alpha=8)  # alpha ≠ rank: the saved metadata must carry the scale
        _perturb(adapter.model)
        trained = adapter.predict(x, t, cond, GUIDANCE)
        with adapter.reference():
            assert torch.equal(adapter.predict(x, t, cond, GUIDANCE), base)
        assert (trained - base).abs().max() > 1e-3
    traj = _rollout(adapter, world, scene=0, seed=2, eta=1.0)
    assert (traj.log_probs[:, :-1] != 0).all()
    grads = rescored_gradients(adapter, traj, STEPS - 1, GUIDANCE)
    assert any(g is not None and g.abs().sum() > 0 for g in grads.values())

    adapter.save_trained(tmp_path / "lora")
    pipe = adapter_class(variant.family).pipeline_class.from_pretrained(path)
    pipe.load_lora_weights(tmp_path / "lora")  # the pipeline's own loader (LTX2LoraLoaderMixin, WanLoraLoaderMixin)
    pipe, out = _pipeline_out(case, scene=0, seed=0, pipe=pipe)
    _, loaded = variant.latents(pipe, out)
    ours = _rollout(adapter, world, scene=0, seed=0).samples.reshape(loaded.shape)
    assert (ours - loaded).abs().max().item() <= 1e-5
    assert (loaded - variant.latents(*_pipeline_out(case, scene=0, seed=0))[1]).abs().max().item() > 1e-3


SEEN = []


@register_reward("test_first_frame_input")
class _SeesTheInput(Reward):
    """Records the conditioning images in its metadata; scores the last decoded frame's closeness to
    the input (videos [B, F, 3, H, W] or audio-video samples' ``.video``)."""

    components = ("closeness",)

    def __call__(self, samples, prompts, metadata):
        SEEN.append([m.get("image") for m in metadata])
        video = getattr(samples, "video", samples)
        h, w = video.shape[-2:]
        inputs = torch.stack([torch.from_numpy(np.array(Image.open(m["image"]).convert("RGB").resize((w, h))))
                              for m in metadata]).permute(0, 3, 1, 2).float() / 255
        return {"closeness": -(video[:, -1] - inputs).abs().mean(dim=(1, 2, 3))}


@pytest.mark.parametrize("method", sorted(FLOW_METHODS))
def test_each_objective_trains_with_the_input_in_metadata_and_grid(case, tmp_path, method):
    variant, path, world = case
    SEEN.clear()
    options = ", ".join(f"{k}: {v}" for k, v in {"max_sequence_length": TOKENS, **variant.options}.items())
    evaluate = method == "flow_grpo"
    config = load_config(None, [
        f"output_dir={tmp_path}", f"model.family={variant.family}", f"model.path={path}", "model.lora_rank=4",
        *[f"model.{k}={v}" for k, v in variant.sizes.items()], f"model.kwargs={{{options}}}",
        f"sampling.guidance_scale={GUIDANCE}", "tracker=none", f"sampling.num_steps={STEPS}", "train.epochs=1",
        "train.groups_per_epoch=2", "train.group_size=2", "train.sample_batch_size=4", "train.train_batch_size=4",
        "train.learning_rate=1e-2", f"data.train_prompts={world / 'animate.jsonl'}",
        f"data.eval_prompts={world / 'animate.jsonl'}", "eval.seeds=1", "eval.grid_prompts=2", "eval.grid_seeds=1",
        f"eval.every={1 if evaluate else 0}", "checkpoint_every=0", "reward.name=test_first_frame_input",
        "reward.weights={closeness: 1.0}", *FLOW_METHODS[method]])
    trainer, initial = train_once(config)
    assert_trained(trainer, initial)
    assert_on_policy_at_init(trainer.history[0], method)
    inputs = {r["image"] for r in load_prompts(str(world / "animate.jsonl"))}
    assert SEEN and all(image in inputs for batch in SEEN for image in batch)
    if evaluate:  # the evaluation decoded with each record's input frame; its grid shows the input first
        grid = Image.open(tmp_path / "grids" / "before.png")
        assert grid.width > grid.height


def test_ti2v_folder_loads_as_image_to_video_and_short_clips_are_refused(world, tmp_path):
    from pipelines.tiny_zoo import build_tiny_wan22_pipeline

    build_tiny_wan22_pipeline(vocabulary(), "ti2v").save_pretrained(tmp_path / "ti2v")  # TI2V-5B's WanPipeline folder
    adapter = load_adapter("wan_i2v", str(tmp_path / "ti2v"), height=64, width=64, num_frames=5,
                           options={"max_sequence_length": TOKENS})
    assert adapter.decodes_with_condition and adapter.latent_shape() == (8, 1, 4, 4)
    short = load_adapter("wan_i2v", str(tmp_path / "ti2v"), height=64, width=64, num_frames=1)
    with pytest.raises(ValueError, match="num_frames must be at least 5"):
        short.initial_noise(1, torch.Generator())
    with pytest.raises(ValueError, match="at least 3 frames"):
        adapter_class("ltx2_i2av").from_pretrained(str(world / "ltx2_i2av"), height=32, width=32, num_frames=1)
