"""Flow-DPPO: with an inactive mask it is the unclipped policy gradient (Flow-GRPO at an infinite clip
range), the per-step KL against torch.distributions, the mask turning on exactly at the threshold and
only for updates along the advantage, hand-computed values, the gradient's sign, on-policy ratio 1 and
off-policy masking through the trainer with an exact resume, the config rules, the recipes' numbers."""

import math

import pytest
import torch
from torch.distributions import Independent, Normal, kl_divergence

from flowalign.config import ConfigError, load_config
from flowalign.objectives.flow_dppo import flow_dppo_loss, kl_adv_mask, step_kl
from flowalign.objectives.flow_grpo import flow_grpo_loss
from flowalign.samplers.flow_sde import cps_step, flow_grpo_sde_step, gaussian_log_prob
from flowalign.trainer import Trainer
from helpers import cut_and_resumed, tiny_config

DPPO = ("method=flow_dppo",)


def _off_policy_step(step=flow_grpo_sde_step, shift=0.3, seed=0, b=6, shape=(2, 3, 3)):
    """A real SDE step drawn by v_old and rescored at v = v_old + shift·noise (with grad): the
    θ-step's (log_prob, mean, std), the old step, v, and a reference mean."""
    g = torch.Generator().manual_seed(seed)
    x, v_old = torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)
    z = torch.randn(b, *shape, generator=g)
    old = step(v_old, x, 0.6, 0.45, 0.7, noise=z)
    v = (v_old + shift * torch.randn(b, *shape, generator=g)).requires_grad_(True)
    new = step(v, x, 0.6, 0.45, 0.7, prev_sample=old.prev_sample)
    ref = step(v_old - 0.1, x, 0.6, 0.45, 0.7, prev_sample=old.prev_sample)
    return new, old, v, ref


@pytest.mark.parametrize("step", [flow_grpo_sde_step, cps_step])
@pytest.mark.parametrize("beta", [0.0, 0.2])
def test_with_an_inactive_mask_it_is_the_unclipped_policy_gradient(step, beta):
    """τ = ∞: Flow-DPPO's loss and gradient are Flow-GRPO's at clip range ∞, off-policy (r ≠ 1, KL > 0),
    with samples that do not train this step, with and without the reference KL."""
    new, old, v, ref = _off_policy_step(step)
    adv = torch.tensor([1.5, -0.7, 0.3, -2.0, 0.0, 1.0])
    weight = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    dppo, ds = flow_dppo_loss(new.log_prob, old.log_prob, adv, mean=new.mean, old_mean=old.mean, std=new.std,
                              kl_threshold=math.inf, weight=weight, beta=beta, ref_mean=ref.mean)
    grpo, gs = flow_grpo_loss(new.log_prob, old.log_prob, adv, clip_range=math.inf, beta=beta, mean=new.mean,
                              ref_mean=ref.mean, std=new.std, weight=weight)
    assert dppo.item() == pytest.approx(grpo.item(), rel=1e-6, abs=1e-9)
    assert ds["masked_fraction"] == 0 and ds["kl_mask_fraction"] == 0
    (g_dppo,) = torch.autograd.grad(dppo, v, retain_graph=True)
    (g_grpo,) = torch.autograd.grad(grpo, v, retain_graph=True)
    assert torch.allclose(g_dppo, g_grpo, rtol=1e-5, atol=1e-9) and g_dppo.abs().sum() > 0
    assert ds["ratio"].item() == pytest.approx(gs["ratio"].item()) and ds["ratio"].item() != 1.0
    # the same data is far off-policy: at τ = 0 every update along its advantage is dropped (the check can fail)
    masked, ms = flow_dppo_loss(new.log_prob, old.log_prob, adv, mean=new.mean, old_mean=old.mean, std=new.std,
                                kl_threshold=0.0, weight=weight)
    assert ms["kl_mask_fraction"] == 1 and 0 < ms["masked_fraction"] < 1
    assert masked.item() != pytest.approx(dppo.item() - beta * ds["kl"].item())


@pytest.mark.parametrize("per_element", [False, True])
def test_the_step_kl_is_the_gaussian_kl_of_torch_distributions_per_element(per_element):
    g = torch.Generator().manual_seed(2)
    mean, old_mean = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    # one std per sample, or a per-element exploration std (EXPLORENET) shared by the two steps
    std = 0.1 + torch.rand(3, 2, 4, generator=g) if per_element else torch.tensor([0.2, 0.5, 1.3]).view(3, 1, 1)
    d = step_kl(mean, old_mean, std)
    old_step, new_step = Normal(old_mean, std.expand_as(mean)), Normal(mean, std.expand_as(mean))
    assert torch.allclose(d, kl_divergence(old_step, new_step).flatten(1).mean(1), rtol=1e-6)
    assert torch.allclose(d, kl_divergence(new_step, old_step).flatten(1).mean(1), rtol=1e-6)  # equal covariances
    whole = kl_divergence(Independent(old_step, 2), Independent(new_step, 2))  # the paper's KL of the whole latent
    assert torch.allclose(d * 8, whole, rtol=1e-6)
    by_hand = step_kl(torch.full((1, 5), 0.3), torch.zeros(1, 5), torch.tensor(0.5))
    assert by_hand.item() == pytest.approx(0.3**2 / (2 * 0.5**2))  # 0.18


def test_the_mask_drops_exactly_the_high_kl_updates_along_their_advantage():
    high = torch.tensor([1.0] * 6 + [0.0] * 6)  # D = 1 ≥ τ = 1 (high) for the first six, D = 0 after
    ratio = torch.tensor([1.1, 0.9, 1.1, 0.9, 1.0, 1.1] * 2)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 0.0] * 2)
    drop, is_high, keep = kl_adv_mask(high, ratio, adv, 1.0)
    assert is_high.tolist() == [True] * 6 + [False] * 6
    # high: pushing a good sample up, a bad one down → dropped; moving back, on-policy r = 1, A = 0 → kept
    assert drop.tolist() == [True, True, False, False, False, False] + [False] * 6
    assert torch.equal(keep, ~drop)


def test_the_mask_turns_on_exactly_where_the_kl_reaches_the_threshold_and_its_values_by_hand():
    delta = torch.tensor([0.1, 0.2, 0.3, 0.4]).view(4, 1)
    old_mean, std = torch.zeros(4, 5), torch.tensor(0.5)
    d = step_kl(delta.expand(4, 5), old_mean, std)  # Δ²/(2s²) = 2Δ²: 0.02, 0.08, 0.18, 0.32
    assert torch.allclose(d, 2 * delta.flatten() ** 2)
    log_prob = torch.tensor([0.02, 0.03, -0.01, 0.04], requires_grad=True)
    old = torch.zeros(4)
    adv = torch.tensor([2.0, 1.0, -1.0, -0.5])  # r > 1 with A > 0 (0, 1), r < 1 with A < 0 (2), r > 1 with A < 0 (3)
    for k in range(4):
        tau = float(d[k])
        above = float(torch.nextafter(d[k], torch.tensor(math.inf)))  # the next float32: D is compared in float32
        for threshold, dropped in ((tau, {i for i in range(3) if d[i] >= tau}),
                                   (above, {i for i in range(3) if d[i] > tau})):
            mean = (delta.expand(4, 5)).clone().requires_grad_(True)
            loss, stats = flow_dppo_loss(log_prob, old, adv, mean=mean, old_mean=old_mean, std=std,
                                         kl_threshold=threshold)
            (grad,) = torch.autograd.grad(loss, log_prob)
            ratio = log_prob.detach().exp()
            kept = [i for i in range(4) if i not in dropped]
            assert loss.item() == pytest.approx(sum(-adv[i].item() * ratio[i].item() for i in kept) / 4, rel=1e-6)
            assert [i for i in range(4) if grad[i] == 0] == sorted(dropped)  # ∂L/∂log p_i = −A_i·r_i/4 if kept
            assert torch.allclose(grad[kept], -adv[kept] * ratio[kept] / 4)
            assert stats["kl_mask_fraction"].item() == pytest.approx((d >= threshold).float().mean().item())
            assert stats["masked_fraction"].item() == pytest.approx(len(dropped) / 4)
    # the mean divergence the progress shows, by hand: (0.02 + 0.08 + 0.18 + 0.32) / 4
    assert stats["kl_new_old"].item() == pytest.approx(0.15)


def test_a_dropped_sample_is_zero_even_when_its_ratio_overflowed():
    log_prob = torch.tensor([200.0, 0.01], requires_grad=True)  # exp(200) is inf in float32
    mean = torch.tensor([[1.0] * 3, [0.0] * 3])  # D = 0.5 ≥ τ for the first sample, 0 for the second
    loss, stats = flow_dppo_loss(log_prob, torch.zeros(2), torch.tensor([1.0, 1.0]), mean=mean,
                                 old_mean=torch.zeros(2, 3), std=torch.tensor(1.0), kl_threshold=0.1)
    assert stats["masked_fraction"] == 0.5
    assert torch.isfinite(loss) and loss.item() == pytest.approx(-math.exp(0.01) / 2)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert grad[0] == 0 and grad[1].item() == pytest.approx(-math.exp(0.01) / 2)


def test_a_gradient_step_moves_the_mean_toward_a_good_sample_and_away_from_a_bad_one():
    g = torch.Generator().manual_seed(5)
    mu_old, z = torch.randn(1, 2, 3, generator=g), torch.randn(1, 2, 3, generator=g)
    std = torch.tensor(0.3)
    x_next = mu_old + std * z
    old = gaussian_log_prob(x_next, mu_old, std)

    def step_of(mu_start, adv, threshold):
        mu = mu_start.clone().requires_grad_(True)
        loss, stats = flow_dppo_loss(gaussian_log_prob(x_next, mu, std), old, torch.tensor([adv]), mean=mu,
                                     old_mean=mu_old, std=std, kl_threshold=threshold)
        loss.backward()
        return -mu.grad, stats

    for adv, sign in ((1.0, 1), (-1.0, -1)):  # on-policy: r = 1, D = 0, never masked
        step, stats = step_of(mu_old, adv, 1e-5)
        assert sign * (step * (x_next - mu_old)).sum() > 0 and stats["masked_fraction"] == 0
    toward, away = mu_old + 0.5 * (x_next - mu_old), mu_old - 0.5 * (x_next - mu_old)  # D = 0.125·mean(z²)
    step, stats = step_of(toward, 1.0, 1e-5)  # far, and still pushing a good sample up (r > 1): dropped
    assert stats["masked_fraction"] == 1 and torch.equal(step, torch.zeros_like(step))
    step, stats = step_of(away, 1.0, 1e-5)  # far, but moving back toward the good sample (r < 1): kept
    assert stats["kl_mask_fraction"] == 1 and stats["masked_fraction"] == 0
    assert (step * (x_next - away)).sum() > 0
    step, stats = step_of(toward, 1.0, math.inf)  # no mask: the unclipped gradient keeps pushing
    assert stats["masked_fraction"] == 0 and (step * (x_next - toward)).sum() > 0


def test_on_policy_the_ratio_is_one_and_nothing_is_masked_through_the_trainer(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *DPPO, "train.kl_mask_threshold=0"))
    trainer.train()  # one optimizer step per epoch: every minibatch is on-policy, so even τ = 0 masks nothing
    for h in trainer.history:
        assert h["train/ratio"] == pytest.approx(1.0, abs=1e-6)
        assert h["train/kl_new_old"] == pytest.approx(0.0, abs=1e-12)
        assert h["train/masked_fraction"] == 0
        assert h["train/grad_norm"] > 0 and math.isfinite(h["train/policy_loss"])
    # after the last epoch the kept rollout policy is the trained weights (they sample the next epoch)
    assert all(torch.equal(s, p.detach()) for s, p in zip(trainer.objective.rollout_policy.shadow, trainer.params))
    assert "rollout_policy" in trainer.objective.components()


def test_off_policy_minibatches_are_masked_against_the_rollout_policy_and_resume_exactly(tiny_sd3_dir, tmp_path):
    """Two optimizer steps per epoch: the second minibatch is off-policy (r ≠ 1, D > 0 against the kept
    rollout policy); at a tiny τ the mask drops some of its updates. The kept policy is checkpointed:
    a resumed run repeats the uninterrupted one."""
    over = (*DPPO, "train.train_batch_size=4", "train.learning_rate=1e-2", "train.kl_mask_threshold=1e-12")
    full, resumed = cut_and_resumed(tiny_sd3_dir, tmp_path, *over)
    assert any(abs(h["train/ratio"] - 1) > 1e-6 for h in full.history)
    assert all(h["train/kl_new_old"] > 0 for h in full.history)
    assert any(h["train/masked_fraction"] > 0 for h in full.history)
    keys = ["train/policy_loss", "train/ratio", "train/kl_new_old", "train/masked_fraction", "reward/mean",
            "train/grad_norm"]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]


def test_with_an_inactive_mask_a_run_is_flow_grpo_without_a_clip_through_the_trainer(tiny_sd3_dir, tmp_path):
    """τ = ∞ against Flow-GRPO at a clip range no ratio reaches, off-policy minibatches included: the same
    rollouts, losses, gradients and rewards, epoch by epoch."""
    over = ("train.train_batch_size=4", "train.learning_rate=1e-2", "train.epochs=3")
    dppo = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "dppo", *DPPO, "train.kl_mask_threshold=.inf", *over))
    dppo.train()
    grpo = Trainer(tiny_config(tiny_sd3_dir, tmp_path / "grpo", "train.clip_range=1e9", *over))
    grpo.train()
    assert any(abs(h["train/ratio"] - 1) > 1e-6 for h in dppo.history)
    assert all(h["train/masked_fraction"] == 0 for h in dppo.history)
    for key in ("train/policy_loss", "train/ratio", "train/grad_norm", "reward/mean"):
        assert [h[key] for h in dppo.history] == pytest.approx([h[key] for h in grpo.history], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("override, key", [
    ("train.clip_range=0.2", "train.clip_range"),  # the mask replaces the clip: a set clip range is refused
    ("train.kl_mask_threshold=-1", "train.kl_mask_threshold"),
    ("train.guard_step_weight=none", "train.guard_step_weight"),  # GRPO-Guard's option, not Flow-DPPO's
    ("train.kl_convention=flow_grpo", "train.kl_convention"),
    ("train.per_reward_advantages=true", "train.per_reward_advantages"),
    ("sampling.eta=0", "sampling.eta"),
])
def test_wrong_settings_fail_before_the_model_loads_naming_the_key(override, key, tmp_path):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *DPPO, override))


def test_the_recipes_carry_the_authors_settings():
    """configs/sd35m_flow_dppo_pickscore.yaml against UniRL examples/diffusion/sd3_flowdppo.yaml (1a7b501e)."""
    c = load_config("configs/sd35m_flow_dppo_pickscore.yaml")
    s, t, m = c.sampling, c.train, c.model
    assert (c.method, s.sde, s.eta, s.num_steps, s.guidance_scale) == ("flow_dppo", "flow_grpo", 0.7, 10, 1.0)
    assert (s.step_mode, s.window_size, s.window_range) == ("window", 3, [0, 5])  # 3 SDE steps of the first half
    assert (t.kl_mask_threshold, t.kl_beta, t.global_std, t.zero_advantage) == (1e-5, 0.0, True, "keep")
    assert t.groups_per_epoch * 8 == 48 and t.group_size == 16  # 48 prompts × 16 on 8 processes
    assert t.train_batch_size * 2 == t.groups_per_epoch * t.group_size  # num_updates_per_batch 2
    assert (t.learning_rate, t.weight_decay, t.max_grad_norm, t.seed) == (3e-4, 0.0, 1.0, 42)
    assert (m.lora_rank, m.lora_alpha, m.height, m.width) == (32, 64, 512, 512)
    assert c.reward.weights == {"pickscore": 1.0}
    shapes = load_config("configs/shapes_flow_dppo.yaml")
    assert (shapes.method, shapes.sampling.sde, shapes.sampling.eta, shapes.train.kl_mask_threshold) == (
        "flow_dppo", "flow_grpo", 0.7, 1e-5)
