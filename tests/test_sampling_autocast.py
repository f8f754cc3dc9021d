"""``sampling.autocast``: the sampling policy's forward passes at a lower precision on a merged LoRA.

``merged_lora`` is the same function as the unmerged LoRA up to float rounding and gives the base
weights back exactly; rollouts keep float32 latents, run their steps without a trained log-prob in bf16
and keep the first ratio at 1; the update's forwards (DiffusionNFT's v_old included) and the
evaluation do not change; settings with nothing to act on are refused."""

from __future__ import annotations

import pytest
import torch

from flowalign.ema import EMA
from flowalign.errors import ConfigError
from flowalign.rollout import native_bf16, resolved_autocast, rollout, sampling_precision
from flowalign.samplers.steps import plan_steps
from flowalign.trainer import Trainer
from tests.helpers import tiny_config

NFT = ("method=diffusion_nft", "sampling.eta=0.0", "train.noise_draws=2")


def _lora_with_weights(adapter, std=0.3, seed=1):
    adapter.add_lora(rank=4)
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std, generator=torch.Generator().manual_seed(seed))
    return [p for p in adapter.model.parameters() if p.requires_grad]


def _inputs(adapter):
    return (adapter.initial_noise(2, torch.Generator().manual_seed(0)), torch.tensor([800.0, 300.0]),
            adapter.encode(["a red circle", "a blue square"]))


def test_a_merged_lora_predicts_as_the_unmerged_one_and_gives_the_base_weights_back_exactly(tiny_adapter):
    a = tiny_adapter
    _lora_with_weights(a)
    x, t, cond = _inputs(a)
    frozen = {n: p.detach().clone() for n, p in a.model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        unmerged = a.predict(x, t, cond, 1.0)
        with a.merged_lora():
            merged = a.predict(x, t, cond, 1.0)
            changed = [n for n, p in a.model.named_parameters() if not p.requires_grad and not torch.equal(p, frozen[n])]
        with a.reference():
            base = a.predict(x, t, cond, 1.0)
        after = a.predict(x, t, cond, 1.0)
    assert changed  # the LoRA really was folded into base weights
    assert (merged - unmerged).abs().max() <= 1e-5 * unmerged.abs().max()
    assert (unmerged - base).abs().max() > 1e-2  # the LoRA changes the prediction: the check above has teeth
    assert all(torch.equal(p, frozen[n]) for n, p in a.model.named_parameters() if not p.requires_grad)
    assert torch.equal(after, unmerged)


def test_an_autocast_rollout_keeps_float32_latents_close_to_the_float32_rollout(tiny_adapter):
    a = tiny_adapter
    _lora_with_weights(a)
    _, _, cond = _inputs(a)
    noise = a.initial_noise(2, torch.Generator().manual_seed(0))
    schedule = a.schedule(4)
    plan = plan_steps(4, 2, 0.0, "all")
    full = rollout(a, cond, noise, schedule, plan)
    low = rollout(a, cond, noise, schedule, plan, precision="bf16")
    with sampling_precision(a, "bf16"):  # the context by itself: every call in it
        assert torch.equal(rollout(a, cond, noise, schedule, plan).latents, low.latents)
    assert low.latents.dtype == torch.float32
    error = (low.samples - full.samples).norm() / full.samples.norm()
    assert 0 < error < 0.05


def test_the_trained_forward_and_the_evaluation_keep_full_precision(tiny_sd3_dir, tmp_path):
    runs = {name: Trainer(tiny_config(tiny_sd3_dir, tmp_path / name, *NFT, *extra, "train.epochs=1"))
            for name, extra in (("fp32", ()), ("bf16", ("sampling.autocast=bf16",)))}
    evals = {name: r.evaluate("before") for name, r in runs.items()}
    assert evals["bf16"] == evals["fp32"]  # the same weights evaluated the same way, to the last digit
    for r in runs.values():
        r.train()
    # the rollouts differ in rounding, so the rewards and the loss differ a little, and training still runs
    assert all(h["train/grad_norm"] > 0 for h in runs["bf16"].history)
    a = runs["bf16"].adapter
    x, t, cond = _inputs(a)
    ctx = runs["bf16"].objective.ctx
    out = ctx.predict(x, t, cond)
    assert out.dtype == torch.float32 and out.requires_grad
    with torch.no_grad():  # v_old too: in bf16 it moved each DiffusionNFT term's gradient by 8-18 %
        assert ctx.predict(x, t, cond, policy="old", weights=EMA(runs["bf16"].params, 0.0)).dtype == torch.float32


@pytest.mark.parametrize("overrides, says", [
    (("method=gdro", "data.offline_groups=nowhere"), "sampling.autocast must be none for gdro"),
    (("method=branch_grpo",), "sampling.autocast must be none for branch_grpo"),
    ((*NFT, "train.mixed_precision=bf16"), "sampling.autocast must be none under train.mixed_precision bf16"),
])
def test_autocast_is_refused_where_it_has_nothing_to_act_on_before_any_model_loads(overrides, says):
    from flowalign.config import load_config

    with pytest.raises(ConfigError, match=says):
        load_config(None, ["model.path=/nonexistent", *overrides, "sampling.autocast=bf16"])
    with pytest.raises(ConfigError, match="sampling.autocast must be one of"):
        load_config(None, ["model.path=/nonexistent", *NFT, "sampling.autocast=fp8"])
    for method in ("diffusion_nft", "flow_grpo", "ddpo"):  # ODE rollouts, and SDE / DDIM ones
        load_config(None, ["model.path=/nonexistent", f"method={method}", "sampling.autocast=bf16"])


def test_a_flow_grpo_rollout_samples_its_deterministic_steps_low_and_rescores_its_trained_ones_at_ratio_one(
        tiny_sd3_dir, tmp_path):
    """A Flow-GRPO-Fast window: 2 SDE steps inside 4, the others ODE. Under autocast the ODE steps run in
    bf16; the window's log-probs are sampled at full precision, so the first update's ratio is exactly 1."""
    fast = ("method=flow_grpo", "sampling.eta=0.8", "sampling.step_mode=window", "sampling.window_size=2",
            "sampling.window_start=1", "train.train_batch_size=8")
    runs = {name: Trainer(tiny_config(tiny_sd3_dir, tmp_path / name, *fast, *extra, "train.epochs=1"))
            for name, extra in (("fp32", ()), ("bf16", ("sampling.autocast=bf16",)))}
    for r in runs.values():
        r.train()
    low, full = (runs[n].history[0] for n in ("bf16", "fp32"))
    for first in (low, full):  # one minibatch: all on-policy
        assert first["train/ratio"] == pytest.approx(1.0, abs=1e-6)
        assert first["train/approx_kl"] < 1e-12 and first["train/clipfrac"] == 0.0
    assert low["train/grad_norm"] != full["train/grad_norm"]  # the ODE steps did run in bf16


def test_a_stochastic_step_sampled_in_bf16_would_not_rescore_to_its_log_prob(tiny_adapter):
    """Why a trained step stays at full precision: rescored in float32, its log-prob is the sampled
    one only if it was sampled in float32 (the teeth of the ratio check above)."""
    from flowalign.rollout import transition

    a = tiny_adapter
    _lora_with_weights(a)
    _, _, cond = _inputs(a)
    noise, schedule = a.initial_noise(2, torch.Generator().manual_seed(0)), a.schedule(4)
    plan = plan_steps(4, 2, 0.8, "window", window_size=1, window_start=1)
    rescored = {}
    for low_stochastic in (False, True):
        traj = rollout(a, cond, noise, schedule, plan, generator=torch.Generator().manual_seed(0), precision="bf16",
                       low_precision_stochastic=low_stochastic)
        with torch.no_grad():
            again = transition(a, traj.latents[:, 1], 1, schedule, 0.8, cond, 1.0, prev_sample=traj.latents[:, 2])
        rescored[low_stochastic] = (again.log_prob - traj.log_probs[:, 1]).abs().max()
    assert rescored[False] == 0
    assert rescored[True] > 0  # the bf16 step moves it (≈ 5e-5 on the tiny model: rounding, not noise)


def test_rollout_steps_switch_precision_and_give_the_weights_back_even_when_a_step_fails(tiny_adapter):
    a = tiny_adapter
    _lora_with_weights(a)
    _, _, cond = _inputs(a)
    noise = a.initial_noise(2, torch.Generator().manual_seed(0))
    frozen = [p.detach().clone() for p in a.model.parameters() if not p.requires_grad]
    dtypes, predict = [], a.predict

    def spy(*args, **kwargs):
        out = predict(*args, **kwargs)
        dtypes.append(out.dtype)
        if len(dtypes) == 4:
            raise RuntimeError("a step fails")
        return out

    a.predict = spy
    plan = plan_steps(4, 2, 0.7, "window", window_size=1, window_start=1)  # step 1 stochastic, the rest ODE
    with pytest.raises(RuntimeError, match="a step fails"):
        rollout(a, cond, noise, a.schedule(4), plan, generator=torch.Generator().manual_seed(0), precision="bf16")
    assert dtypes == [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    assert all(torch.equal(p, f) for p, f in zip((p for p in a.model.parameters() if not p.requires_grad), frozen))


def test_masked_unmasking_has_no_step_to_autocast_and_is_refused_once_the_family_is_known():
    from flowalign.config import load_config
    from flowalign.rollout import autocast_applies
    from flowalign.objectives.base import OBJECTIVES

    config = load_config(None, ["model.path=/nonexistent", "method=ddpo", "sampling.autocast=bf16"])
    applies = {cls.__name__: autocast_applies(cls, config) for cls in OBJECTIVES["ddpo"]}
    assert applies == {"DDPO": True, "MaskedDDPO": False}  # preflight.check_loaded_adapter refuses the second


def test_auto_is_bf16_exactly_where_the_device_multiplies_bf16_natively(monkeypatch):
    assert resolved_autocast("bf16", "cpu") == "bf16" and resolved_autocast("none", "cpu") == "none"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert native_bf16("cpu") and resolved_autocast("auto", "cpu") == "bf16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not native_bf16("cpu") and resolved_autocast("auto", "cpu") == "none"
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")  # a torch without the probe: no bf16
    assert resolved_autocast("auto", "cpu") == "none"
