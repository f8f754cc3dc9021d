"""GDRO: group-level direct reward optimization, fully offline (``../shared/METHODS.md`` §3).

A reference model generates each prompt's group of k samples once and each is scored; training
then never samples. Per sample, the implicit reward compares the policy's and the reference's
flow-matching errors on the same noised copy x_t = (1 − t)·x0 + t·ε:

    s_θ(x) = −β·(‖v − v_θ(x_t)‖² − ‖v − v_ref(x_t)‖²),   v = ε − x0   (mean over elements, over draws)

The target is q = softmax(r / τ) over the group; the loss is the Plackett–Luce cross-entropy over
the group sorted by reward (best first), each stage's target renormalised over the items left:

    L = Σ_{i=1}^{k−1} [ log Σ_{m≥i} exp s_m − Σ_{j≥i} q_i(j)·s_j ],   q_i(j) = q_j / Σ_{m≥i} q_m

plus γ·(flow-matching loss of the top-1 sample), without which the model drifts (γ = 0 collapses).
At k = 2 and τ → 0 this is the Diffusion-DPO loss −log σ(s_w − s_l).

Decision (the paper leaves it open): t and ε are shared by the k samples of a group, so the
implicit rewards of a group differ by the samples, not by the noise draw (lower variance).
"""

from __future__ import annotations

import torch
from flowalign.domains import Annotated, above, at_least


def implicit_rewards(mse_theta: torch.Tensor, mse_ref: torch.Tensor, beta: float) -> torch.Tensor:
    """s = −β·(mse_θ − mse_ref). mse_theta, mse_ref: [G, k] flow-matching errors → [G, k]."""
    return -beta * (mse_theta - mse_ref.detach())


def plackett_luce_loss(scores: torch.Tensor, rewards: torch.Tensor, tau: float) -> torch.Tensor:
    """Plackett–Luce cross-entropy of ``scores`` toward softmax(rewards / τ), per group.

    scores, rewards: [G, k]. The group is ordered by reward (best first); stage i compares the
    remaining items m ≥ i. Returns [G].
    """
    order = rewards.argsort(dim=1, descending=True)
    s = scores.gather(1, order)
    q = torch.softmax(rewards.gather(1, order).float() / tau, dim=1)
    k = s.shape[1]
    loss = torch.zeros(s.shape[0], device=s.device, dtype=s.dtype)
    for i in range(k - 1):
        rest_s, rest_q = s[:, i:], q[:, i:]
        q_i = rest_q / rest_q.sum(1, keepdim=True).clamp(min=1e-30)
        loss = loss + torch.logsumexp(rest_s, dim=1) - (q_i * rest_s).sum(1)
    return loss


def gdro_loss(
    mse_theta: torch.Tensor,
    mse_ref: torch.Tensor,
    rewards: torch.Tensor,
    *,
    beta: float,
    tau: float,
    gamma: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GDRO loss of a batch of groups.

    mse_theta (with grad), mse_ref: [G, k] flow-matching errors of each sample under the policy
    and the reference (same t, ε); rewards: [G, k]. Returns (loss scalar = mean over groups of
    PL loss + γ·mse_θ of the group's best sample, stats).
    """
    scores = implicit_rewards(mse_theta, mse_ref, beta)
    pl = plackett_luce_loss(scores, rewards, tau)
    top = mse_theta.gather(1, rewards.argmax(dim=1, keepdim=True)).squeeze(1)
    loss = (pl + gamma * top).mean()
    with torch.no_grad():
        stats = {"policy_loss": pl.mean(), "gdro_top_fm": top.mean(),
                 "gdro_score_gap": (scores.gather(1, rewards.argmax(1, keepdim=True))
                                    - scores.gather(1, rewards.argmin(1, keepdim=True))).mean()}
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.objectives.base import flow_matching_error, register, whole_groups_rule  # noqa: E402
from flowalign.objectives.forward_process import ForwardProcessObjective, NoisingOptions  # noqa: E402


@dataclass
class GDROOptions:
    """``train.*`` options of method gdro: implicit-reward scale, target temperature, weight of the
    flow-matching loss on each group's best sample."""

    gdro_beta: Annotated[float, above(0)] = 6.0
    gdro_tau: Annotated[float, above(0)] = 0.05
    gdro_gamma: Annotated[float, at_least(0)] = 0.5


@register
class GDRO(ForwardProcessObjective):
    """GDRO, fully offline: trains on the groups ``flowalign generate-groups`` wrote
    (``data.offline_groups``), ``train.noise_draws`` noising draws per group and minibatch (one
    loss term each), shared by a group's samples; a minibatch holds whole groups."""

    name = "gdro"
    rollout = "offline"
    predictions = ("velocity",)
    options = (NoisingOptions, GDROOptions)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.unit = self.config.train.group_size

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        return super().validate(config) + [whole_groups_rule(config, "gdro"),
                                           ("train.gdro_tau", config.train.gdro_tau > 0, "must be > 0")]

    def loss(self, mb, j):
        """GDRO on one noising draw shared by each group: the minibatch's samples are whole groups
        in order. A group with a dropped (NaN) reward is left out."""
        ctx, t, cond = self.ctx, self.config.train, mb.traj.cond
        x0, x_t, _, timestep, eps = self.noised(mb, j)
        mse_ref = flow_matching_error(ctx.predict(x_t, timestep, cond, policy="ref"), eps - x0)
        v_theta = ctx.predict(x_t, timestep, cond)
        mse_theta = flow_matching_error(v_theta, eps - x0)
        k = t.group_size
        rewards = mb.rewards.view(-1, k)
        keep = torch.isfinite(rewards).all(dim=1)
        if not keep.any():  # nothing to compare; a zero loss that still touches every weight
            return (v_theta * 0).sum(), {"policy_loss": torch.zeros(())}
        return gdro_loss(mse_theta.view(-1, k)[keep], mse_ref.view(-1, k)[keep], rewards[keep], beta=t.gdro_beta,
                         tau=t.gdro_tau, gamma=t.gdro_gamma)
