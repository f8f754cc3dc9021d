"""EXPLORENET: isotropic at init, closed-form log-probs with a per-element std, the spread
estimator's sign on a toy problem, and a generator that samples without it."""

import pytest
import torch
from helpers import tiny_config

from flowalign.experimental.explorenet import ExploreNet, exploration_log_density, group_spread_advantages, normalise_shape
from flowalign.rollout import rollout
from flowalign.samplers.flow_sde import flow_grpo_sde_step
from flowalign.samplers.steps import plan_steps
from flowalign.trainer import Trainer
from pipelines import adapter_class


def test_normalised_shape_keeps_the_total_noise_variance():
    m = normalise_shape(torch.randn(3, 4, 5, 5) * 2)
    assert torch.allclose((m**2).flatten(1).mean(1), torch.ones(3), atol=1e-5)
    assert torch.allclose(normalise_shape(torch.zeros(2, 7)), torch.ones(2, 7), rtol=0, atol=1e-6)


def test_per_element_std_log_prob_is_the_closed_form_gaussian():
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(2, 3, 4, generator=g) for _ in range(3))
    m = torch.rand(2, 3, 4, generator=g) + 0.5
    iso = flow_grpo_sde_step(v, x, 0.6, 0.5, 0.8, noise=z)
    out = flow_grpo_sde_step(v, x, 0.6, 0.5, 0.8, noise=z, std_scale=m)
    assert torch.equal(out.mean, iso.mean)  # only the std changes
    expected = torch.distributions.Normal(iso.mean, iso.std * m).log_prob(out.prev_sample).flatten(1).mean(1)
    torch.testing.assert_close(out.log_prob, expected)
    torch.testing.assert_close(out.prev_sample, iso.mean + iso.std * m * z)


def test_an_untrained_explorer_reproduces_isotropic_rollouts_exactly(tiny_adapter):
    cond = tiny_adapter.encode(["a photo of a red circle", "a photo of two squares"])
    noise = tiny_adapter.initial_noise(2, torch.Generator().manual_seed(1))
    net = ExploreNet(noise.shape[1], cond.tensors["pooled"].shape[-1], 4, "both")
    plan = plan_steps(4, 2, 1.0)
    schedule = tiny_adapter.schedule(4)
    iso = rollout(tiny_adapter, cond, noise, schedule, plan, generator=torch.Generator().manual_seed(2))
    learned = rollout(tiny_adapter, cond, noise, schedule, plan, generator=torch.Generator().manual_seed(2),
                      noise_scale=lambda x, step: net(x, step, cond.tensors["pooled"]))
    assert torch.equal(learned.latents, iso.latents) and torch.equal(learned.log_probs, iso.log_probs)
    assert torch.equal(learned.std_scales[:, :3], torch.ones_like(learned.std_scales[:, :3]))


def test_group_spread_weights_are_unbiased_variances_minus_the_other_groups_mean():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    weights, stats = group_spread_advantages(rewards, groups)
    u = [2.0, 0.0, 8.0]  # unbiased variances of (1, 3), (2, 2), (0, 4)
    expected = [u[0] - (u[1] + u[2]) / 2] * 2 + [u[1] - (u[0] + u[2]) / 2] * 2 + [u[2] - (u[0] + u[1]) / 2] * 2
    assert weights.tolist() == pytest.approx(expected)
    assert stats["explore/zero_spread_groups"] == pytest.approx(1 / 3)


def test_the_estimator_moves_noise_to_the_element_the_reward_depends_on():
    # reward = noise actually added to element 0 (element 1 is irrelevant): the group variance
    # grows with m_0², so ascending the estimator must shift the (normalised) noise to element 0
    raw = torch.zeros(1, 2, requires_grad=True)
    opt = torch.optim.Adam([raw], lr=0.05)
    g = torch.Generator().manual_seed(0)
    groups, size = 64, 8
    for _ in range(60):
        m = normalise_shape(raw).expand(groups * size, 2)
        z = torch.randn(groups * size, 2, generator=g)
        w = (m * z).detach()  # what was sampled: (x' − μ) / isotropic std
        rewards = w[:, 0]
        weights, _ = group_spread_advantages(rewards, torch.arange(groups).repeat_interleave(size))
        loss = -(weights * exploration_log_density(w, m)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    m = normalise_shape(raw.detach())[0]
    assert m[0] > 1.2 > 0.8 > m[1]


def test_training_with_the_explorer_is_on_policy_and_the_generator_needs_nothing_of_it(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "explore.mode=shape", "train.epochs=2",
                                  "explore.learning_rate=0.05"))
    trainer.train()
    first = trainer.history[0]
    assert first["train/ratio"] == pytest.approx(1.0, abs=1e-6)  # log-probs rescored with the std sampled with
    assert first["explore/m_std"] == 0.0 and trainer.history[1]["explore/m_std"] > 0  # isotropic, then learned
    assert (tmp_path / "explorenet" / "explorenet.safetensors").is_file()
    assert not any("explore" in p.name for p in (tmp_path / "final").iterdir())
    adapter = adapter_class("sd3").from_pretrained(str(tiny_sd3_dir), trained=str(tmp_path / "final"))
    traj = rollout(adapter, adapter.encode(["a photo of a circle"]), adapter.initial_noise(1, torch.Generator()),
                   adapter.schedule(4), plan_steps(4, 1, 0.0))
    assert torch.isfinite(traj.samples).all()
