"""Checks that every adapter family's tests share: the reference policy is the base model,
rescoring a sampled trajectory with the sampling weights gives the on-policy ratio exactly 1, and
a run through the trainer with each flow objective trains."""

from __future__ import annotations

import math

import pytest
import torch

from flowalign.rollout import transition


def reference_predictions(adapter, prompts, steps: int, guidance: float, perturb):
    """(base, trained, reference) predictions at one state: before a LoRA is added, with a LoRA
    that ``perturb(adapter.model)`` makes non-zero, and inside ``adapter.reference()``. Asserts on
    the way that leaving the context restores the trained policy and that a per-sample timestep
    [B] (the trainer's NFT / GDRO calls) is the same function as a scalar one."""
    cond = adapter.encode(prompts)
    x = adapter.initial_noise(len(prompts), torch.Generator().manual_seed(0))
    t = adapter.schedule(steps).timesteps[1]
    with torch.no_grad():
        base = adapter.predict(x, t, cond, guidance)
        adapter.add_lora(rank=4)
        perturb(adapter.model)
        trained = adapter.predict(x, t, cond, guidance)
        with adapter.reference():
            reference = adapter.predict(x, t, cond, guidance)
        assert torch.equal(adapter.predict(x, t, cond, guidance), trained)
        assert torch.equal(adapter.predict(x, t.expand(len(prompts)), cond, guidance), trained)
    return base, trained, reference


def rescored_gradients(adapter, traj, steps: int, guidance: float) -> dict[str, torch.Tensor | None]:
    """Rescore the first ``steps`` transitions of ``traj`` with the trained model, assert each
    ratio exp(log π − log π_old) is exactly 1, backpropagate the last step's log-prob and return
    the trainable parameters' gradients by name (the rescored density must be differentiable)."""
    for j in range(steps):
        out = transition(adapter, traj.latents[:, j], j, traj.schedule, 1.0, traj.cond, guidance,
                         prev_sample=traj.latents[:, j + 1], model=adapter.model)
        ratio = torch.exp(out.log_prob - traj.log_probs[:, j])
        assert torch.equal(ratio, torch.ones_like(ratio)), f"step {j}: {ratio}"
    out.log_prob.sum().backward()
    return {n: p.grad for n, p in adapter.trainable().named_parameters() if p.requires_grad}


# every objective a flow model trains with: Flow-GRPO with each of the three SDE steps, DanceGRPO, DiffusionNFT
FLOW_METHODS = {
    "flow_grpo": ["method=flow_grpo", "sampling.sde=flow_grpo", "train.kl_beta=0.1"],
    "cps": ["method=flow_grpo", "sampling.sde=cps", "train.kl_beta=0.1"],
    "dance_grpo": ["method=dance_grpo", "sampling.sde=dance_grpo"],  # no reference model: KL 0 by definition
    "diffusion_nft": ["method=diffusion_nft", "train.kl_beta=0.1", "train.noise_draws=2"],
}


def _lora_gradient(adapter, x, t, cond, guidance):
    params = [p for p in adapter.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    out = adapter.predict(x, t, cond, guidance)
    out.pow(2).sum().backward()  # a LoRA weight the output does not depend on (a last block's text stream): 0
    return out.detach(), torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])


def assert_detach_uncond_trains_only_the_conditional_branch(adapter, x, t, cond, guidance: float,
                                                            cond_weight: float | None = None,
                                                            conditional=None) -> None:
    """``train.detach_uncond`` on an adapter with a non-zero LoRA: the same prediction, and the
    gradient of Σ out² equals the conditional branch's alone, w·∇cond with w = g (out = uncond +
    g·(cond − uncond); ``cond_weight`` where more guidance terms hold cond), computed from a
    guidance-1 call at the guided output's value; the full gradient, which has (1 − g)·∇uncond in
    it, differs. ``conditional()``: the conditional branch alone (default: a guidance-1 call)."""
    adapter.detach_uncond = False
    both, grad_both = _lora_gradient(adapter, x, t, cond, guidance)
    adapter.detach_uncond = True
    detached, grad_detached = _lora_gradient(adapter, x, t, cond, guidance)
    adapter.detach_uncond = False
    assert torch.allclose(both, detached, rtol=1e-5, atol=1e-6)  # the same prediction: only the gradient differs
    params = [p for p in adapter.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    cond_only = adapter.predict(x, t, cond, 1.0) if conditional is None else conditional()
    w = guidance if cond_weight is None else cond_weight
    (2 * detached * w * cond_only).sum().backward()  # chain rule of Σ out² through out = … + w·cond
    expected = torch.cat([p.grad.flatten() for p in params])
    assert (grad_detached - expected).norm() <= 1e-4 * expected.norm()  # float32 sums in another order
    assert (grad_both - grad_detached).norm() > 1e-3 * grad_both.norm()


def assert_split_uncond_matches_the_detached_batch(adapter, x, t, cond, guidance: float) -> None:
    """``train.detach_uncond`` with gradients on runs CFG's unconditional branch as its own forward
    under no_grad (``DenoiserAdapter.splits_uncond``): the same prediction and the same LoRA gradient
    (float tolerance) as the batched call of both branches with the unconditional half detached
    (Flow-GRPO's train_sd3.py form), and the denoiser records a graph for the conditional rows only."""
    calls = []  # (gradient recorded, rows) of each denoiser call

    def record(module, args, kwargs):
        calls.append((torch.is_grad_enabled(), len(kwargs.get("hidden_states", args[0] if args else None))))

    hook = adapter.model.register_forward_pre_hook(record, with_kwargs=True)
    adapter.detach_uncond = True
    try:
        split, grad_split = _lora_gradient(adapter, x, t, cond, guidance)
        split_calls, calls[:] = list(calls), []
        adapter.splits_uncond = lambda: False  # the batched call, its unconditional half detached afterwards
        batched, grad_batched = _lora_gradient(adapter, x, t, cond, guidance)
    finally:
        hook.remove()
        vars(adapter).pop("splits_uncond", None)
        adapter.detach_uncond = False
    def rows(recorded, grad):
        return sum(n for g, n in recorded if g == grad)

    n = len(x)
    assert (rows(split_calls, True), rows(split_calls, False)) == (n, n)
    assert (rows(calls, True), rows(calls, False)) == (2 * n, 0)
    assert (split - batched).abs().max() <= 1e-5 * batched.abs().max()
    assert (grad_split - grad_batched).norm() <= 1e-4 * grad_batched.norm()
    assert grad_batched.norm() > 0


def train_once(config):
    """(the trainer after ``config``'s run, its trainable parameters before it)."""
    from flowalign.trainer import Trainer

    trainer = Trainer(config)
    initial = [p.detach().clone() for p in trainer.params]
    trainer.train()
    return trainer, initial


def assert_trained(trainer, initial, lora_file: bool = True):
    """The first epoch's loss is finite, a gradient flowed and moved the weights, which stay finite;
    the final LoRA is saved."""
    stats = trainer.history[0]
    assert math.isfinite(stats["train/policy_loss"]) and stats["train/skipped_nonfinite"] == 0
    assert stats["train/grad_norm"] > 0
    assert any((p.detach() - p0).abs().max() > 0 for p, p0 in zip(trainer.params, initial))
    assert all(torch.isfinite(p).all() for p in trainer.params)
    if lora_file:
        assert (trainer.out / "final" / "pytorch_lora_weights.safetensors").is_file()


def assert_on_policy_at_init(stats: dict, method: str) -> None:
    """A fresh LoRA is the identity: the first epoch's policy is the reference (KL 0) and the
    sampler (ratio 1; DiffusionNFT: the old policy is the current one)."""
    assert stats["train/kl"] == 0.0
    if method == "diffusion_nft":
        assert stats["train/old_decay"] == 0.0 and stats["train/nft_positive"] == pytest.approx(
            stats["train/nft_negative"], rel=1e-6)
    else:  # one minibatch, rescored by the weights that sampled it
        assert stats["train/ratio"] == pytest.approx(1.0, abs=1e-6)
        assert stats["train/approx_kl"] < 1e-12 and stats["train/clipfrac"] == 0.0
