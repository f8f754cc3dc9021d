"""DiffusionNFT: closed forms, the r ≡ 1 reduction to flow matching, gradient signs, the trainer path."""

import pytest
import torch

from flowalign.objectives.diffusion_nft import diffusion_nft_loss, old_policy_decay, optimality_probability
from flowalign.trainer import Trainer
from helpers import cut_and_resumed, tiny_config


def _problem(b=3, shape=(2, 4, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, *shape, generator=g)
    eps = torch.randn(b, *shape, generator=g)
    t = torch.rand(b, generator=g) * 0.8 + 0.1
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    v_old = torch.randn(b, *shape, generator=g)
    return x0, eps, t, x_t, v_old


def test_optimality_probability_maps_clipped_advantages_to_unit_interval():
    r = optimality_probability(torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0]), 5.0)
    assert r.tolist() == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_r_one_beta_one_is_weighted_flow_matching_toward_the_samples():
    x0, eps, t, x_t, v_old = _problem()
    v = torch.randn_like(x0, requires_grad=True)
    loss, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, torch.ones(3), beta=1.0)
    # closed form: x̂0 − x0 = −t·(v − (ε − x0)); per sample mean(err²) / mean|err|
    err = (-t.view(-1, 1, 1, 1) * (v - (eps - x0))).flatten(1)
    expected = ((err**2).mean(1) / err.detach().abs().mean(1)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    (g,) = torch.autograd.grad(loss, v)
    (g_fm,) = torch.autograd.grad(expected, v)
    torch.testing.assert_close(g, g_fm)
    # v_old plays no part at β = 1 with r ≡ 1
    loss2, _ = diffusion_nft_loss(v, torch.zeros_like(v_old), x_t, x0, t, torch.ones(3), beta=1.0)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_at_the_old_policy_the_gradient_is_2r_minus_1_times_the_flow_matching_gradient(beta):
    x0, eps, t, x_t, v_old = _problem()
    r = torch.tensor([1.0, 0.5, 0.0])
    v = v_old.clone().requires_grad_(True)
    loss, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, r, beta=beta)
    (g,) = torch.autograd.grad(loss, v)
    fm = diffusion_nft_loss(v, v_old, x_t, x0, t, torch.ones(3), beta=1.0)[0] * 3  # per-sample sum
    (g_fm,) = torch.autograd.grad(fm, v)
    # positive samples are pulled like flow matching, r = ½ gives nothing, negative ones are pushed away
    torch.testing.assert_close(g, (2 * r - 1).view(-1, 1, 1, 1) * g_fm / 3)
    assert g[1].abs().max() < 1e-5 * g[0].abs().max()


def test_a_gradient_step_moves_toward_good_samples_and_away_from_bad_ones():
    x0, eps, t, x_t, v_old = _problem(b=2)
    v = v_old.clone().requires_grad_(True)
    loss, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, torch.tensor([1.0, 0.0]), beta=1.0)
    loss.backward()
    v_new = v.detach() - 0.05 * v.grad
    before = ((x_t - t.view(-1, 1, 1, 1) * v_old - x0) ** 2).flatten(1).mean(1)
    after = ((x_t - t.view(-1, 1, 1, 1) * v_new - x0) ** 2).flatten(1).mean(1)
    assert after[0] < before[0]  # the good sample is reconstructed better
    assert after[1] > before[1]  # the bad one worse


def test_kl_term_is_zero_at_the_reference_and_weights_drop_samples():
    x0, eps, t, x_t, v_old = _problem()
    v = torch.randn_like(x0)
    r = torch.tensor([0.9, 0.1, 0.4])
    _, stats = diffusion_nft_loss(v, v_old, x_t, x0, t, r, beta=0.5, v_ref=v, kl_beta=1.0)
    assert stats["kl"] == 0
    full, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, r, beta=0.5, weight=torch.tensor([1.0, 0.0, 1.0]))
    kept, _ = diffusion_nft_loss(v[[0, 2]], v_old[[0, 2]], x_t[[0, 2]], x0[[0, 2]], t[[0, 2]], r[[0, 2]], beta=0.5)
    assert full.item() == pytest.approx(kept.item(), rel=1e-6)
    with pytest.raises(ValueError, match="beta"):
        diffusion_nft_loss(v, v_old, x_t, x0, t, r, beta=0.0)


def test_old_policy_decay_ramps_then_holds():
    assert [old_policy_decay(e, 0.1, 0.25) for e in (0, 1, 2, 3, 10)] == [0.0, 0.1, 0.2, 0.25, 0.25]


NFT = ("method=diffusion_nft", "sampling.eta=0.0", "train.noise_draws=2", "train.nft_old_decay_rate=0.2")


def test_nft_trains_samples_with_the_old_policy_and_resumes_exactly(tiny_sd3_dir, tmp_path):
    full, resumed = cut_and_resumed(tiny_sd3_dir, tmp_path, *NFT, "train.train_batch_size=4")
    assert [h["train/old_decay"] for h in full.history] == pytest.approx([0.0, 0.2, 0.4])
    assert all(h["train/grad_norm"] > 0 for h in full.history)
    # the old policy trails the trained weights once its decay is above 0
    assert any((s - p).abs().max() > 0 for s, p in zip(full.objective.old.shadow, full.params))
    keys = ["train/policy_loss", "reward/mean", "train/grad_norm", "train/nft_r"]
    assert [[h[k] for k in keys] for h in resumed.history] == [[h[k] for k in keys] for h in full.history]
    assert all(torch.equal(a, b) for a, b in zip(resumed.objective.old.shadow, full.objective.old.shadow))


def test_at_the_old_policy_shared_noising_cancels_the_noise_against_centred_r():
    # NFT's gradient at v_θ = v_old is Σ_i (2r_i − 1)·g_i (above); with one (t, ε) for the whole group
    # and an old policy that sees only x_t, replacing ε by another draw changes every g_i by the same
    # amount, which the centred (2r − 1) sums to zero, and the gradient on the trained parameters does not move.
    x0 = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    r = torch.tensor([1.0, 0.75, 0.25, 0.0])  # Σ (2r − 1) = 0
    t = torch.full((4,), 0.5)
    layer = torch.nn.Conv2d(2, 2, 1)

    def grad(eps):
        x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
        v = layer(x_t)
        v_old = v.detach()
        err = (x_t - t.view(-1, 1, 1, 1) * v - x0).flatten(1)
        layer.zero_grad()
        # the unweighted NFT loss (adaptive weights 1), whose gradient at v_old is Σ(2r−1)·∂‖x̂0 − x0‖²
        loss = ((r * (err ** 2).mean(1)) + (1 - r) * ((x_t - t.view(-1, 1, 1, 1) * (2 * v_old - v) - x0)
                                                    .flatten(1) ** 2).mean(1)).sum()
        loss.backward()
        return layer.bias.grad.clone()

    g = torch.Generator().manual_seed(2)
    shared = [grad(torch.randn(1, 2, 4, 4, generator=g).expand(4, -1, -1, -1)) for _ in range(2)]
    own = [grad(torch.randn(4, 2, 4, 4, generator=g)) for _ in range(2)]
    torch.testing.assert_close(shared[0], shared[1])  # the bias gradient sees the ε part only: it cancels
    assert (own[0] - own[1]).abs().max() > 1e-3  # per-sample draws: it does not


def test_shared_noising_gives_a_group_one_draw_and_trains_it_in_one_minibatch(tiny_sd3_dir, tmp_path):
    from flowalign.config import ConfigError
    from flowalign.objectives.forward_process import forward_draws

    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *NFT, "train.nft_shared_noising=true",
                                  "train.train_batch_size=4"))
    steps, eps = forward_draws(trainer.dist, 8, 4, (3, 2, 2), trainer.config.train.noise_draws,
                               trainer.config.train.group_size)
    for group in (slice(0, 4), slice(4, 8)):
        assert (steps[group] == steps[group][:1]).all() and (eps[group] == eps[group][:1]).all()
    assert not torch.equal(eps[0], eps[4])
    assert {frozenset((i // 4 for i in idx.tolist())) for idx in trainer.dist.minibatches(8, 4)} == {frozenset([0]),
                                                                                                frozenset([1])}
    with pytest.raises(ConfigError, match="train.train_batch_size"):
        tiny_config(tiny_sd3_dir, tmp_path, *NFT, "train.nft_shared_noising=true", "train.train_batch_size=6")
