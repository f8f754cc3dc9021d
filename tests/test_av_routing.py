"""DiffusionNFT with audio-video reward routing: reductions, closed forms, hand computations."""

import math

import pytest
import torch

from flowalign.experimental.av_routing import (RewardRouter, branch_advantages, branch_contrasts, floor_gate,
                                             floor_multipliers, interaction_gram, layer_gradient_scales, psd_part,
                                             residual_weights, response_ratio, routed_priors,
                                             token_weights)
from flowalign.objectives.diffusion_nft import diffusion_nft_loss


def _batch(b=3, d=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0, eps, v_old = (torch.randn(b, d, generator=g) for _ in range(3))
    t = torch.rand(b, generator=g) * 0.8 + 0.1
    x_t = (1 - t[:, None]) * x0 + t[:, None] * eps
    v_theta = (v_old + 0.3 * torch.randn(b, d, generator=g)).requires_grad_(True)
    return v_theta, v_old, x_t, x0, t


def test_one_branch_with_uniform_tokens_is_plain_diffusion_nft():
    v, v_old, x_t, x0, t = _batch()
    r = torch.tensor([0.2, 0.5, 0.9])
    plain, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, r, beta=0.7)
    routed, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, r[:, None], masks=torch.ones(1, 10, dtype=torch.bool), beta=0.7)
    assert routed.item() == pytest.approx(plain.item(), rel=1e-6)
    (g_plain,) = torch.autograd.grad(plain, v)
    (g_routed,) = torch.autograd.grad(routed, v)
    assert torch.allclose(g_plain, g_routed, atol=1e-7)


@pytest.mark.parametrize("waiting", [False, True])
def test_the_same_r_on_every_branch_is_plain_diffusion_nft(waiting):
    # two branches of unequal size (6 + 4 elements); ``waiting``: a video-first sample whose second
    # stream waits (x0 = x_t and velocity 0 there), so only the first has an error
    v, v_old, x_t, x0, t = _batch(seed=3)
    masks = torch.zeros(2, 10, dtype=torch.bool)
    masks[0, :6], masks[1, 6:] = True, True
    if waiting:
        keep = masks[0].float()
        v = (v * keep).detach().requires_grad_(True)
        v_old, x0 = v_old * keep, torch.where(masks[0], x0, x_t)
    r = torch.tensor([0.2, 0.5, 0.9])
    plain, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, r, beta=1.0)
    routed, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, r[:, None].expand(3, 2), masks=masks, beta=1.0)
    assert routed.item() == pytest.approx(plain.item(), rel=1e-6)
    (g_plain,) = torch.autograd.grad(plain, v)
    (g_routed,) = torch.autograd.grad(routed, v)
    torch.testing.assert_close(g_routed, g_plain)
    if waiting:  # the waiting stream has no error, so its r multiplies nothing
        contrast = branch_contrasts(v, v_old, x_t, x0, t, masks, beta=1.0)
        assert contrast[:, 1].abs().max() == 0 and contrast[:, 0].abs().min() > 0


def test_each_branch_trains_only_on_its_own_advantage():
    v, v_old, x_t, x0, t = _batch()
    masks = torch.zeros(2, 10, dtype=torch.bool)
    masks[0, :6], masks[1, 6:] = True, True  # video elements 0-5, audio 6-9
    grads = []
    for r_audio in (0.1, 0.9):
        r = torch.stack([torch.full((3,), 0.7), torch.full((3,), r_audio)], 1)
        loss, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, r, masks=masks, beta=1.0)
        grads.append(torch.autograd.grad(loss, v)[0])
    assert torch.equal(grads[0][:, :6], grads[1][:, :6])  # the audio reward does not move video elements
    assert not torch.allclose(grads[0][:, 6:], grads[1][:, 6:])


def test_contrast_is_what_each_branchs_r_multiplies_in_the_loss():
    v, v_old, x_t, x0, t = _batch(seed=1)
    masks = torch.zeros(2, 10, dtype=torch.bool)
    masks[0, :7], masks[1, 7:] = True, True
    elem = torch.rand(3, 10, generator=torch.Generator().manual_seed(2)) + 0.5
    c = branch_contrasts(v, v_old, x_t, x0, t, masks, beta=0.5, elem_weight=elem)
    r = torch.full((3, 2), 0.3, requires_grad=True)
    loss, _ = diffusion_nft_loss(v, v_old, x_t, x0, t, r, masks=masks, beta=0.5, elem_weight=elem)
    (dr,) = torch.autograd.grad(loss, r)
    torch.testing.assert_close(c.detach(), dr * 3)  # ×3 undoes the mean over samples: L is affine in r
    (g,) = torch.autograd.grad(c[:, 1].sum(), v)
    assert g[:, :7].abs().max() == 0 and g[:, 7:].abs().max() > 0  # branch 1's contrast sees its elements only


def test_gram_and_cosines_match_a_hand_computation():
    # two rewards measured on two halves: reward 1 pushes along e1, reward 2 against it (plus e2)
    grads_a = torch.tensor([[1.0, 0.0], [-0.5, 1.0]])
    grads_b = torch.tensor([[1.0, 0.2], [-0.5, 0.0]])
    gram = interaction_gram(grads_a, grads_b)[None]
    # G = (g_A·g_Bᵀ + g_B·g_Aᵀ) / 2: ⟨a0,b0⟩ = 1, ⟨a1,b1⟩ = 0.25, (⟨a0,b1⟩ + ⟨a1,b0⟩) / 2 = (−0.5 − 0.3) / 2
    assert torch.allclose(gram[0], torch.tensor([[1.0, -0.4], [-0.4, 0.25]]))
    priors = torch.tensor([[0.8, 0.2]])
    # this G is PSD already (det = 0.25 − 0.16 > 0): cosines under the priors, one dual-ascent step from ρ = 0
    w, cos, rho = residual_weights(priors, gram, torch.zeros(1, 2), active=True, strength=1.0, threshold=0.3)
    gw = [0.8 - 0.08, -0.32 + 0.05]  # G w
    wgw = 0.8 * gw[0] + 0.2 * gw[1]
    assert cos[0].tolist() == pytest.approx([gw[0] / math.sqrt(1.0 * wgw), gw[1] / math.sqrt(0.25 * wgw)], rel=1e-5)
    assert cos[0, 0] > 0.9 and cos[0, 1] < -0.7  # the dominant vs the suppressed
    assert rho[0].tolist() == pytest.approx([0.0, 0.3 - float(cos[0, 1])], rel=1e-5)
    boosted = priors[0] * (1 + rho[0])
    assert w[0].tolist() == pytest.approx((boosted / boosted.sum()).tolist(), rel=1e-5)
    assert w.sum().item() == pytest.approx(1.0)  # the row keeps its prior mass


def test_the_residual_grows_while_a_reward_is_suppressed_and_decays_once_it_is_not():
    priors = torch.tensor([[0.5, 0.5]])
    conflict = torch.tensor([[[4.0, -1.0], [-1.0, 0.5]]])  # reward 0 dominates and pushes reward 1 down
    rho = torch.zeros(1, 2)
    rhos, coses = [], []
    for _ in range(30):
        w, cos, rho = residual_weights(priors, conflict, rho, active=True)
        rhos.append(float(rho[0, 1]))
        coses.append(float(cos[0, 1]))
    assert rho[0, 0] == 0 and coses[0] < 0  # the dominant one keeps its prior boost (none)
    assert rhos[:5] == sorted(rhos[:5]) and coses[-1] > coses[0]  # the suppressed one gains until it improves
    assert coses[-1] == pytest.approx(0.3, abs=0.05) and w[0, 1] > 2 * w[0, 0]  # (G w)_1 > 0 needs w1 > 2·w0
    agree = torch.ones(1, 2, 2)
    for _ in range(10):
        w, cos, rho = residual_weights(priors, agree, rho, active=True)
    assert torch.equal(rho, torch.zeros(1, 2)) and torch.allclose(w, priors)  # back to the priors


def test_cosines_of_a_non_psd_estimate_stay_in_the_unit_interval():
    gram = torch.tensor([[[0.01, 0.5], [0.5, 1.0]]])  # half-split noise: not PSD
    _, cos, _ = residual_weights(torch.ones(1, 2), gram, torch.zeros(1, 2), active=True)
    assert cos.abs().max() <= 1.0 + 1e-6
    assert torch.linalg.eigvalsh(psd_part(gram)).min() >= -1e-6


def test_the_half_split_gram_is_not_inflated_by_sampling_noise():
    # per-sample gradients = a common direction + independent noise: the half-split diagonal
    # estimates ‖mean‖², the same-sample product ‖mean‖² + noise / n
    g = torch.Generator().manual_seed(0)
    mean = torch.tensor([1.0, 0.0, 0.0, 0.0])
    split, same = [], []
    for _ in range(400):
        per_sample = mean + 2.0 * torch.randn(16, 4, generator=g)
        a, b = per_sample[0::2].mean(0, keepdim=True), per_sample[1::2].mean(0, keepdim=True)
        split.append(interaction_gram(a, b)[0, 0])
        full = per_sample.mean(0, keepdim=True)
        same.append(interaction_gram(full, full)[0, 0])
    assert abs(torch.stack(split).mean() - 1.0) < 0.15
    assert torch.stack(same).mean() > 1.7  # 1 + 4·4/16 = 2


def _gram(a):
    """The Gram of rewards whose per-sample gradients are one-hot per sample (a: [n, K] weights)."""
    return interaction_gram(a.T, a.T)


def test_priors_are_untouched_in_warmup_and_when_rewards_agree_and_zero_priors_stay_zero():
    a = torch.tensor([[0.4, 0.2, 0.3], [-0.4, -0.2, 0.1]])
    gram = torch.stack([_gram(a)] * 2)
    priors = routed_priors(torch.tensor([0.5, 0.4, 0.1]), torch.tensor([[True, True, False], [False, True, True]]))
    zero = torch.zeros_like(priors)
    w, _, rho = residual_weights(priors, gram, zero, active=False)
    assert w is priors and rho is zero  # warm-up: the priors themselves
    agree = torch.tensor([[0.4, 0.2, 0.1], [-0.4, -0.2, -0.1]])  # perfectly correlated rewards: cos = 1
    w, cos, _ = residual_weights(priors, torch.stack([_gram(agree)] * 2), zero, active=True)
    assert torch.allclose(w, priors) and torch.allclose(cos[priors > 0], torch.ones(4))
    conflict = torch.tensor([[0.4, 0.2, -0.3], [-0.4, -0.2, 0.3]])
    w, _, _ = residual_weights(priors, torch.stack([_gram(conflict)] * 2), zero, active=True)
    assert w[0, 2] == 0 and w[1, 0] == 0  # not routed there: stays 0
    assert w[1, 2] > priors[1, 2] and w[1, 1] < priors[1, 1]  # the suppressed reward gains on its branch
    assert torch.allclose(w.sum(1), priors.sum(1))


def test_floor_multipliers_match_a_hand_computation():
    lam = torch.tensor([0.0, 1.0, 0.5, 9.5])
    means = torch.tensor([0.4, 0.9, float("nan"), 0.0])
    floors = torch.tensor([0.5, 0.5, 0.5, 0.5])
    scales = torch.tensor([0.1, 0.2, 0.1, 0.1])
    out = floor_multipliers(lam, means, floors, scales, strength=2.0, max_multiplier=10.0)
    # steps 2·(0.1/0.1) = 2, 2·(−0.4/0.2) = −4 (clipped at 0), NaN mean: unchanged, 9.5 + 10 capped at 10
    assert torch.allclose(out, torch.tensor([2.0, 0.0, 0.5, 10.0]))


def test_reward_floors_boost_only_the_reward_that_falls_below_its_warmup_level():
    priors, concerns = torch.ones(3), torch.tensor([[True, False, True], [False, True, True]])  # (video, audio, sync)
    router = RewardRouter(priors, concerns, warmup=2, strength=0.0, threshold=0.3, max_residual=4.0,
                          gram_decay=0.9, floor_strength=1.0)
    gram = torch.eye(3).expand(2, 3, 3).clone()
    for epoch, means in ((1, [0.5, 0.5, 0.5]), (2, [0.7, 0.5, 0.5])):  # warm-up: floors 0.6, 0.5, 0.5
        router.observe(gram)
        router.observe_rewards(torch.tensor(means), torch.full((3,), 0.1), torch.full((3,), 10.0))
        router.end_epoch(epoch)
        assert torch.equal(router.weights, router.priors)
    floors, scales = router.floors()
    assert torch.allclose(floors, torch.tensor([0.6, 0.5, 0.5]))
    assert torch.allclose(scales, torch.tensor([0.1 ** 2 + 0.1 ** 2, 0.01, 0.01]).sqrt(), atol=1e-6)  # within + between
    router.observe(gram)
    router.observe_rewards(torch.tensor([0.9, 0.6, 0.45]), torch.full((3,), 0.1), torch.full((3,), 10.0))
    router.end_epoch(3)
    # only sync is below its floor: λ = (0.5 − 0.45)/0.1 = 0.5, W ∝ (1, 0, 1.5) per branch at mass 2
    assert torch.allclose(router.floor_multiplier, torch.tensor([0.0, 0.0, 0.5]), atol=1e-6)
    assert torch.allclose(router.weights, torch.tensor([[0.8, 0.0, 1.2], [0.0, 0.8, 1.2]]), atol=1e-6)
    restored = RewardRouter(priors, concerns, warmup=2, strength=0.0, threshold=0.3, max_residual=4.0,
                            gram_decay=0.9, floor_strength=1.0)
    restored.load_state_dict(router.state_dict())
    assert torch.equal(restored.floor_multiplier, router.floor_multiplier)
    assert torch.equal(restored.warmup_sums, router.warmup_sums)


def test_branch_advantages_route_each_reward_to_its_branches():
    concerns = torch.tensor([[True, False, True], [False, True, True]])  # video, audio, sync
    w = routed_priors(torch.tensor([1.0, 2.0, 0.5]), concerns)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    assert branch_advantages(adv, w).tolist() == [[1.0 + 1.0, -2.0 + 1.0]]
    with pytest.raises(ValueError, match="at least one branch"):
        routed_priors(torch.ones(3), torch.tensor([[True, False, False], [True, False, False]]))


def test_influence_weights_and_layer_scales_from_a_known_attention_pattern():
    # one head; video queries attend to two audio tokens with values e1·2 and e2·2
    probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])  # [B=1, N_video=2, N_audio=2]
    values = torch.tensor([[[2.0, 0.0], [0.0, 2.0]]])
    output = probs @ values  # [[2, 0], [1, 1]]
    residual = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    u = response_ratio(output, residual)
    assert u.tolist()[0] == pytest.approx([2.0, math.sqrt(2.0)])
    w = token_weights(u, alpha=1.0)
    mean = (2.0 + math.sqrt(2.0)) / 2
    assert w.tolist()[0] == pytest.approx([2.0 / mean, math.sqrt(2.0) / mean])
    assert torch.equal(token_weights(u, alpha=0.0), torch.ones(1, 2))
    scales = layer_gradient_scales(torch.tensor([1.0, 2.0, 3.0, 10.0]), low=0.25, high=2.0)
    assert scales.tolist() == pytest.approx([0.25, 0.5, 0.75, 2.0])  # mean 4: 1/4, 2/4, 3/4, 10/4 → clipped


def test_a_reward_above_its_floor_gains_no_residual_when_floors_gate_it():
    priors = torch.tensor([[0.5, 0.5]])
    conflict = torch.tensor([[[4.0, -1.0], [-1.0, 0.5]]])  # reward 1's cosine is negative (see above)
    free, cos, _ = residual_weights(priors, conflict, torch.zeros(1, 2), active=True)
    assert cos[0, 1] < 0.3 and free[0, 1] > 0.5  # ungated: reward 1 is boosted
    w, _, rho = residual_weights(priors, conflict, torch.zeros(1, 2), active=True, secure=torch.tensor([False, True]))
    assert torch.equal(rho, torch.zeros(1, 2)) and torch.allclose(w, priors)  # above its floor: no boost
    # a residual it already has can only decay: the step is min(0, strength·(threshold − cos))
    _, cos, rho = residual_weights(priors, torch.ones(1, 2, 2), torch.tensor([[0.0, 2.0]]), active=True,
                                   secure=torch.tensor([True, True]))
    assert rho[0, 1] == pytest.approx(2.0 + 0.3 - float(cos[0, 1]), abs=1e-6) and rho[0, 1] < 2.0

    # through the router: only with floor_gates_residual, and only after warm-up
    def run(gates: bool) -> torch.Tensor:
        router = RewardRouter(torch.ones(2), torch.tensor([[True, True]]), warmup=1, strength=1.0, threshold=0.3,
                              max_residual=4.0, gram_decay=0.0, floor_strength=1.0, floor_gates_residual=gates)
        for epoch, means in ((1, [0.5, 0.5]), (2, [0.5, 0.6])):  # reward 1 rises above its floor 0.5
            router.observe(conflict)
            router.observe_rewards(torch.tensor(means), torch.full((2,), 0.1), torch.full((2,), 10.0))
            router.end_epoch(epoch)
        return router.residual

    assert run(False)[0, 1] > 0 and run(True)[0, 1] == 0


def test_floor_gate_switches_off_the_rewards_that_compete_with_a_reward_below_its_floor():
    # rewards (video quality, text-video, sync) on one branch; text-video opposes sync, quality agrees
    gram = torch.tensor([[[1.0, 0.2, 0.3], [0.2, 1.0, -0.5], [0.3, -0.5, 1.0]]])
    priors = torch.tensor([[1.0, 0.5, 2.0]])
    weights = torch.tensor([[0.6, 0.4, 2.5]])  # the priors with sync boosted by its residual and floor, mass 3.5
    # sync violated: G·w_V ∝ column sync = (0.3, −0.5, 1.0): text-video is switched off, the rest train on
    # their priors, unboosted and not rescaled (a step on the constraint at its own weight)
    sync = torch.tensor([False, False, True])
    assert torch.equal(floor_gate(weights, priors, gram, sync, "conflicts"), torch.tensor([[1.0, 0.0, 2.0]]))
    assert torch.equal(floor_gate(weights, priors, gram, sync, "all"), torch.tensor([[0.0, 0.0, 2.0]]))  # CRPO's switch
    # nothing violated, or the violated reward not on this branch: W unchanged
    for mode in ("all", "conflicts"):
        assert torch.equal(floor_gate(weights, priors, gram, torch.zeros(3, dtype=torch.bool), mode), weights)
        unrouted = torch.tensor([[1.0, 1.0, 0.0]])
        assert torch.equal(floor_gate(unrouted, unrouted, gram, sync, mode), unrouted)
    # two branches, sync only on the second: the first keeps W, the second is gated
    two = torch.tensor([[0.7, 0.3, 0.0], [0.6, 0.4, 2.5]])
    two_priors = torch.tensor([[1.0, 0.5, 0.0], [1.0, 0.5, 2.0]])
    assert torch.equal(floor_gate(two, two_priors, gram.expand(2, 3, 3), sync, "all"),
                       torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.0, 2.0]]))
    # two violated rewards (text-video, sync): only quality can be switched off, and its pull, their weighted
    # sum 0.2·0.4 + 0.3·2.5 > 0, keeps it: the gated row is the priors
    assert torch.equal(floor_gate(weights, priors, gram, torch.tensor([False, True, True]), "conflicts"), priors)
    with pytest.raises(ValueError, match="all or conflicts"):
        floor_gate(weights, priors, gram, sync, "some")


def test_router_gates_conflicts_while_the_floor_multiplier_is_positive():
    gram = torch.tensor([[[1.0, -0.5], [-0.5, 1.0]]])  # (text-video, sync) oppose each other: PSD

    def router_weights(gate: str, means) -> torch.Tensor:
        router = RewardRouter(torch.ones(2), torch.tensor([[True, True]]), warmup=1, strength=0.0, threshold=0.3,
                              max_residual=4.0, gram_decay=0.0, floor_strength=1.0, floor_gate=gate)
        for epoch, m in enumerate(means, 1):  # epoch 1 is warm-up: floors (0.5, 0.5)
            router.observe(gram)
            router.observe_rewards(torch.tensor(m), torch.full((2,), 0.1), torch.full((2,), 10.0))
            router.end_epoch(epoch)
        return router.weights

    fell = [[0.5, 0.5], [0.6, 0.45]]  # sync falls below its floor: λ_sync = 0.5
    assert torch.allclose(router_weights("none", fell), torch.tensor([[0.8, 1.2]]))  # soft: W ∝ 1 : 1.5, mass 2
    assert torch.equal(router_weights("conflicts", fell), torch.tensor([[0.0, 1.0]]))  # gated: sync alone, at its prior
    # back above its floor: λ = 0.5 − 1·(0.6 − 0.5)/0.1 < 0 → 0, the priors return
    assert torch.allclose(router_weights("conflicts", fell + [[0.6, 0.6]]), torch.ones(1, 2))


def test_a_gate_that_holds_every_branch_skips_the_gram_and_an_unmeasured_epoch_keeps_it():
    # rewards (video quality, audio quality, sync); sync concerns both branches and opposes video quality
    gram = torch.tensor([[1.0, 0.0, -0.5], [0.0, 1.0, 0.0], [-0.5, 0.0, 1.0]]).expand(2, 3, 3).clone()
    both = torch.tensor([[True, False, True], [False, True, True]])

    def router(gate: str, concerns=both) -> RewardRouter:
        return RewardRouter(torch.ones(3), concerns, warmup=1, strength=1.0, threshold=0.3, max_residual=4.0,
                            gram_decay=0.5, floor_strength=1.0, floor_gate=gate)

    def epoch(r: RewardRouter, n: int, sync: float, measure: bool = True) -> None:
        if measure:
            r.observe(gram)
        r.observe_rewards(torch.tensor([0.6, 0.6, sync]), torch.full((3,), 0.1), torch.full((3,), 10.0))
        r.end_epoch(n)

    r = router("all")
    epoch(r, 1, 0.5)  # warm-up: sync's floor 0.5
    assert r.needs_gram
    epoch(r, 2, 0.45)  # sync below its floor, λ = 0.5: both branches train sync alone, whatever the Gram
    assert torch.equal(r.weights, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])) and not r.needs_gram
    kept_gram, kept_residual = r.gram.clone(), r.residual.clone()
    epoch(r, 3, 0.45, measure=False)
    assert torch.equal(r.gram, kept_gram) and torch.equal(r.residual, kept_residual)
    assert torch.equal(r.weights, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))
    epoch(r, 4, 0.7, measure=False)  # back above: λ = 1 − 1·(0.7 − 0.5)/0.1 < 0 → 0, the gate opens
    assert r.needs_gram and torch.equal(r.gram, kept_gram)
    # a measured epoch folds the Gram into the average again: the residual steps on it
    epoch(r, 5, 0.7)
    assert torch.allclose(r.gram, kept_gram) and not torch.equal(r.residual, kept_residual)

    # gates that leave a branch on its residuals, and no gate, keep measuring
    video_sync = torch.tensor([[True, False, True], [False, True, False]])
    for r in (router("all", video_sync), router("conflicts"), router("none")):
        epoch(r, 1, 0.5)
        epoch(r, 2, 0.45)
        assert r.floor_multiplier[2] > 0 and r.needs_gram


def test_the_benchmark_calls_a_component_below_baseline_only_below_two_standard_errors():
    from script_module import load_script

    bench = load_script("benchmark_av_routing")
    first = dict.fromkeys(bench.COMPONENTS, 0.5)
    last = {**first, "sync": 0.48, "sync_change": -0.02, "sync_change_se": 0.011,  # 1.8 SE: not below
            "text_video": 0.47, "text_video_change": -0.03, "text_video_change_se": 0.014,  # 2.1 SE: below
            "video_quality": 0.49}  # no paired change recorded: the point comparison decides
    assert bench.ended_below(last, first) == ["video_quality", "text_video"]
    assert "| -0.020 ± 0.011 |" in bench.table({"fixed": {"epochs": 1, "points": [first, last]}})
