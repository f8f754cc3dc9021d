"""Checks that every adapter family's tests share: the reference policy is the base model, and
rescoring a sampled trajectory with the sampling weights gives the on-policy ratio exactly 1."""

from __future__ import annotations

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
