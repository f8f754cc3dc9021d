"""``train.reuse_rollout_uncond``: a rollout keeps CFG's unconditional prediction of every step
(``Trajectory.uncond``) and a training forward under ``train.detach_uncond`` takes it instead of
running that branch. Keeping it changes nothing sampled; while the weights are those that sampled,
the reused forward gives the split forward's prediction and LoRA gradient (float tolerance) from one
denoiser call of the conditional rows; after the weights move, the unconditional half is exactly
the rollout's; a first (on-policy) update gives the same loss and gradient norm as without reuse;
every combination that cannot reuse is refused before any model loads."""

import pytest
import torch
from adapter_checks import _lora_gradient

from flowalign.config import ConfigError, load_config
from flowalign.objectives.base import objective_class
from flowalign.preflight import check_loaded_adapter
from flowalign.rollout import rollout
from flowalign.samplers.steps import plan_steps

PROMPTS = ["a photo of a red circle", "a photo of two squares"]
G = 4.5  # Flow-GRPO's CFG
DEMO = "configs/shapes_flow_grpo.yaml"


def _rollout(adapter, keep: bool):
    cond = adapter.encode(PROMPTS)
    schedule = adapter.schedule(4)
    traj = rollout(adapter, cond, adapter.initial_noise(2, torch.Generator().manual_seed(1)), schedule,
                   plan_steps(4, 2, 0.7), guidance_scale=G, generator=torch.Generator().manual_seed(2),
                   keep_uncond=keep)
    return traj, cond, schedule


def _perturb_lora(adapter, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def _denoiser_calls(adapter):
    calls = []  # (gradient recorded, rows) of each denoiser call

    def record(module, args, kwargs):
        calls.append((torch.is_grad_enabled(), len(kwargs.get("hidden_states", args[0] if args else None))))

    return calls, adapter.model.register_forward_pre_hook(record, with_kwargs=True)


def test_keeping_the_unconditional_predictions_changes_nothing_sampled(tiny_adapter):
    plain, cond, schedule = _rollout(tiny_adapter, keep=False)
    kept, _, _ = _rollout(tiny_adapter, keep=True)
    assert plain.uncond is None
    assert torch.equal(kept.latents, plain.latents) and torch.equal(kept.log_probs, plain.log_probs)
    assert kept.uncond.shape == (2, 4, *plain.latents.shape[2:])
    negative = tiny_adapter.negative().repeat_interleave(2)
    for j in range(4):  # each step's entry is the unconditional branch at that step's latent (its own batch)
        alone = tiny_adapter.predict(kept.latents[:, j], schedule.timesteps[j], negative, 1.0)
        assert torch.allclose(kept.uncond[:, j], alone, rtol=1e-5, atol=1e-6)
    assert kept[torch.tensor([1])].uncond.shape[0] == 1  # selected with the samples
    with pytest.raises(ValueError, match="needs CFG"):
        rollout(tiny_adapter, cond, plain.latents[:, 0], schedule, plan_steps(4, 2, 0.7), keep_uncond=True)


def test_on_policy_the_reused_forward_is_the_split_forward_from_one_call_of_the_conditional_rows(tiny_adapter):
    tiny_adapter.add_lora(4)
    _perturb_lora(tiny_adapter, 0)
    traj, cond, schedule = _rollout(tiny_adapter, keep=True)
    x, t = traj.latents[:, 1], schedule.timesteps[1]
    tiny_adapter.detach_uncond = True
    calls, hook = _denoiser_calls(tiny_adapter)
    try:
        split, grad_split = _lora_gradient(tiny_adapter, x, t, cond, G)
        split_calls, calls[:] = list(calls), []
        with tiny_adapter.given_uncond(traj.uncond[:, 1]):
            reused, grad_reused = _lora_gradient(tiny_adapter, x, t, cond, G)
    finally:
        hook.remove()
        tiny_adapter.detach_uncond = False
    assert split_calls == [(False, 2), (True, 2)] and calls == [(True, 2)]  # the no-grad branch is gone
    assert (reused - split).abs().max() <= 1e-5 * split.abs().max()
    assert (grad_reused - grad_split).norm() <= 1e-4 * grad_split.norm() and grad_split.norm() > 0


def test_after_the_weights_move_the_unconditional_half_is_the_rollouts(tiny_adapter):
    tiny_adapter.add_lora(4)
    _perturb_lora(tiny_adapter, 0)
    traj, cond, schedule = _rollout(tiny_adapter, keep=True)
    _perturb_lora(tiny_adapter, 1)  # an optimizer step later
    x, t, u = traj.latents[:, 1], schedule.timesteps[1], traj.uncond[:, 1]
    tiny_adapter.detach_uncond = True
    try:
        with torch.enable_grad():
            current = tiny_adapter.predict(x, t, cond, G)
            with tiny_adapter.given_uncond(u):
                reused = tiny_adapter.predict(x, t, cond, G)
            conditional = tiny_adapter.predict(x, t, cond, 1.0)
    finally:
        tiny_adapter.detach_uncond = False
    assert torch.allclose(reused, u + G * (conditional - u), rtol=1e-6, atol=1e-7)
    assert (reused - current).abs().max() > 1e-4 * current.abs().max()  # the current weights' half differs


def _first_update(tiny_sd3_dir, tmp_path, reuse: bool) -> dict:
    from flowalign.trainer import Trainer

    overrides = [f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "sampling.num_steps=4", "sampling.guidance_scale=4.5",
                 "train.detach_uncond=true", f"train.reuse_rollout_uncond={str(reuse).lower()}", "train.epochs=1",
                 "train.groups_per_epoch=2", "train.group_size=4", "train.sample_batch_size=8",
                 "train.train_batch_size=8", "eval.every=0", "eval.seeds=1", "checkpoint_every=0",
                 "tracker=none", "threads=1", f"output_dir={tmp_path / str(reuse)}", "train.seed=3"]
    trainer = Trainer(load_config(DEMO, overrides))
    batch = trainer.sample_epoch()
    assert (batch.traj.uncond is not None) == reuse
    advantages, _ = trainer.compute_advantages(batch)
    return trainer.update_policy(batch, advantages)


def test_a_first_update_is_the_same_with_and_without_reuse(tiny_sd3_dir, tmp_path):
    """One minibatch holds the epoch: every term is rescored by the weights that sampled it."""
    plain, reused = _first_update(tiny_sd3_dir, tmp_path, False), _first_update(tiny_sd3_dir, tmp_path, True)
    assert reused["train/ratio"] == pytest.approx(1.0, abs=1e-5) and reused["train/clipfrac"] == 0.0
    assert reused["train/policy_loss"] == pytest.approx(plain["train/policy_loss"], rel=1e-4, abs=1e-7)
    assert reused["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-4)
    assert plain["train/grad_norm"] > 0


@pytest.mark.parametrize("overrides, match", [
    (["train.reuse_rollout_uncond=true", "sampling.guidance_scale=4.5"], "needs train.detach_uncond"),
    (["train.reuse_rollout_uncond=true", "train.detach_uncond=true"], "needs CFG"),
    (["method=diffusion_nft", "sampling.eta=0", "train.reuse_rollout_uncond=true", "train.detach_uncond=true",
      "sampling.guidance_scale=4.5"], "is an option of method"),
])
def test_combinations_that_cannot_reuse_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=f"train.reuse_rollout_uncond.*{match}|{match}.*reuse_rollout_uncond"):
        load_config(DEMO, overrides)


def test_a_family_whose_guidance_bypasses_guided_is_refused_once_loaded(tiny_adapter):
    from pipelines.ltx2 import LTX2Adapter
    from pipelines.qwen_image import QwenImageAdapter
    from pipelines.z_image import ZImageAdapter

    assert not any(cls.rollout_uncond_supported for cls in (LTX2Adapter, QwenImageAdapter, ZImageAdapter))
    config = load_config(DEMO, ["train.reuse_rollout_uncond=true", "train.detach_uncond=true",
                                "sampling.guidance_scale=4.5"])
    check_loaded_adapter(config, tiny_adapter, objective_class(config.method, 'sd3', 'velocity'))  # SD3: through guided
    tiny_adapter.rollout_uncond_supported = False  # as those families declare
    with pytest.raises(ConfigError, match="train.reuse_rollout_uncond is not supported by model family"):
        check_loaded_adapter(config, tiny_adapter, objective_class(config.method, 'sd3', 'velocity'))
