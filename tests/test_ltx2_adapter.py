"""The LTX-2 audio-video adapter against plain diffusers' ``LTX2Pipeline``, on a tiny offline
pipeline (every part, Gemma3 included, built from a config): η = 0 rollouts reproduce the
pipeline's video and audio latents with and without guidance, decoding matches its "pt" outputs,
SDE steps over the joint latent rescore exactly, LoRA round trip through ``load_lora_weights``,
the reference policy, and the joint-latent helpers."""

import pytest
import torch
from adapter_checks import (assert_detach_uncond_trains_only_the_conditional_branch, reference_predictions,
                            rescored_gradients)
from diffusers import LTX2Pipeline

from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from reward_models.worlds.shapes import vocabulary
from pipelines import adapter_class, check_adapter_options, load_adapter
from pipelines.joint import AudioVideoSamples, JointLayout
from pipelines.tiny import build_tiny_ltx2_pipeline

PROMPTS = ["a photo of a red circle", "a photo of two squares"]
STEPS = 4
TOKENS = 16  # Gemma tokens, adapter and pipeline alike (a multiple of the connectors' 8 registers)
CLIP = {"height": 32, "width": 32, "num_frames": 5, "frame_rate": 25.0}  # 3 latent frames of 8×8; 5 audio steps
# guidance settings: the adapter's options, its predict() guidance_scale, and the same as LTX2Pipeline arguments
GUIDANCE = {
    "none": ({}, 1.0, {"guidance_scale": 1.0}),
    "cfg": ({"audio_guidance_scale": 5.0}, 3.0, {"guidance_scale": 3.0, "audio_guidance_scale": 5.0}),
    "cfg+modality+rescale": ({"audio_guidance_scale": 5.0, "modality_scale": 2.0, "guidance_rescale": 0.7}, 3.0,
                             {"guidance_scale": 3.0, "audio_guidance_scale": 5.0, "modality_scale": 2.0,
                              "audio_modality_scale": 2.0, "guidance_rescale": 0.7, "audio_guidance_rescale": 0.7}),
}
# the pipeline's call defaults add spatio-temporal guidance, modality guidance and rescale: all off unless set
PLAIN = {"audio_guidance_scale": None, "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
         "audio_modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0}



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ltx2")
    build_tiny_ltx2_pipeline(vocabulary()).save_pretrained(path)
    return path


def _adapter(folder, **kwargs):
    return adapter_class("ltx2").from_pretrained(str(folder), max_sequence_length=TOKENS, **CLIP, **kwargs)


def _pipeline(folder):
    pipe = LTX2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_call(pipe, seed, output_type="latent", **guidance):
    return pipe(PROMPTS, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                max_sequence_length=TOKENS, output_type=output_type, **CLIP, **{**PLAIN, **guidance})


def _as_joint(adapter, pipe, out) -> torch.Tensor:
    """The pipeline's latent output (denormalised video [B, C, F, h, w], audio [B, C, L, M]) as the
    adapter's joint latent: normalised again and packed to tokens, as the pipeline denoises them."""
    vae, audio_vae = pipe.vae, pipe.audio_vae
    video = pipe._normalize_latents(out.frames, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(out.audio), audio_vae.latents_mean,
                                          audio_vae.latents_std)
    return adapter.joint_layout.pack(pipe._pack_latents(video), audio)


def _rollout(adapter, guidance, seed, eta=0.0):
    generator = torch.Generator().manual_seed(seed)
    noise = adapter.initial_noise(len(PROMPTS), generator)
    plan = plan_steps(STEPS, len(PROMPTS), eta=eta)  # η at every step but the last (an ODE step)
    return rollout(adapter, adapter.encode(PROMPTS), noise, adapter.schedule(STEPS), plan, guidance_scale=guidance,
                   generator=generator)


def _max_diff_per_modality(adapter, got, expected) -> tuple[float, float]:
    video, audio = (t.abs().max().item() for t in adapter.joint_layout.unpack(got - expected))
    return video, audio


def _perturb(model, name_part: str = "lora_B", std: float = 0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name_part in name:
                p.add_(torch.randn_like(p) * std)


# -- joint latents -------------------------------------------------------------------------
def test_pack_split_round_trip_is_exact_and_masks_name_each_element():
    layout = JointLayout(video_tokens=3, video_channels=2, audio_tokens=2, audio_channels=3)
    video, audio = torch.randn(4, 3, 2), torch.randn(4, 2, 3)
    x = layout.pack(video, audio)
    assert x.shape == (4, 3 * 2 + 2 * 3) and layout.numel == 12
    v, a = layout.unpack(x)
    assert torch.equal(v, video) and torch.equal(a, audio)
    assert torch.equal(layout.pack(*layout.unpack(x)), x)
    # element 4 is channel 0 of video token 2; element 6 + 4 is channel 1 of audio token 1
    assert x[0, 4] == video[0, 2, 0] and x[0, 10] == audio[0, 1, 1]
    assert layout.masks().tolist() == [[True] * 6 + [False] * 6, [False] * 6 + [True] * 6]
    assert layout.token_ids().tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4]
    weights = layout.expand_tokens(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[4.0, 5.0]]))
    assert weights.tolist() == [[1, 1, 2, 2, 3, 3, 4, 4, 4, 5, 5, 5]]
    with pytest.raises(ValueError, match=r"\[B, 12\]"):
        layout.unpack(x[:, :-1])
    with pytest.raises(ValueError, match="audio tokens"):
        layout.pack(video, audio[:, :1])


def test_audio_video_samples_select_and_concatenate():
    samples = AudioVideoSamples(torch.rand(3, 2, 3, 4, 4), torch.rand(3, 1, 10), sample_rate=100, fps=5.0)
    assert len(samples) == 3 and len(samples[1]) == 1 and len(samples[torch.tensor([0, 2])]) == 2
    joined = AudioVideoSamples.cat([samples[:1], samples[1:]])
    assert torch.equal(joined.video, samples.video) and torch.equal(joined.audio, samples.audio)
    assert samples.mono.shape == (3, 10)
    with pytest.raises(ValueError, match="audio"):
        AudioVideoSamples(torch.rand(3, 2, 3, 4, 4), torch.rand(3, 10), sample_rate=100, fps=5.0)


# -- against the pipeline --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GUIDANCE))
def test_eta_zero_rollout_reproduces_the_pipeline(folder, name):
    options, scale, pipeline_guidance = GUIDANCE[name]
    adapter = _adapter(folder, **options)
    pipe = _pipeline(folder)
    expected = _as_joint(adapter, pipe, _pipeline_call(pipe, seed=3, **pipeline_guidance))
    got = _rollout(adapter, scale, seed=3).samples
    assert got.shape == expected.shape == (len(PROMPTS), adapter.joint_layout.numel)
    video, audio = _max_diff_per_modality(adapter, got, expected)
    assert video <= 1e-5 and audio <= 1e-5, (video, audio)
    # guards the comparison: another video guidance scale is visible in both modalities at this tolerance
    other = _rollout(adapter, scale + 2.0, seed=3).samples
    assert min(_max_diff_per_modality(adapter, other, expected)) > 1e-3


def test_decode_returns_the_pipelines_pt_outputs(folder):
    adapter = _adapter(folder)
    pipe = _pipeline(folder)
    latents = _as_joint(adapter, pipe, _pipeline_call(pipe, seed=4))
    expected = _pipeline_call(pipe, seed=4, output_type="pt")
    decoded = adapter.decode(latents)
    assert isinstance(decoded, AudioVideoSamples)
    assert decoded.video.shape == expected.frames.shape == (len(PROMPTS), CLIP["num_frames"], 3, 32, 32)
    assert decoded.audio.shape == expected.audio.shape and decoded.audio.shape[:2] == (len(PROMPTS), 2)
    assert (decoded.video - expected.frames).abs().max().item() <= 1e-5
    assert (decoded.audio - expected.audio.float()).abs().max().item() <= 1e-5
    assert decoded.video.min() >= 0 and decoded.video.max() <= 1
    assert decoded.sample_rate == pipe.vocoder.config.output_sampling_rate and decoded.fps == CLIP["frame_rate"]


def test_rescoring_a_sampled_step_gives_ratio_exactly_one(folder):
    adapter = _adapter(folder)
    adapter.add_lora(rank=4)
    _perturb(adapter.model)
    traj = _rollout(adapter, 3.0, seed=2, eta=1.0)
    assert (traj.log_probs[:, :-1] != 0).all()
    # the joint log-prob is differentiable in the LoRA weights, cross-modal ones too
    grads = rescored_gradients(adapter, traj, STEPS - 1, 3.0)
    for attention in ("audio_to_video_attn", "video_to_audio_attn"):
        assert any(attention in n and g is not None and g.abs().sum() > 0 for n, g in grads.items()), attention


def test_saved_lora_loads_in_plain_diffusers(folder, tmp_path):
    adapter = _adapter(folder, audio_guidance_scale=5.0)
    adapter.add_lora(rank=4, alpha=8)  # alpha ≠ rank: the saved metadata must carry the scale
    lora_modules = {n.rsplit(".lora_A", 1)[0] for n, _ in adapter.model.named_parameters() if ".lora_A" in n}
    for name in adapter.cross_modal_attention():
        assert {f"{name}.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0")} <= lora_modules
    _perturb(adapter.model)
    adapter.save_trained(tmp_path / "lora")

    pipe = _pipeline(folder)
    guidance = {"guidance_scale": 3.0, "audio_guidance_scale": 5.0}
    before = _as_joint(adapter, pipe, _pipeline_call(pipe, seed=0, **guidance))
    pipe.load_lora_weights(tmp_path / "lora")
    after = _as_joint(adapter, pipe, _pipeline_call(pipe, seed=0, **guidance))
    assert min(_max_diff_per_modality(adapter, after, before)) > 1e-3
    ours = _rollout(adapter, 3.0, seed=0).samples
    assert max(_max_diff_per_modality(adapter, ours, after)) <= 1e-5
    # loaded back as the trainer's evaluation loads it (LoRA fused into the transformer)
    fused = _adapter(folder, audio_guidance_scale=5.0, trained=tmp_path / "lora")
    assert max(_max_diff_per_modality(adapter, _rollout(fused, 3.0, seed=0).samples, after)) <= 1e-4


def test_reference_is_the_base_model(folder):
    adapter = _adapter(folder)
    base, trained, reference = reference_predictions(adapter, PROMPTS, STEPS, 3.0, _perturb)
    assert min(_max_diff_per_modality(adapter, trained, base)) > 1e-3
    assert torch.equal(reference, base)


def test_precomputed_prompt_embeddings_give_the_same_conditioning(folder):
    adapter = _adapter(folder)
    embeds, mask, _, _ = adapter.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                                    max_sequence_length=TOKENS)
    from_embeds, from_prompts = adapter.encode_embeds(embeds, mask), adapter.encode(PROMPTS)
    assert from_embeds.tensors.keys() == from_prompts.tensors.keys() == {"video_embeds", "audio_embeds", "mask"}
    for key, value in from_prompts.tensors.items():
        assert torch.equal(from_embeds.tensors[key], value), key


def test_layout_masks_and_cross_modal_modules(folder):
    # built as the trainer builds it: options checked by name and type, sizes passed through
    adapter = load_adapter("ltx2", str(folder), height=32, width=32, num_frames=5,
                           options={"frame_rate": 25.0, "max_sequence_length": TOKENS, "audio_guidance_scale": 5.0})
    with pytest.raises(ValueError, match="audio_guidance_scale"):
        check_adapter_options("ltx2", {"audio_guidance_scale": "high"})
    layout = adapter.joint_layout  # 3 latent frames × 8 × 8 video tokens of 8 channels; 5 audio steps of 2 × 2
    assert (layout.video_tokens, layout.video_channels, layout.audio_tokens, layout.audio_channels) == (192, 8, 5, 4)
    assert adapter.initial_noise(2, torch.Generator().manual_seed(0)).shape == (2, layout.numel)
    masks = adapter.branch_masks()
    assert masks.shape == (2, layout.numel) and torch.equal(masks.sum(0), torch.ones(layout.numel, dtype=torch.long))
    modules = adapter.cross_modal_attention()
    assert sorted(modules) == [f"transformer_blocks.{i}.{n}" for i in range(2)
                               for n in ("audio_to_video_attn", "video_to_audio_attn")]
    assert {branch for branch, _ in modules.values()} == {"video", "audio"}


def test_sizes_the_pipeline_cannot_make_are_refused(folder):
    with pytest.raises(ValueError, match="divisible by 32"):
        adapter_class("ltx2").from_pretrained(str(folder), height=48, width=32, num_frames=5)
    with pytest.raises(ValueError, match="num_frames"):
        adapter_class("ltx2").from_pretrained(str(folder), height=32, width=32, num_frames=6)


@pytest.mark.parametrize("modality_scale", [1.0, 2.0])
def test_detach_uncond_trains_only_the_conditional_prediction(folder, modality_scale):
    # x̂0 = x̂0_c + (g − 1)(x̂0_c − x̂0_u) + (m − 1)(x̂0_c − x̂0_isolated) per modality: with both reference
    # branches detached the velocity's gradient is (g + m − 1)·∇v_c, in video and audio alike
    adapter = _adapter(folder, modality_scale=modality_scale)
    adapter.add_lora(rank=4)
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    x = adapter.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    t, g = adapter.schedule(STEPS).timesteps[1], 3.0
    cond = adapter.encode(PROMPTS)

    def conditional():  # v_c alone: no CFG, no modality guidance
        adapter.modality_scale = adapter.audio_modality_scale = 1.0
        try:
            return adapter.predict(x, t, cond, 1.0)
        finally:
            adapter.modality_scale = adapter.audio_modality_scale = modality_scale

    assert_detach_uncond_trains_only_the_conditional_branch(adapter, x, t, cond, g, cond_weight=g + modality_scale - 1,
                                                            conditional=conditional)
