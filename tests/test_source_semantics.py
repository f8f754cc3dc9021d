"""What a setting copied from Flow-GRPO, DanceGRPO or ddpo-pytorch means here.

Hand computations of the two KL conventions, the zero-advantage option, CFG's detached
unconditional branch, DanceGRPO's step without its score term and its x̂0, the steps' σ' = 0
error, SD3's LoRA targets; and, per recipe, that every key annotated with a source value
(``key: value  # source_key = value``) carries that value under the source's semantics.
"""

from __future__ import annotations

import glob
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from adapter_checks import (assert_detach_uncond_trains_only_the_conditional_branch,
                            assert_split_uncond_matches_the_detached_batch)

from flowalign.config import ConfigError, load_config
from flowalign.objectives.base import Minibatch
from flowalign.objectives.flow_grpo import FlowGRPO, flow_grpo_loss, kl_std, nonzero_advantage
from flowalign.samplers.flow_sde import (FLOW_SDE_STEPS, cps_step, dance_grpo_euler_step, dance_grpo_sde_step,
                                         flow_grpo_sde_step, ode_step)

ROOT = Path(__file__).resolve().parents[1]


# -- KL: exact vs Flow-GRPO's convention --------------------------------------------------------
def _policy_and_reference_steps(sde_step, sigma=0.8, sigma_next=0.7, eta=0.7):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 2, 2, generator=g), torch.randn(2, 3, 2, 2, generator=g)
    dv = 0.1 * torch.randn(2, 3, 2, 2, generator=g)
    policy = sde_step(v + dv, x, sigma, sigma_next, eta, noise=torch.randn(2, 3, 2, 2, generator=g), sigma_fallback=0.9)
    reference = sde_step(v, x, sigma, sigma_next, eta, prev_sample=policy.prev_sample, sigma_fallback=0.9)
    return policy, reference, dv


def test_kl_conventions_match_a_hand_computation_of_flow_grpo_and_of_the_exact_kl():
    sigma, sigma_next, eta = 0.8, 0.7, 0.7
    policy, reference, dv = _policy_and_reference_steps(flow_grpo_sde_step, sigma, sigma_next, eta)
    # by hand, from the SDE's mean μ = x + v·dt + σ_t²/(2σ)·(x + (1 − σ)·v)·dt: Δμ = Δv·dt·(1 + σ_t²(1 − σ)/(2σ))
    dt = sigma_next - sigma
    sigma_t = eta * math.sqrt(sigma / (1 - sigma))
    dmu = dv * dt * (1 + sigma_t**2 * (1 - sigma) / (2 * sigma))
    assert torch.allclose(policy.mean - reference.mean, dmu, atol=1e-6)
    flow_grpo = ((dmu**2).mean(dim=(1, 2, 3)) / (2 * sigma_t**2)).mean()  # train_sd3.py's kl_loss
    exact = ((dmu**2).mean(dim=(1, 2, 3)) / (2 * sigma_t**2 * abs(dt))).mean()  # KL of the two step Gaussians
    for convention, expected in (("exact", exact), ("flow_grpo", flow_grpo)):
        std = kl_std(policy.std, sigma, sigma_next, convention=convention, sde="flow_grpo")
        loss, stats = flow_grpo_loss(policy.log_prob, policy.log_prob, torch.zeros(2), clip_range=1e-4, beta=0.04,
                                     mean=policy.mean, ref_mean=reference.mean, std=std)
        assert stats["kl"].item() == pytest.approx(expected.item(), rel=1e-5)
        assert loss.item() == pytest.approx(0.04 * expected.item(), rel=1e-5)  # on-policy: the policy term is 0
    assert (exact / flow_grpo).item() == pytest.approx(1 / abs(dt), rel=1e-5)  # ×10 at this step


def test_cps_kl_is_the_same_under_both_conventions():
    policy, _, _ = _policy_and_reference_steps(cps_step)
    for convention in ("exact", "flow_grpo"):
        assert torch.equal(kl_std(policy.std, 0.8, 0.7, convention=convention, sde="cps"), policy.std)


@pytest.mark.parametrize("overrides, key", [
    (["sampling.sde=dance_grpo", "train.kl_convention=flow_grpo", "train.kl_beta=0.01"], "train.kl_convention"),
    (["method=grpo_guard", "train.kl_convention=flow_grpo"], "train.kl_convention"),
    (["train.kl_convention=approx"], "train.kl_convention"),
    (["train.zero_advantage=ignore"], "train.zero_advantage"),
])
def test_conventions_the_step_does_not_define_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, ["method=flow_grpo", *overrides])


# -- zero-advantage samples -------------------------------------------------------------------------
def test_dropping_zero_advantages_averages_over_the_samples_with_spread():
    adv = torch.tensor([1.0, 0.0, -0.5, 1e-8])  # 1e-8: a no-spread group's mean rounded by an ulp
    assert nonzero_advantage(adv).tolist() == [True, False, True, False]
    assert nonzero_advantage(torch.tensor([[0.0, 0.3], [0.0, 0.0]])).tolist() == [True, False]  # per reward
    logp = torch.tensor([0.02, 0.01, -0.03, 0.05], requires_grad=True)
    old = torch.zeros(4)
    keep, _ = flow_grpo_loss(logp, old, adv, clip_range=1.0)
    drop, _ = flow_grpo_loss(logp, old, adv, clip_range=1.0, weight=nonzero_advantage(adv))
    by_hand = -(1.0 * math.exp(0.02) - 0.5 * math.exp(-0.03)) / 2  # mean of −A·ratio over the two kept samples
    assert drop.item() == pytest.approx(by_hand, rel=1e-6)
    assert drop.item() == pytest.approx(keep.item() * 4 / 2, rel=1e-6)


@pytest.mark.parametrize("mode, expected", [("keep", [True, True, False, True]), ("drop", [True, False, False, True])])
def test_the_objective_trains_only_nonzero_advantages_when_asked(mode, expected):
    objective = FlowGRPO.__new__(FlowGRPO)
    objective.config = SimpleNamespace(train=SimpleNamespace(zero_advantage=mode))
    sub = SimpleNamespace(trained=torch.tensor([[True], [True], [False], [True]]))
    valid = torch.ones(4, dtype=torch.bool)
    mb = Minibatch(torch.arange(4), sub, torch.tensor([0.5, 0.0, 1.0, -2.0]), valid, torch.zeros(4))
    weight = objective.trained_weight(mb, 0)
    assert weight.tolist() == expected


# -- CFG in the training forward ----------------------------------------------------------------------
def test_detach_uncond_leaves_only_the_conditional_branchs_gradient(tiny_adapter):
    a = tiny_adapter
    a.add_lora(rank=4)
    with torch.no_grad():
        for name, p in a.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    cond = a.encode(["a red circle", "a blue square"])
    x = a.initial_noise(2, torch.Generator().manual_seed(0))
    assert_detach_uncond_trains_only_the_conditional_branch(a, x, torch.tensor(500.0), cond, 4.5)


def test_detach_uncond_runs_the_unconditional_branch_on_its_own_without_a_graph(tiny_adapter):
    a = tiny_adapter
    a.add_lora(rank=4)
    with torch.no_grad():
        for name, p in a.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    cond = a.encode(["a red circle", "a blue square", "a green triangle"])
    x = a.initial_noise(3, torch.Generator().manual_seed(0))
    assert_split_uncond_matches_the_detached_batch(a, x, torch.tensor([900.0, 500.0, 100.0]), cond, 4.5)


# -- DanceGRPO's step without the score term, x̂0, and σ' = 0 ---------------------------------------
def test_dance_grpo_step_without_score_term_is_euler_plus_noise():
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(2, 4, 3, 3, generator=g) for _ in range(3))
    sigma, sigma_next, eta = 0.6, 0.45, 0.3
    out = dance_grpo_euler_step(v, x, sigma, sigma_next, eta, noise=z)
    mean = x + v * (sigma_next - sigma)
    std = eta * math.sqrt(sigma - sigma_next)
    assert torch.allclose(out.mean, mean, atol=1e-6)
    assert torch.allclose(out.prev_sample, mean + std * z, atol=1e-6)
    by_hand = (-((out.prev_sample - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean((1, 2, 3))
    assert torch.allclose(out.log_prob, by_hand, atol=1e-5)
    with_score = dance_grpo_sde_step(v, x, sigma, sigma_next, eta, noise=z)
    assert (with_score.mean - out.mean).abs().max() > 1e-3  # the score term is what differs
    assert FLOW_SDE_STEPS["dance_grpo_euler"] is dance_grpo_euler_step


@pytest.mark.parametrize("name", sorted(FLOW_SDE_STEPS))
def test_every_step_returns_x0_hat_and_the_last_euler_step_decodes_it(name):
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(2, 4, 3, 3, generator=g) for _ in range(3))
    out = FLOW_SDE_STEPS[name](v, x, 0.6, 0.45, 0.5, noise=z, sigma_fallback=0.9)
    assert torch.allclose(out.pred_x0, x - 0.6 * v, atol=1e-6)


def test_the_last_euler_step_decodes_dance_grpos_x0_hat():
    g = torch.Generator().manual_seed(0)
    x, v = (torch.randn(2, 4, 3, 3, generator=g) for _ in range(2))
    # DanceGRPO decodes the last step's x̂0; our rollouts end with the Euler step to σ' = 0: the same latent
    assert torch.allclose(ode_step(v, x, 0.2, 0.0), dance_grpo_sde_step(v, x, 0.2, 0.1, 0.3, noise=x).pred_x0,
                          atol=1e-6)


def test_cps_refuses_sigma_next_zero_clearly():
    x = torch.randn(2, 4, 3, 3)
    with pytest.raises(ValueError, match="needs σ' > 0"):  # its std σ'·sin(ηπ/2) is 0 there
        cps_step(x, x, 0.2, 0.0, 0.7, noise=torch.randn_like(x))


@pytest.mark.parametrize("name, mean, std", [
    # Flow-GRPO's sde_step_with_logprob at σ = 0.2 → 0, η = 0.7, x = 1, v = 0.5: σ_t = 0.7·sqrt(0.2/0.8) = 0.35,
    # μ = x + v·dt + σ_t²/(2σ)·(x + (1 − σ)·v)·dt = 0.9 + 0.30625·1.4·(−0.2) = 0.81425, std = σ_t·sqrt(0.2)
    ("flow_grpo", 0.81425, 0.35 * math.sqrt(0.2)),
    # DanceGRPO's flux_step: x̂0 = 0.9, score = −(x − 0.8·x̂0)/σ² = −7, μ = 0.9 − ½·0.49·(−7)·(−0.2) = 0.557,
    # std = η·sqrt(σ); without the score term (sde_solver=False) μ = 0.9
    ("dance_grpo", 0.557, 0.7 * math.sqrt(0.2)),
    ("dance_grpo_euler", 0.9, 0.7 * math.sqrt(0.2)),
])
def test_flow_grpo_and_dance_grpo_steps_at_sigma_next_zero_are_their_sources(name, mean, std):
    x, v, z = torch.ones(1, 3), torch.full((1, 3), 0.5), torch.tensor([[0.3, -1.0, 2.0]])
    out = FLOW_SDE_STEPS[name](v, x, 0.2, 0.0, 0.7, noise=z, sigma_fallback=0.9, reduction="sum")
    assert out.mean.flatten().tolist() == pytest.approx([mean] * 3, rel=1e-6)
    assert float(out.std.flatten()[0]) == pytest.approx(std, rel=1e-6)
    assert out.prev_sample.flatten().tolist() == pytest.approx((mean + std * z.flatten()).tolist(), rel=1e-6)
    by_hand = float((-(z**2) / 2).sum()) - 3 * (math.log(std) + 0.5 * math.log(2 * math.pi))
    assert out.log_prob.item() == pytest.approx(by_hand, rel=1e-5)  # float32 sums


def test_log_probs_stay_finite_at_the_smallest_positive_step():
    x, z = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    out = cps_step(x, x, 0.02, 0.01, 0.7, noise=z)
    assert torch.isfinite(out.log_prob).all()
    std = 0.01 * math.sin(0.7 * math.pi / 2)  # CPS: σ'·sin(ηπ/2), by hand; x' − μ = std·z
    by_hand = (-(z**2) / 2).mean() - math.log(std) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.item() == pytest.approx(by_hand.item(), rel=1e-5)


# -- LoRA targets ---------------------------------------------------------------------------------------
FLOW_GRPO_SD3_TARGETS = {"attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                         "attn.to_out.0", "attn.to_q", "attn.to_v"}  # train_sd3.py's target_modules


def test_sd3_default_lora_targets_are_flow_grpos_and_skip_the_second_attention():
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    from pipelines.sd3 import SD3Adapter

    assert set(SD3Adapter.lora_targets) == FLOW_GRPO_SD3_TARGETS
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8,
                                  dual_attention_layers=(0,))  # SD3.5's dual-attention block: attn and attn2
    assert any(".attn2." in name for name, _ in model.named_modules())
    model.add_adapter(LoraConfig(r=2, target_modules=list(SD3Adapter.lora_targets)))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted and not any(".attn2." in n for n in adapted)
    assert {n.split(".", 2)[2] for n in adapted if n.startswith("transformer_blocks.0.")} == FLOW_GRPO_SD3_TARGETS


# -- recipes: every source-annotated key means what it meant in its source ----------------------------
# which codebase each recipe translates (its header cites the files), and what that codebase does
SOURCES = {
    "sd35m_flow_grpo_geneval": "flow_grpo/train_sd3.py",
    "sd35m_flow_grpo_ocr": "flow_grpo/train_sd3.py",
    "sd35m_flow_grpo_pickscore": "flow_grpo/train_sd3.py",
    "sd35m_gardo_ocr": "flow_grpo/train_sd3.py",  # scripts/train_sd3_gardo.py: train_sd3.py's loop with GARDO's terms
    "wan21_t2v_flow_grpo_temporal": "flow_grpo/later",
    "wan21_i2v_flow_grpo_temporal": "flow_grpo/later",
    "wan22_ti2v_i2v_flow_grpo_temporal": "flow_grpo/later",
    "wan22_a14b_t2v_flow_grpo_temporal": "flow_grpo/later",
    "flux2_klein_flow_grpo_pickscore": "flow_grpo/later",
    "flux_kontext_flow_grpo_counting_edit": "flow_grpo/later",
    "qwen_image_flow_grpo_pickscore": "flow_grpo/later",
    "qwen_image_edit_flow_grpo_counting_edit": "flow_grpo/later",
    "qwen_image_edit_plus_flow_grpo_counting_edit": "flow_grpo/later",
    "z_image_turbo_flow_grpo_fast_pickscore": "flow_grpo/later",
    "sd15_ddpo_aesthetic": "ddpo-pytorch",
    "sd15_ddpo_compressibility": "ddpo-pytorch",
    "flux_dev_dance_grpo_hps": "DanceGRPO",
    "flux_dev_branch_grpo_hps": "BranchGRPO",
    "sd35m_online_dpo_pickscore": "Flow-Factory",  # examples/dpo/lora/sd3_5/default.yaml
}
SOURCE_SEMANTICS = {  # what the source does where our options name a choice
    "flow_grpo/train_sd3.py": {"train.zero_advantage": "drop", "train.detach_uncond": True},
    "flow_grpo/later": {"train.zero_advantage": "drop", "train.detach_uncond": False},
    "ddpo-pytorch": {"train.zero_advantage": "keep", "train.detach_uncond": False},
    "DanceGRPO": {"train.zero_advantage": "keep", "sampling.sde": "dance_grpo"},  # flux_step(sde_solver=True)
    # flux_step_with_split(sde_solver=True); --init_same_noise; the script's node rewards (no --tree_prob_weighted)
    "Flow-Factory": {},  # online DPO: ODE rollouts, no choice of these options applies
    "BranchGRPO": {"sampling.sde": "dance_grpo", "sampling.shared_group_noise": True, "train.branch_node_reward": "mean"},
}
# annotated keys whose value is the source's converted on purpose; each recipe's comment says how
CONVERTED = {
    "train.epochs": "the sources' num_epochs = 100000 means 'stopped manually': the recipe picks a budget",
    "sampling.step_mode": "timestep_fraction / sde_window_size become the step mode that trains the same steps",
    "train.sample_batch_size": "9 per GPU does not divide the per-process samples; 8 does",
    "eval.num_steps": "Z-Image-Turbo evaluates with its own 9 steps, not SD3.5's 40",
}
NUMBER = re.compile(r"=\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
RECIPES = sorted(Path(p).stem for p in glob.glob(str(ROOT / "configs" / "*.yaml")))


def source_annotations(path: Path):
    """(dotted key, value text, comment) of every line ``key: value  # … = number …`` of a recipe."""
    stack: list[tuple[int, str]] = []
    for line in path.read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z_0-9]+):\s*([^#]*?)\s*(?:#\s*(.*))?$", line)
        if not m:
            continue
        indent, key, value, comment = len(m[1]), m[2], m[3], m[4]
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, key)]
        if comment and value and NUMBER.search(comment):
            yield ".".join(k for _, k in stack), value, comment


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = config[part] if isinstance(config, dict) else getattr(config, part)
    return config


def test_every_recipe_that_cites_a_source_names_which():
    citing = [r for r in RECIPES if any(source_annotations(ROOT / "configs" / f"{r}.yaml"))]
    assert citing and set(citing) <= set(SOURCES), sorted(set(citing) - set(SOURCES))


@pytest.mark.parametrize("recipe", sorted(SOURCES))
def test_recipe_keys_carry_their_sources_values_under_the_sources_semantics(recipe):
    path = ROOT / "configs" / f"{recipe}.yaml"
    config = load_config(str(path))
    source = SOURCES[recipe]
    for key, _, comment in source_annotations(path):
        cited = float(NUMBER.search(comment)[1])
        ours = _get(config, key)
        if key in CONVERTED:
            continue
        assert float(ours) == cited, f"{recipe}: {key} is {ours}, its comment cites {cited} ({comment})"
        if key == "train.kl_beta" and cited > 0 and source.startswith("flow_grpo"):
            assert config.train.kl_convention == "flow_grpo", f"{recipe}: Flow-GRPO's β needs kl_convention flow_grpo"
        if key == "sampling.eta" and source.startswith("flow_grpo"):  # sample.noise_level of its "sde" / "cps" step
            assert config.sampling.sde in ("flow_grpo", "cps"), f"{recipe}: noise_level is η of Flow-GRPO's steps"
        if key == "model.lora_rank" and "lora_alpha=" in comment:  # LoraConfig(r=…, lora_alpha=…)
            alpha = float(re.search(r"lora_alpha=(\d+)", comment)[1])
            assert config.model.lora_alpha == alpha, f"{recipe}: lora_alpha {config.model.lora_alpha}, source {alpha}"
    for key, value in SOURCE_SEMANTICS[source].items():
        assert _get(config, key) == value, f"{recipe}: {key} is {_get(config, key)!r}; {source} means {value!r}"
    if source == "flow_grpo/train_sd3.py":
        from pipelines.sd3 import SD3Adapter

        targets = config.model.lora_targets or SD3Adapter.lora_targets
        assert set(targets) == FLOW_GRPO_SD3_TARGETS


def test_the_trainer_divides_the_kl_by_the_chosen_convention(tiny_sd3_dir, tmp_path):
    from flowalign.trainer import Trainer
    from helpers import tiny_config

    runs = {}
    for convention in ("exact", "flow_grpo"):
        trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / convention, "train.kl_beta=0.1",
                                      f"train.kl_convention={convention}"))
        trainer.train()
        runs[convention] = trainer
    exact, flow_grpo = (runs[c].history[1] for c in ("exact", "flow_grpo"))
    # epoch 1 starts at the identity LoRA (KL 0 and zero KL gradient), so both runs reach epoch 2 with the same
    # weights: the same policy loss, and a KL smaller by the trained steps' |dt| (here every |dt| is in (0, 1))
    assert exact["train/policy_loss"] == flow_grpo["train/policy_loss"]
    assert exact["train/kl"] > 0
    sigmas = runs["exact"].adapter.schedule(4).sigmas
    dts = (sigmas[:-2] - sigmas[1:-1]).abs()  # the trained steps: all but the last
    ratio = flow_grpo["train/kl"] / exact["train/kl"]
    assert float(dts.min()) - 1e-6 <= ratio <= float(dts.max()) + 1e-6, (ratio, dts)
