"""The SD1.x and SDXL adapters against plain diffusers: DDIM rollouts reproduce the pipelines,
log-probs are the closed-form Gaussian and rescore exactly, LoRA round trip, reference policy."""

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline
from adapter_checks import reference_predictions, rescored_gradients
from helpers import tiny_config

from flowalign.config import ConfigError

from flowalign.rollout import rollout, transition
from flowalign.samplers.ddim import ddim_step
from flowalign.samplers.steps import StepPlan, plan_steps
from flowalign.trainer import Trainer
from reward_models.worlds.shapes import vocabulary
from pipelines import adapter_class
from pipelines.tiny import TinyUNetSizes, build_tiny_sd_pipeline, build_tiny_sdxl_pipeline

PROMPTS = ["a photo of a red circle", "a photo of two squares", "a photo of a blue triangle"]
BUILDERS = {"sd": build_tiny_sd_pipeline, "sdxl": build_tiny_sdxl_pipeline}
PIPELINES = {"sd": StableDiffusionPipeline, "sdxl": StableDiffusionXLPipeline}
STEPS = 4




@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny(request, tmp_path_factory):
    """(family, folder): a tiny random pipeline saved with save_pretrained, loaded back by path."""
    family = request.param
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    BUILDERS[family](vocabulary(), TinyUNetSizes(), seed=0).save_pretrained(path)
    return family, path


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to the tensor's scale: float32 sums over ~8-sized latents
    differ by a few ulps between CPUs (AVX2 vs AVX-512 kernels), so absolute 1e-5 is too tight."""
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def _adapter(tiny, **kwargs):
    family, path = tiny
    return adapter_class(family).from_pretrained(str(path), **kwargs)


def _pipeline(tiny):
    """The plain diffusers pipeline with a DDIMScheduler from its own config, as a DDPO user runs it."""
    family, path = tiny
    pipe = PIPELINES[family].from_pretrained(path, **adapter_class(family).pipeline_kwargs(str(path)))
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_latents(pipe, adapter, guidance, seed, eta=0.0):
    return pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=guidance, eta=eta, output_type="latent",
                generator=torch.Generator().manual_seed(seed), height=adapter.height, width=adapter.width).images


def _rollout(adapter, guidance, seed, eta, reduction="mean"):
    """A rollout with η at every step, noise and step noise drawn from one generator, as the pipeline draws them."""
    generator = torch.Generator().manual_seed(seed)
    noise = adapter.initial_noise(len(PROMPTS), generator)
    plan = StepPlan(torch.full((STEPS,), eta), torch.full((len(PROMPTS), STEPS), eta > 0))
    return rollout(adapter, adapter.encode(PROMPTS), noise, adapter.schedule(STEPS), plan,
                        guidance_scale=guidance, generator=generator, reduction=reduction)


def _perturb(model, name_part: str, std: float = 0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name_part in name:
                p.add_(torch.randn_like(p) * std)


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_eta_zero_rollout_reproduces_the_pipeline(tiny, guidance):
    adapter = _adapter(tiny)
    expected = _pipeline_latents(_pipeline(tiny), adapter, guidance, seed=3)
    got = _rollout(adapter, guidance, seed=3, eta=0.0)
    assert got.samples.shape == expected.shape
    assert _max_error(got.samples, expected) <= 1e-5
    assert torch.equal(got.log_probs, torch.zeros(len(PROMPTS), STEPS))
    # guards the comparison: another guidance scale is visible at this tolerance
    other = _rollout(adapter, guidance + 2.0, seed=3, eta=0.0)
    assert (other.samples - expected).abs().max().item() > 1e-3


def test_eta_one_rollout_reproduces_the_pipeline_with_the_same_generator(tiny):
    adapter = _adapter(tiny)
    expected = _pipeline_latents(_pipeline(tiny), adapter, 3.0, seed=5, eta=1.0)
    got = _rollout(adapter, 3.0, seed=5, eta=1.0)
    assert _max_error(got.samples, expected) <= 1e-5
    assert (got.samples - _rollout(adapter, 3.0, seed=5, eta=0.0).samples).abs().max().item() > 1e-2


def test_log_prob_is_the_closed_form_gaussian(tiny):
    adapter = _adapter(tiny)
    traj = _rollout(adapter, 3.0, seed=1, eta=1.0)
    # the DDIM transition written out here, from diffusers' ᾱ table and the pipeline's prev-timestep rule
    scheduler = DDIMScheduler.from_config(adapter.pipe.scheduler.config)
    scheduler.set_timesteps(STEPS)
    for j, t in enumerate(scheduler.timesteps.tolist()):
        x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
        prev = t - 1000 // STEPS  # below 0: ᾱ_0, since the config has set_alpha_to_one=False
        a, a_prev = scheduler.alphas_cumprod[t], scheduler.alphas_cumprod[max(prev, 0)]
        with torch.no_grad():
            eps = adapter.predict(x, torch.tensor(t), traj.cond, 3.0)
        x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        var = (1 - a_prev) / (1 - a) * (1 - a / a_prev)
        mean = a_prev.sqrt() * x0 + (1 - a_prev - var).sqrt() * eps
        density = torch.distributions.Normal(mean, var.sqrt()).log_prob(x_next).flatten(1)
        assert torch.allclose(traj.log_probs[:, j], density.mean(1), atol=1e-5)
        with torch.no_grad():
            summed = transition(adapter, x, j, traj.schedule, 1.0, traj.cond, 3.0, prev_sample=x_next,
                                     reduction="sum")
        assert torch.allclose(summed.log_prob, density.sum(1), rtol=1e-5, atol=1e-3)


def test_rescoring_a_sampled_step_gives_ratio_exactly_one(tiny):
    adapter = _adapter(tiny)
    adapter.add_lora(rank=4)
    _perturb(adapter.model, "lora_B")
    grads = rescored_gradients(adapter, _rollout(adapter, 3.0, seed=2, eta=1.0), STEPS, 3.0)
    assert any(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_saved_lora_loads_in_plain_diffusers(tiny, tmp_path):
    adapter = _adapter(tiny)
    adapter.add_lora(rank=4, alpha=8)  # alpha ≠ rank: the saved metadata must carry the scale
    _perturb(adapter.model, "lora_B")
    adapter.save_trained(tmp_path / "lora")

    pipe = _pipeline(tiny)
    before = _pipeline_latents(pipe, adapter, 3.0, seed=0)
    pipe.load_lora_weights(tmp_path / "lora")
    after = _pipeline_latents(pipe, adapter, 3.0, seed=0)
    assert (after - before).abs().max().item() > 1e-3
    ours = _rollout(adapter, 3.0, seed=0, eta=0.0).samples
    assert _max_error(ours, after) <= 1e-5
    # loaded back as the trainer's evaluation loads it (LoRA fused into the UNet)
    fused = _adapter(tiny, trained=tmp_path / "lora")
    assert (_rollout(fused, 3.0, seed=0, eta=0.0).samples - after).abs().max().item() <= 1e-4


def test_reference_is_the_base_model(tiny, tmp_path):
    base, trained, reference = reference_predictions(_adapter(tiny), PROMPTS, STEPS, 3.0,
                                                     lambda model: _perturb(model, "lora_B"))
    assert (trained - base).abs().max() > 1e-3
    assert _max_error(reference, base) <= 1e-6


def test_full_finetune_keeps_a_frozen_reference_and_saves_the_unet(tiny, tmp_path):
    adapter = _adapter(tiny)
    cond = adapter.encode(PROMPTS)
    x = adapter.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = adapter.predict(x, 501, cond)
        adapter.enable_full_finetune(keep_reference=True)
        _perturb(adapter.model, "conv_out", std=0.1)
        trained = adapter.predict(x, 501, cond)
        with adapter.reference():
            assert _max_error(adapter.predict(x, 501, cond), base) <= 1e-6
    assert (trained - base).abs().max() > 1e-3
    adapter.save_trained(tmp_path / "full")
    loaded = _adapter(tiny, trained=tmp_path / "full")
    with torch.no_grad():
        assert _max_error(loaded.predict(x, 501, cond), trained) <= 1e-6


def test_schedule_steps_like_diffusers_ddim_for_every_spacing(tiny):
    # "trailing" and "linspace" spacings step to t − 1000 // S, not to the next listed timestep
    adapter = _adapter(tiny)
    g = torch.Generator().manual_seed(0)
    for spacing in ("leading", "trailing", "linspace"):
        scheduler = DDIMScheduler.from_config(adapter.scheduler.config, timestep_spacing=spacing)
        adapter.scheduler = DDIMScheduler.from_config(scheduler.config)
        schedule = adapter.schedule(3)
        scheduler.set_timesteps(3)
        assert torch.equal(schedule.timesteps, scheduler.timesteps)
        for j, t in enumerate(scheduler.timesteps):
            eta = 0.8 if j < 2 else 0.0  # linspace ends at t = 0 → t' < 0: σ_t = 0, a deterministic step
            x, out, z = (torch.randn(1, 4, 2, 2, generator=g) for _ in range(3))
            ours = ddim_step(out, x, schedule.alphas_cumprod[j], schedule.alphas_cumprod_prev[j], eta, noise=z)
            expected = scheduler.step(out, t, x, eta=eta, variance_noise=z).prev_sample
            assert _max_error(ours.prev_sample, expected) <= 1e-5, (spacing, j)


def test_eta_zero_plan_from_plan_steps_is_deterministic(tiny):
    # the trainer's plans: the last step is deterministic, so even ᾱ' = 1 schedules are fine
    adapter = _adapter(tiny)
    noise = adapter.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    plan = plan_steps(STEPS, len(PROMPTS), eta=1.0)
    traj = rollout(adapter, adapter.encode(PROMPTS), noise, adapter.schedule(STEPS), plan,
                        generator=torch.Generator().manual_seed(1))
    assert traj.latents.shape == (len(PROMPTS), STEPS + 1, *adapter.latent_shape())
    assert (traj.log_probs[:, :-1] != 0).all() and (traj.log_probs[:, -1] == 0).all()
    assert traj[1:].schedule.alphas_cumprod is traj.alphas_cumprod
    images = adapter.decode(traj.samples)
    assert images.shape == (len(PROMPTS), 3, adapter.height, adapter.width)


def test_ddpo_trains_the_unet_families_on_policy_with_zero_kl_at_init(tiny, tmp_path):
    family, path = tiny
    trainer = Trainer(tiny_config(path, tmp_path, f"model.family={family}", "method=ddpo", "train.epochs=1",
                                  "train.kl_beta=0.1", "train.per_prompt_stats=true", "sampling.eta=1.0"))
    trainer.train()
    first = trainer.history[0]
    assert first["train/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert first["train/kl"] == 0.0
    assert first["train/grad_norm"] > 0
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_flow_methods_refuse_an_epsilon_model(tiny, tmp_path):
    family, path = tiny
    with pytest.raises(ConfigError, match="ddpo"):
        Trainer(tiny_config(path, tmp_path, f"model.family={family}", "method=flow_grpo"))
