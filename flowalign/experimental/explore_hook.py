"""EXPLORENET as a training hook (``explore.mode``; the estimator: ``explorenet.py``).

The hook sets the epoch sampler's per-element SDE std multiplier, takes one step of the
explorer on each epoch's rollouts before the policy update (its on-policy data), checkpoints the
explorer and its optimizer (``explorenet.safetensors``, ``explorenet_optimizer.pt``: apart from
the generator, which never needs them) and writes ``explorenet/`` next to ``final/``.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from safetensors.torch import save_file

from flowalign.errors import ConfigError


def prompt_vector(cond) -> torch.Tensor:
    """[B, P] one vector per prompt: the pooled embedding, else the mean token embedding (the
    Conditioning key convention of ``pipelines.base.Adapter``)."""
    tensors = cond.tensors
    return (tensors["pooled"] if "pooled" in tensors else tensors["embeds"].mean(dim=1)).float()


def rules(config) -> list[tuple[str, bool, str]]:
    from flowalign.objectives.base import OBJECTIVES, methods

    sde = [name for name in methods() if any(c.rollout == "sde" and "velocity" in c.predictions
                                             for c in OBJECTIVES[name])]
    mode = config.explore.mode
    return [("explore.mode", mode == "none" or config.method in sde,
             f"needs a method that trains on SDE log-probabilities ({', '.join(sde)})")]


class _State:
    """A module's or optimizer's state under a checkpoint name."""

    def __init__(self, owner):
        self.owner = owner

    def state_dict(self):
        state = self.owner.state_dict()
        return {k: v.detach().cpu().contiguous() for k, v in state.items()} if isinstance(self.owner, torch.nn.Module) \
            else state

    def load_state_dict(self, state):
        self.owner.load_state_dict(state)


class ExploreHook:
    """EXPLORENET and its optimizer (same initial weights on every process: seeded by the run's
    seed; its gradients are averaged over processes)."""

    def __init__(self, config, ctx, encode, sampler):
        from flowalign.experimental.explorenet import ExploreNet

        e, s = config.explore, config.sampling
        self.config, self.ctx = config, ctx
        if ctx.adapter.prediction != "velocity":
            raise ConfigError("config: explore.mode needs a flow model (its SDE steps); DDIM has no exploration net")
        shape = ctx.adapter.initial_noise(1, torch.Generator().manual_seed(0)).shape
        if len(shape) != 4:
            raise ConfigError(f"config: explore.mode supports image latents [B, C, h, w], this model has {tuple(shape)}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.train.seed + 1)
            self.net = ExploreNet(shape[1], prompt_vector(encode([""])).shape[-1], s.num_steps, e.mode,
                                  e.hidden).to(ctx.dist.device)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=e.learning_rate)
        sampler.noise_scale = self.noise_scale

    def noise_scale(self, cond):
        """The rollout's per-element std multiplier for the prompts of ``cond``."""
        prompts = prompt_vector(cond)
        return lambda x, step: self.net(x, step, prompts)

    def components(self) -> dict:
        return {"explorenet": _State(self.net), "explorenet_optimizer": _State(self.optimizer)}

    def before_update(self, batch) -> dict:
        """One step of EXPLORENET on this epoch's rollouts (estimator: flowalign/experimental/explorenet.py):
        ascend Σ_groups (U_g − mean U of the other groups)·Σ_i Σ_k log q_φ(x'_ik | x_ik)."""
        from flowalign.experimental.explorenet import exploration_log_density, group_spread_advantages

        dist, traj = self.ctx.dist, batch.traj
        acc = dist.accelerator
        weights, stats = group_spread_advantages(dist.gather(batch.rewards), dist.gather(batch.group_ids))
        n = len(batch.specs)
        weights = weights[dist.mine(n)].to(dist.device)
        prompts = prompt_vector(traj.cond)
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        steps = [j for j in range(len(traj.noise_levels)) if traj.noise_levels[j] > 0]
        spreads = []
        for j in steps:
            w = traj.std_scales[:, j] * traj.step_noise[:, j]  # (x' − μ) / isotropic std
            m = self.net(traj.latents[:, j], j, prompts)
            loss = -(weights * exploration_log_density(w, m)).sum() / max(n, 1) / len(steps)
            loss.backward()
            spreads.append(m.detach().flatten(1).std(1).mean().item())
        for p in self.net.parameters():
            if p.grad is not None and acc.num_processes > 1:
                p.grad = acc.reduce(p.grad, "mean")
        self.optimizer.step()
        self.net.eval()
        stats["explore/m_std"] = sum(spreads) / max(len(spreads), 1)  # 0 = isotropic
        return stats

    def write_outputs(self, out) -> None:
        """Kept for inspection; sampling from final/ never needs it (main process)."""
        (out / "explorenet").mkdir(exist_ok=True)
        save_file(_State(self.net).state_dict(), out / "explorenet" / "explorenet.safetensors")
        (out / "explorenet" / "config.json").write_text(json.dumps(dataclasses.asdict(self.config.explore)))
