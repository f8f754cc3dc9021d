"""The newer text-to-image families (Qwen-Image, ...) against plain diffusers: η = 0 rollouts
reproduce the pipelines with each family's guidance, SDE steps rescore exactly, LoRA round trip
through the pipeline's own ``load_lora_weights``, reference policy, decoding, prompt caching."""

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from adapter_checks import assert_split_uncond_matches_the_detached_batch, reference_predictions, rescored_gradients

from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps
from reward_models.worlds.shapes import vocabulary
from pipelines import adapter_class
from pipelines.base import PromptEmbeddingCache
from pipelines.tiny_zoo import (build_tiny_flux2_klein_pipeline, build_tiny_qwen_image_pipeline,
                                build_tiny_z_image_pipeline)

PROMPTS = ["a photo of a red circle", "a photo of two squares", "a photo of a blue triangle"]
STEPS = 4
TOKENS = 32  # text tokens kept per prompt, adapter and pipeline alike


@dataclass
class Variant:
    """family; builder of its tiny pipeline; the adapter's sizes; the guidance scale the tests use;
    ``guided(g)``: the pipeline's keyword arguments for the adapter's guidance_scale g;
    ``latents(adapter, x)``: the adapter's samples x in the layout of the pipeline's
    ``output_type="latent"`` result; ``options``: adapter options the pipeline call takes too."""

    family: str
    build: Callable
    sizes: dict
    guidance: float
    guided: Callable[[float], dict]
    latents: Callable
    options: dict = field(default_factory=dict)

    @property
    def adapter_kwargs(self) -> dict:
        return {"max_sequence_length": TOKENS, **self.options}


def _qwen_cfg(g: float) -> dict:
    return {"true_cfg_scale": g, "negative_prompt": " "} if g > 1 else {"true_cfg_scale": 1.0}


def _packed(adapter, x):
    """FLUX-style 2×2-packed tokens [B, N, 4C] of unpacked latents x [B, C, h, w] (Qwen-Image)."""
    return adapter.pipe._pack_latents(x, *x.shape)


def _cfg(g: float) -> dict:
    return {"guidance_scale": g}


VARIANTS = {
    "qwen_image": Variant("qwen_image", lambda: build_tiny_qwen_image_pipeline(vocabulary()),
                          {"height": 32, "width": 32}, 4.0, _qwen_cfg, _packed),
    "flux2_klein": Variant("flux2", lambda: build_tiny_flux2_klein_pipeline(vocabulary()), {"height": 16, "width": 16},
                           4.0, _cfg, lambda adapter, x: adapter.vae_latents(x),
                           {"text_encoder_out_layers": [1, 2, 3]}),
    "flux2_klein_distilled": Variant("flux2", lambda: build_tiny_flux2_klein_pipeline(vocabulary(), is_distilled=True),
                                     {"height": 16, "width": 16}, 1.0, _cfg, lambda adapter, x: adapter.vae_latents(x),
                                     {"text_encoder_out_layers": [1, 2, 3]}),
    "z_image": Variant("z_image", lambda: build_tiny_z_image_pipeline(vocabulary()), {"height": 16, "width": 16}, 4.0,
                       _cfg, lambda adapter, x: x),
    # the pipeline's guidance options: the guided norm capped at |cond|, no guidance while 1 − σ > 0.6
    "z_image_cfg_options": Variant("z_image", lambda: build_tiny_z_image_pipeline(vocabulary()),
                                   {"height": 16, "width": 16}, 4.0, _cfg, lambda adapter, x: x,
                                   {"cfg_normalization": 1.0, "cfg_truncation": 0.6}),
    "z_image_turbo": Variant("z_image", lambda: build_tiny_z_image_pipeline(vocabulary()), {"height": 16, "width": 16},
                             0.0, _cfg, lambda adapter, x: x),  # Turbo samples without CFG
}


# builders of the tiny pipelines; conftest.py's tiny_folder builds and saves each once per module
PIPELINE_BUILDERS = {name: variant.build for name, variant in VARIANTS.items()}


@pytest.fixture(params=sorted(VARIANTS))
def tiny(request, tiny_folder):
    """(Variant, folder), for every variant."""
    return VARIANTS[request.param], tiny_folder(request.param)


def _adapter(tiny, **kwargs):
    variant, path = tiny
    return adapter_class(variant.family).from_pretrained(str(path), **variant.adapter_kwargs, **variant.sizes, **kwargs)


def _pipeline(tiny):
    variant, path = tiny
    pipe = adapter_class(variant.family).pipeline_class.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_output(pipe, tiny, guidance, seed, output_type="latent"):
    variant, _ = tiny
    out = pipe(prompt=list(PROMPTS), num_inference_steps=STEPS, output_type=output_type,  # a copy: ZImagePipeline
               generator=torch.Generator().manual_seed(seed),  # rewrites the prompt list it is given
               **variant.adapter_kwargs, **variant.sizes, **variant.guided(guidance))
    return out.images


def _as_pipeline_latents(adapter, variant, x):
    return variant.latents(adapter, x)


def _rollout(adapter, guidance, seed, eta=0.0, cond=None):
    generator = torch.Generator().manual_seed(seed)
    noise = adapter.initial_noise(len(PROMPTS), generator)
    plan = plan_steps(STEPS, len(PROMPTS), eta=eta)  # η at every step but the last (an ODE step)
    cond = adapter.encode(PROMPTS) if cond is None else cond
    return rollout(adapter, cond, noise, adapter.schedule(STEPS), plan, guidance_scale=guidance, generator=generator)


def _perturb(model, name_part: str = "lora_B", std: float = 0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name_part in name:
                p.add_(torch.randn_like(p) * std)


def test_eta_zero_rollout_reproduces_the_pipeline(tiny):
    variant, _ = tiny
    adapter = _adapter(tiny)
    for guidance in (variant.guidance, 1.0):
        expected = _pipeline_output(_pipeline(tiny), tiny, guidance, seed=3)
        got = _as_pipeline_latents(adapter, variant, _rollout(adapter, guidance, seed=3).samples)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-5, guidance
    if variant.guidance == 1.0:  # a guidance-free (distilled) checkpoint: a guidance scale is refused, not ignored
        with pytest.raises(ValueError, match="guidance"):
            _rollout(adapter, 3.0, seed=3)
    else:  # guards the comparison: another guidance scale is visible at this tolerance
        other = _as_pipeline_latents(adapter, variant, _rollout(adapter, variant.guidance + 2.0, seed=3).samples)
        assert (other - expected).abs().max().item() > 1e-3


def test_prompts_encoded_one_by_one_give_the_batchs_samples(tiny):
    # the prompt cache encodes one prompt at a time (padded to max_sequence_length): same samples
    variant, _ = tiny
    adapter = _adapter(tiny)
    cached = PromptEmbeddingCache(adapter, size=8)(PROMPTS)
    batched = _rollout(adapter, variant.guidance, seed=5).samples
    assert (_rollout(adapter, variant.guidance, seed=5, cond=cached).samples - batched).abs().max().item() <= 1e-5


def test_rescoring_a_sampled_step_gives_ratio_exactly_one(tiny):
    variant, _ = tiny
    adapter = _adapter(tiny)
    adapter.add_lora(rank=4)
    _perturb(adapter.model)
    traj = _rollout(adapter, variant.guidance, seed=2, eta=1.0)
    assert (traj.log_probs[:, :-1] != 0).all()
    grads = rescored_gradients(adapter, traj, STEPS - 1, variant.guidance)
    assert any(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_detach_uncond_runs_the_negative_branch_on_its_own(tiny):
    variant, _ = tiny
    if variant.guidance in (0.0, 1.0):
        pytest.skip("the variant samples without CFG")
    adapter = _adapter(tiny)
    adapter.add_lora(rank=4)
    _perturb(adapter.model)
    x = adapter.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    t = adapter.schedule(STEPS).timesteps[-1]  # late: z_image_cfg_options guides only there
    assert_split_uncond_matches_the_detached_batch(adapter, x, t, adapter.encode(PROMPTS), variant.guidance)


def test_saved_lora_loads_in_plain_diffusers(tiny, tmp_path):
    variant, _ = tiny
    adapter = _adapter(tiny)
    adapter.add_lora(rank=4, alpha=8)  # alpha ≠ rank: the saved metadata must carry the scale
    _perturb(adapter.model)
    adapter.save_trained(tmp_path / "lora")

    pipe = _pipeline(tiny)
    before = _pipeline_output(pipe, tiny, variant.guidance, seed=0)
    pipe.load_lora_weights(tmp_path / "lora")  # the family's own LoRA loader mixin
    after = _pipeline_output(pipe, tiny, variant.guidance, seed=0)
    assert (after - before).abs().max().item() > 1e-3
    ours = _as_pipeline_latents(adapter, variant, _rollout(adapter, variant.guidance, seed=0).samples)
    assert (ours - after).abs().max().item() <= 1e-5
    fused = _adapter(tiny, trained=tmp_path / "lora")  # as the trainer's evaluation loads it
    fused_samples = _as_pipeline_latents(fused, variant, _rollout(fused, variant.guidance, seed=0).samples)
    assert (fused_samples - after).abs().max().item() <= 1e-4


def test_reference_is_the_base_model(tiny):
    variant, _ = tiny
    base, trained, reference = reference_predictions(_adapter(tiny), PROMPTS, STEPS, variant.guidance, _perturb)
    assert (trained - base).abs().max() > 1e-3
    assert torch.equal(reference, base)


def test_decode_returns_the_pipelines_pt_output(tiny):
    variant, _ = tiny
    adapter = _adapter(tiny)
    traj = _rollout(adapter, variant.guidance, seed=4)
    expected = _pipeline_output(_pipeline(tiny), tiny, variant.guidance, seed=4, output_type="pt")
    decoded = adapter.decode(traj.samples)
    assert decoded.shape == expected.shape == (len(PROMPTS), 3, variant.sizes["height"], variant.sizes["width"])
    assert (decoded - expected).abs().max().item() <= 1e-5
    assert decoded.min() >= 0 and decoded.max() <= 1


def test_sizes_the_pipeline_cannot_pack_are_refused(tiny):
    variant, path = tiny
    multiple = 2 * _adapter(tiny).pipe.vae_scale_factor  # 2×2 patches of latents
    with pytest.raises(ValueError, match=f"multiples of {multiple}"):
        adapter_class(variant.family).from_pretrained(str(path), height=multiple + multiple // 2, width=multiple)


def test_z_image_turbo_few_step_schedule_is_the_pipelines(tiny_folder):
    # Turbo's published sampling: 9 steps (the last at σ = 1/9 → 0), guidance_scale 0
    tiny = VARIANTS["z_image_turbo"], tiny_folder("z_image_turbo")
    adapter = _adapter(tiny)
    pipe = _pipeline(tiny)
    schedule = adapter.schedule(9)
    pipe.scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / 9, 9).tolist(), mu=0.0)  # the pipeline's call
    assert torch.equal(schedule.timesteps, pipe.scheduler.timesteps)
    assert torch.allclose(schedule.sigmas, pipe.scheduler.sigmas.float(), atol=1e-7) and schedule.sigmas[-1] == 0
    generator = torch.Generator().manual_seed(1)
    noise = adapter.initial_noise(len(PROMPTS), generator)
    got = rollout(adapter, adapter.encode(PROMPTS), noise, schedule, plan_steps(9, len(PROMPTS), eta=0.0),
                  guidance_scale=0.0).samples
    expected = pipe(prompt=list(PROMPTS), num_inference_steps=9, guidance_scale=0.0, output_type="latent", height=16,
                    width=16, max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(1)).images
    assert (got - expected).abs().max().item() <= 1e-5
