"""Online Diffusion-DPO (Wallace et al., arXiv 2311.12908) on pairs built inside each group of ODE rollouts.

Diffusion-DPO maximises the Bradley–Terry likelihood that a preferred sample x_w beats a
dispreferred x_l, with the diffusion ELBO in place of the intractable log-likelihood: the implicit
reward of a sample is the improvement of the policy's denoising error over the reference's at the
same noisy point. Online, the pairs come from the policy's own rollouts: each prompt's group of k
(ODE solver: no log-probabilities) is scored, and its best and worst samples form one pair. Per
pair, for a noising draw (σ, ε) shared by both samples (``../shared/METHODS.md`` notation):

    x_σ      = (1 − σ)·x0 + σ·ε,   v = ε − x0                          (the flow-matching pair)
    e_θ(x)   = mean‖v_θ(x_σ, σ) − v‖²,   e_ref(x) the same for the reference   (means over elements)
    Δ        = (e_θ(x_w) − e_ref(x_w)) − (e_θ(x_l) − e_ref(x_l))
    L        = mean over pairs of −log σ(−½·β·Δ)

−½·β·(e_θ − e_ref) is each sample's implicit reward. At the reference (policy = reference) Δ = 0
and L = log 2; the gradient lowers e_θ(x_w) and raises e_θ(x_l), each by β/2·σ(½βΔ). ``dpo_loss``
implements L; ``best_and_worst`` builds the pairs.

No equation numbers are cited: the loss is what the authors' code computes. Read, not copied:
X-GenGroup/Flow-Factory src/flow_factory/trainers/dpo.py (repository HEAD a0b2bc5, the file at
3e615ee; its example examples/dpo/lora/sd3_5/default.yaml) and yifan123/flow_grpo
scripts/train_sd3_dpo.py with flow_grpo/stat_tracking.py and config/dpo.py (HEAD ac4c86e). Term by
term, and what we do:
(i) loss: both compute inside = −0.5·β·((e_θ,w − e_ref,w) − (e_θ,l − e_ref,l)), loss =
mean −logsigmoid(inside), errors the mean over all non-batch elements of (v_pred − (ε − x0))² in
float32, as here; ``train.dpo_beta`` is their ``beta`` (100 in both SD3.5 configs). The same ½·β is
in diffusers' examples/research_projects/diffusion_dpo/train_diffusion_dpo_sdxl.py (scale_term =
−0.5·beta_dpo, diffusers HEAD 58eb52c); its train_diffusion_dpo.py (the SD1.5 script) drops the ½,
−logsigmoid(beta_dpo·(ref_diff − model_diff)), so its beta_dpo is our β/2 (tests/test_dpo.py checks
both).
(ii) pairs: best versus worst of each group, one pair per group (both codes). Flow-Factory ranks
by the group advantage (argmax / argmin, first index on ties); flow_grpo by the raw reward (its
PerPromptStatTracker type 'dpo': +1 at the argmax, −1 at the argmin, the rest dropped) — the same
pair for one reward, since a group's advantages are an increasing function of its rewards (until
``train.advantage_clip``, ±5 by default, which a group-normalised advantage reaches only in groups
of more than 26, where clipped extremes tie and the first index wins). We rank
by the advantage (per-reward advantages summed with the reward weights), as Flow-Factory. Not all
pairs, no threshold on the reward gap: neither code has one.
(iii) tied groups: when every advantage is equal, Flow-Factory's argmax and argmin are the same
sample, so its pair is (x, x): Δ = 0 exactly, a term log 2 with zero gradient that still counts in
the mean over pairs. We do the same. (flow_grpo instead forces the pair (second sample ≻ first),
training on an arbitrary preference; not followed.) Samples with a NaN reward are never paired; a
group with fewer than two scored samples has no pair and is left out of the mean.
(iv) noise: σ and ε shared by the two samples of a pair (both codes: "chosen and rejected using
same noise as in Diffusion-DPO"), here shared by the whole group (only its pair trains).
(v) reference: the adapter with its LoRA disabled, frozen (Flow-Factory: the frozen initial weights
through use_ref_parameters; flow_grpo's refreshed reference: (vi)). No separate KL term: the
reference enters only through Δ (neither code adds one), so ``train.kl_beta`` must stay 0.
(vi) rollouts and the reference over time: by default, rollouts by the current policy against the
frozen reference (Flow-Factory's online DPO). flow_grpo instead samples with its reference adapter
(a second LoRA, initialised as the first: the base model) and copies the learner into it when, at
the start of an epoch, the optimizer steps taken are a positive multiple of ref_update_step (10⁷ in
its configs, i.e. never: DPO on the base model's samples; "a small number, e.g. 40, to switch to
OnlineDPO"). ``train.dpo_ref_update_every`` N > 0 is that: the reference is a copy of the trained
weights, refreshed at an epoch's end when the steps so far are a positive multiple of N (their
condition, checked where they check it), and the rollouts are sampled with that copy swapped in;
the copy is checkpointed.
(vii) timesteps: both draw σ from a logit-normal (mean 0, std 1; flow_grpo on the 1000-level
training schedule, Flow-Factory continuously in [0, 0.99]), fresh per loss term: 39 terms per pair
batch in flow_grpo (int(40·0.99)), 1 in Flow-Factory's SD3.5 example. We draw ``train.noise_draws``
distinct levels of the sampling schedule per group and update, uniformly (as DGPO, AWM, NFT here):
a different timestep density, the same loss at each σ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flowalign.domains import Annotated, above, at_least

from flowalign.objectives.base import flow_matching_error, weighted_mean


def best_and_worst(advantages: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One (chosen, rejected) pair per group: the highest and the lowest advantage among the group's
    valid samples (the first index on ties, as numpy's / torch's argmax and argmin).

    advantages: [G, k]; valid: bool [G, k]. Returns (chosen long [G], rejected long [G], positions in
    the group; has_pair bool [G], the group has at least two valid samples). A group whose valid
    advantages are all equal gets chosen = rejected (a zero-gradient pair, as Flow-Factory's)."""
    adv = advantages.float()
    chosen = torch.where(valid, adv, torch.full_like(adv, -torch.inf)).argmax(1)
    rejected = torch.where(valid, adv, torch.full_like(adv, torch.inf)).argmin(1)
    return chosen, rejected, valid.sum(1) >= 2


def dpo_loss(
    err_w: torch.Tensor,
    err_l: torch.Tensor,
    ref_w: torch.Tensor,
    ref_l: torch.Tensor,
    *,
    beta: float,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Diffusion-DPO loss L of a batch of pairs.

    err_w, err_l (with grad): [P] the policy's flow-matching errors of the chosen and the rejected
    sample of each pair (the same σ, ε within a pair); ref_w, ref_l: [P] the reference's; weight: [P]
    in {0, 1}, the pairs that train (all when None).
    Returns (loss scalar = weighted mean over pairs of −log σ(−½·β·Δ), Δ = (err_w − ref_w) −
    (err_l − ref_l); stats: policy_loss, dpo_accuracy (fraction of pairs whose chosen sample has the
    higher implicit reward, −½·β·Δ > 0), dpo_reward_chosen, dpo_reward_rejected (mean implicit
    rewards −½·β·(err − ref)), dpo_err_chosen, dpo_err_rejected (mean policy errors)).
    """
    weight = torch.ones_like(err_w, dtype=torch.float32) if weight is None else weight.float()
    w_diff = err_w.float() - ref_w.detach().float()
    l_diff = err_l.float() - ref_l.detach().float()
    inside = -0.5 * beta * (w_diff - l_diff)  # [P]
    policy_loss = weighted_mean(-F.logsigmoid(inside), weight)
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "dpo_accuracy": weighted_mean((inside > 0).float(), weight),
                 "dpo_reward_chosen": weighted_mean(-0.5 * beta * w_diff, weight),
                 "dpo_reward_rejected": weighted_mean(-0.5 * beta * l_diff, weight),
                 "dpo_err_chosen": weighted_mean(err_w.float(), weight),
                 "dpo_err_rejected": weighted_mean(err_l.float(), weight)}
    return policy_loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.ema import EMA  # noqa: E402
from flowalign.objectives.base import register, whole_groups_rule  # noqa: E402
from flowalign.objectives.forward_process import ForwardProcessObjective, NoisingOptions  # noqa: E402


@dataclass
class DPOOptions:
    """``train.*`` options of method online_dpo."""

    # β of Diffusion-DPO's −log σ(−½·β·Δ), as flow_grpo's and Flow-Factory's ``beta`` (their SD3.5
    # configs: 100; Flow-Factory's default 2000; diffusers' SD1.5 script's beta_dpo is β/2).
    dpo_beta: Annotated[float, above(0)] = 100.0
    # flow_grpo's ref_update_step: 0 = the frozen reference (LoRA off) and rollouts by the current
    # policy (Flow-Factory); N > 0 = the reference is a copy of the weights, refreshed at an epoch's
    # end when the optimizer steps so far are a multiple of N, and it samples the rollouts (flow_grpo's
    # OnlineDPO; its configs suggest 40).
    dpo_ref_update_every: Annotated[int, at_least(0, "0 = the frozen reference")] = 0


@register
class DPO(ForwardProcessObjective):
    """Online Diffusion-DPO: ODE rollouts by the current weights; each group's best and worst samples
    (by advantage) form one pair, trained on ``train.noise_draws`` noising draws per update (one loss
    term each) shared by the group; a minibatch holds whole groups. Only the pairs' samples run
    through the policy and the reference: the LoRA off, or with ``train.dpo_ref_update_every`` > 0 a
    copy of the weights refreshed every that many optimizer steps, which then also samples."""

    name = "online_dpo"
    rollout = "ode"
    predictions = ("velocity",)
    options = (NoisingOptions, DPOOptions)
    per_reward_advantages = True  # summed with the reward weights before ranking
    progress = ("dpo_accuracy",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.unit = self.config.train.group_size  # a group's pair shares one draw
        every = self.config.train.dpo_ref_update_every
        self.reference = EMA(ctx.params, 0.0) if every > 0 else None  # flow_grpo's refreshed reference
        self.stateful = self.reference is not None
        self.steps = 0  # optimizer steps taken so far (after_step)

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        return super().validate(config) + [
            whole_groups_rule(config, "online_dpo"),
            ("train.group_size", t.group_size >= 2, "must be at least 2 for online_dpo (a pair needs two samples)"),
            ("train.dpo_beta", t.dpo_beta > 0, "must be > 0"),
            ("train.kl_beta", t.kl_beta == 0, "must be 0 for online_dpo: the reference enters through the DPO loss "
             "(train.dpo_beta), as in the authors' code, which adds no KL term"),
            ("model.lora_rank", config.model.lora_rank > 0 or t.dpo_ref_update_every > 0,
             "must be > 0 for online_dpo: its reference is the adapter with the LoRA disabled (or set "
             "train.dpo_ref_update_every > 0 for a refreshed copy of the weights as the reference)"),
            ("train.dpo_ref_update_every", t.dpo_ref_update_every >= 0, "must be ≥ 0 (0 = the frozen reference)"),
        ]

    def loss(self, mb, j):
        """Diffusion-DPO on one noising draw shared by each group of the minibatch (whole groups, in order)."""
        ctx, k = self.ctx, self.config.train.group_size
        adv = ctx.scalarise(mb.advantages).view(-1, k)
        chosen, rejected, has_pair = best_and_worst(adv, mb.valid.view(-1, k))
        first = torch.arange(0, len(adv) * k, k, device=chosen.device)
        pairs = mb.select(torch.cat([first + chosen, first + rejected]))  # [chosen..., rejected...]
        x0, x_t, _, timestep, eps = self.noised(pairs, j)
        cond = pairs.traj.cond
        v_ref = (ctx.predict(x_t, timestep, cond, policy="ref") if self.reference is None
                 else ctx.predict(x_t, timestep, cond, policy="old", weights=self.reference))
        v_theta = ctx.predict(x_t, timestep, cond)
        err_ref, err_theta = flow_matching_error(v_ref, eps - x0), flow_matching_error(v_theta, eps - x0)
        (err_w, err_l), (ref_w, ref_l) = err_theta.chunk(2), err_ref.chunk(2)
        return dpo_loss(err_w, err_l, ref_w, ref_l, beta=self.config.train.dpo_beta, weight=has_pair)

    def sampling_weights(self):
        """flow_grpo samples with its reference; Flow-Factory (the frozen reference) with the policy."""
        return self.reference.swapped_in() if self.reference is not None else super().sampling_weights()

    def after_step(self) -> None:
        self.steps += 1

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        every = self.config.train.dpo_ref_update_every
        if self.reference is None:
            return {}
        refreshed = self.steps > 0 and self.steps % every == 0  # flow_grpo's check, before the next sampling
        if refreshed:
            self.reference.update()  # decay 0: a copy of the weights
        return {"train/dpo_ref_refreshed": float(refreshed)}

    def state_dict(self) -> dict:
        return {**self.reference.state_dict(), "optimizer_steps": torch.tensor(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        self.reference.load_state_dict(state)
        self.steps = int(state["optimizer_steps"])
