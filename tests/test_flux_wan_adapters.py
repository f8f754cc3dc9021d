"""The FLUX.1 and Wan adapters against plain diffusers: η = 0 rollouts reproduce the pipelines
with each family's guidance, SDE steps rescore exactly, LoRA round trip, reference policy,
decoded shapes, clear errors."""

import pytest
import torch
from adapter_checks import assert_split_uncond_matches_the_detached_batch, reference_predictions, rescored_gradients
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, WanPipeline

from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from reward_models.worlds.shapes import vocabulary
from pipelines import adapter_class
from pipelines.tiny import build_tiny_flux_pipeline, build_tiny_wan_pipeline

PROMPTS = ["a photo of a red circle", "a photo of two squares", "a photo of a blue triangle"]
STEPS = 4
TOKENS = 16  # T5 / UMT5 sequence length, adapter and pipeline alike

# variant: (family, builder, the adapter's size arguments, the family's guidance in the tests)
VARIANTS = {
    "flux-dev": ("flux", lambda: build_tiny_flux_pipeline(vocabulary(), guidance_embeds=True),
                 {"height": 16, "width": 16}, 3.5),
    "flux-schnell": ("flux", lambda: build_tiny_flux_pipeline(vocabulary(), guidance_embeds=False),
                     {"height": 16, "width": 16}, 1.0),
    "wan": ("wan", lambda: build_tiny_wan_pipeline(vocabulary()), {"height": 32, "width": 32, "num_frames": 9}, 5.0),
}


# builders of the tiny pipelines; conftest.py's tiny_folder builds and saves each once per module
PIPELINE_BUILDERS = {name: variant[1] for name, variant in VARIANTS.items()}


@pytest.fixture(params=sorted(VARIANTS))
def tiny(request, tiny_folder):
    """(variant, folder), for every variant."""
    return request.param, tiny_folder(request.param)


def _adapter(tiny, **kwargs):
    variant, path = tiny
    family, _, sizes, _ = VARIANTS[variant]
    return adapter_class(family).from_pretrained(str(path), max_sequence_length=TOKENS, **sizes, **kwargs)


def _pipeline(tiny):
    """The plain diffusers pipeline; Wan's with the Euler scheduler at its UniPC's shift (what the adapter steps)."""
    variant, path = tiny
    if VARIANTS[variant][0] == "flux":
        pipe = FluxPipeline.from_pretrained(path)
    else:
        pipe = WanPipeline.from_pretrained(path)
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_output(pipe, tiny, guidance, seed, output_type="latent", **kwargs):
    """The pipeline's result: FLUX's packed latents [B, seq, 4C] or images; Wan's latents or frames."""
    variant, _ = tiny
    _, _, sizes, _ = VARIANTS[variant]
    out = pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=guidance, output_type=output_type,
               generator=torch.Generator().manual_seed(seed), max_sequence_length=TOKENS, **sizes, **kwargs)
    return out.images if isinstance(pipe, FluxPipeline) else out.frames


def _packed(adapter, x):
    """The adapter's latents [B, C, h, w] in FluxPipeline's packed layout [B, (h/2)·(w/2), 4C]."""
    return adapter.pipe._pack_latents(x, *x.shape)


def _rollout(adapter, guidance, seed, eta=0.0):
    generator = torch.Generator().manual_seed(seed)
    noise = adapter.initial_noise(len(PROMPTS), generator)
    plan = plan_steps(STEPS, len(PROMPTS), eta=eta)  # η at every step but the last (an ODE step)
    return rollout(adapter, adapter.encode(PROMPTS), noise, adapter.schedule(STEPS), plan, guidance_scale=guidance,
                   generator=generator)


def _samples_as_pipeline_latents(adapter, traj):
    return _packed(adapter, traj.samples) if adapter.family == "flux" else traj.samples


def _perturb(model, name_part: str = "lora_B", std: float = 0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name_part in name:
                p.add_(torch.randn_like(p) * std)


def test_eta_zero_rollout_reproduces_the_pipeline(tiny):
    variant, _ = tiny
    guidance = VARIANTS[variant][3]
    adapter = _adapter(tiny)
    expected = _pipeline_output(_pipeline(tiny), tiny, guidance, seed=3)
    got = _samples_as_pipeline_latents(adapter, _rollout(adapter, guidance, seed=3))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5
    if variant == "flux-schnell":  # no guidance embedding: a guidance scale is refused, not ignored
        with pytest.raises(ValueError, match="true_cfg_scale"):
            _rollout(adapter, 3.5, seed=3)
    else:  # guards the comparison: another guidance scale is visible at this tolerance
        other = _samples_as_pipeline_latents(adapter, _rollout(adapter, guidance + 2.0, seed=3))
        assert (other - expected).abs().max().item() > 1e-3


@pytest.mark.parametrize("variant", ["flux-dev", "flux-schnell"])
def test_flux_true_cfg_reproduces_the_pipeline(tiny_folder, variant):
    tiny = variant, tiny_folder(variant)
    guidance = VARIANTS[variant][3]
    adapter = _adapter(tiny, true_cfg_scale=2.5, negative_prompt="")
    expected = _pipeline_output(_pipeline(tiny), tiny, guidance, seed=1, true_cfg_scale=2.5, negative_prompt="")
    got = _packed(adapter, _rollout(adapter, guidance, seed=1).samples)
    assert (got - expected).abs().max().item() <= 1e-5
    plain = _pipeline_output(_pipeline(tiny), tiny, guidance, seed=1)
    assert (got - plain).abs().max().item() > 1e-3


@pytest.mark.parametrize("variant", ["flux-schnell", "wan"])
def test_detach_uncond_runs_the_negative_branch_on_its_own(tiny_folder, variant):
    tiny = variant, tiny_folder(variant)
    adapter = _adapter(tiny, true_cfg_scale=2.5, negative_prompt="") if variant.startswith("flux") else _adapter(tiny)
    adapter.add_lora(rank=4)
    _perturb(adapter.model)
    x = adapter.initial_noise(2, torch.Generator().manual_seed(0))
    cond = adapter.encode(["a red circle", "two blue squares"])
    assert_split_uncond_matches_the_detached_batch(adapter, x, torch.tensor(700.0), cond, max(VARIANTS[variant][3], 1.0))


def test_rescoring_a_sampled_step_gives_ratio_exactly_one(tiny):
    variant, _ = tiny
    guidance = VARIANTS[variant][3]
    adapter = _adapter(tiny)
    adapter.add_lora(rank=4)
    _perturb(adapter.model)
    traj = _rollout(adapter, guidance, seed=2, eta=1.0)
    assert (traj.log_probs[:, :-1] != 0).all()
    grads = rescored_gradients(adapter, traj, STEPS - 1, guidance)
    assert any(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_saved_lora_loads_in_plain_diffusers(tiny, tmp_path):
    variant, _ = tiny
    guidance = VARIANTS[variant][3]
    adapter = _adapter(tiny)
    adapter.add_lora(rank=4, alpha=8)  # alpha ≠ rank: the saved metadata must carry the scale
    _perturb(adapter.model)
    adapter.save_trained(tmp_path / "lora")

    pipe = _pipeline(tiny)
    before = _pipeline_output(pipe, tiny, guidance, seed=0)
    pipe.load_lora_weights(tmp_path / "lora")
    after = _pipeline_output(pipe, tiny, guidance, seed=0)
    assert (after - before).abs().max().item() > 1e-3
    ours = _samples_as_pipeline_latents(adapter, _rollout(adapter, guidance, seed=0))
    assert (ours - after).abs().max().item() <= 1e-5
    # loaded back as the trainer's evaluation loads it (LoRA fused into the transformer)
    fused = _adapter(tiny, trained=tmp_path / "lora")
    fused_samples = _samples_as_pipeline_latents(fused, _rollout(fused, guidance, seed=0))
    assert (fused_samples - after).abs().max().item() <= 1e-4


def test_reference_is_the_base_model(tiny):
    variant, _ = tiny
    base, trained, reference = reference_predictions(_adapter(tiny), PROMPTS, STEPS, VARIANTS[variant][3], _perturb)
    assert (trained - base).abs().max() > 1e-3
    assert torch.equal(reference, base)


def test_decode_returns_the_pipelines_pt_output(tiny):
    variant, _ = tiny
    family, _, sizes, guidance = VARIANTS[variant]
    adapter = _adapter(tiny)
    pipe = _pipeline(tiny)
    latents = _pipeline_output(pipe, tiny, guidance, seed=4)
    expected = _pipeline_output(pipe, tiny, guidance, seed=4, output_type="pt")
    if family == "flux":
        latents = pipe._unpack_latents(latents, adapter.height, adapter.width, pipe.vae_scale_factor)
        shape = (len(PROMPTS), 3, sizes["height"], sizes["width"])  # images [B, 3, H, W]
    else:
        shape = (len(PROMPTS), sizes["num_frames"], 3, sizes["height"], sizes["width"])  # frames [B, T, 3, H, W]
    assert latents.shape == (len(PROMPTS), *adapter.latent_shape())
    decoded = adapter.decode(latents)
    assert decoded.shape == expected.shape == shape
    assert (decoded - expected).abs().max().item() <= 1e-5
    assert decoded.min() >= 0 and decoded.max() <= 1
    adapter.enable_vae_slicing()  # one sample at a time: the same frames
    assert (adapter.decode(latents) - expected).abs().max().item() <= 1e-5


def test_wan_vae_tiling_decodes_the_same_shape(tiny_folder):
    # Wan's VAE takes tile sizes, so tiles smaller than these tiny frames can be asked for
    adapter = _adapter(("wan", tiny_folder("wan")))
    latents = adapter.initial_noise(2, torch.Generator().manual_seed(0))
    plain = adapter.decode(latents)
    adapter.enable_vae_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8,
                              tile_sample_stride_width=8)
    tiled = adapter.decode(latents)
    assert tiled.shape == plain.shape
    assert (tiled - plain).abs().max() > 0  # tiles really were used


def test_sizes_the_pipeline_cannot_make_are_refused(tiny):
    variant, path = tiny
    family = VARIANTS[variant][0]
    if family == "flux":
        with pytest.raises(ValueError, match="multiples of 4"):
            adapter_class(family).from_pretrained(str(path), height=18, width=16)
    else:
        with pytest.raises(ValueError, match="num_frames"):
            adapter_class(family).from_pretrained(str(path), height=32, width=32, num_frames=8)
        with pytest.raises(ValueError, match="divisible by 16"):
            adapter_class(family).from_pretrained(str(path), height=40, width=32, num_frames=9)
