"""GARDO (He et al., arXiv 2512.24138): Flow-GRPO with a KL gated to the samples whose reward is
uncertain, a reference refreshed to the policy, and a diversity-aware advantage.

Per epoch, over every process's samples (N of them; G a group of one prompt, r the trained
reward, r^(k) the auxiliary rewards, ``train.gardo_gate_rewards``):

    rank(v)_i = i's place when the samples are sorted by v, highest first (1-based; ties by position)
    u_i       = rank(r)_i − mean_k rank(r^(k))_i                        (the "uncertainty")
    P         = {u_i : u_i ≥ 0},   m = mean(P)
    f         ← risk controller(m): f₀ on the first epoch; ×(1 + α) when m > max of the last 20
                epochs' m, ×(1 − α) when below their min; clipped to [f_min, f_max]
    gate_i    = u_i > percentile(P, 100 − 100·f)                        (numpy's linear percentile)

    d_i       = min_{j ∈ G(i), j ≠ i} (1 − clip(⟨e_i, e_j⟩, −1, 1)),  e = feature / ‖feature‖
    w_i       = 1 if r_i − mean_G r < 0, else d_i / mean_{j ∈ G(i)} d_j   (diversity factor)
    A_i       = clip((r_i − mean_G r)·w_i, ±A_max)                      (no division by the std)

Per trained step j (Flow-GRPO's loss, ``flow_grpo_loss``, on these advantages), with μ the
transition means under θ and under the reference θ_ref, s the KL's std (``train.kl_convention``):

    L_j = mean_i max(−A_i·ratio_i, −A_i·clip(ratio_i, 1 ± ε)) + β·KL_j
    KL_j = mean_{i: gate_i} ‖μ_θ − μ_ref‖² / (2·s²)   (i among the samples that train step j; mean
                                                       over elements; 0 when none of them is gated)

The reference θ_ref starts as the initial weights and is refreshed to the current weights
(θ_ref ← θ) at the start of epoch E ≥ 1 when some optimizer step of the previous epoch measured
its mean KL_j (over its loss terms and processes) above ``train.gardo_kl_threshold``, or when
E − (the epoch of the last refresh) > ``train.gardo_refresh_every``. Right after a refresh KL = 0.
With β = 0 the reference and the gate are not kept. With β = 0 (or no sample gated), the
diversity off and ``train.gardo_advantage_scale: std`` the loss is Flow-GRPO's exactly.

Source, term by term: yifan123/flow_grpo at 94e23ee5405ab7241fc1f75d30cac8147e2b1f53,
scripts/train_sd3_gardo.py (the loop: ``RiskCompensator``, the rank "uncertainty estimation",
the "old" LoRA as reference, ``reset`` / ``reset_freq``, the loss), flow_grpo/stat_tracking.py
(``PerPromptStatTracker.update(type='gardo')``: d, w, A) and config/grpo_gardo.py (kl_thres 3e-4,
reset_freq 15, β 0.04 OCR / 0.07 GenEval / 0.01 FLUX HPS); the authors' own repository
tinnerhrhe/GARDO at 1cc77fb (scripts/train_sd3_grpo_gardo.py, config/gardo.py) has the same loop.
Read, not copied. Where we follow the code and what differs:
(i) the advantage is (r − mean)·w without the std: the code's 'gardo' tracker never divides
(the paper drops the std from the normalisation); ``train.gardo_advantage_scale: std`` takes the trainer's
configured advantages instead (their sign decides w). A_max = ``train.advantage_clip`` (their 5).
(ii) r is the trained reward alone: the code overwrites its weighted reward average with
``config.main_reward``, and scores the auxiliary rewards (aesthetic, ImageReward) only for u.
Here the auxiliary rewards are components of ``reward.weights`` (weight 0: scored, not trained).
(iii) the sign of u as the code computes it: rank 1 is the highest reward, so u > 0 marks samples
the trained reward ranks *below* the auxiliary ones. Ties: a stable sort (theirs is unstable).
Samples with a non-finite reward take no rank and are never gated.
(iv) the features e: the authors embed the decoded images with DINOv3 (timm
vit_large_patch16_dinov3); here e is the final latent, flattened (no extra model; the shapes
world's latents are its pixels' VAE code). d is the distance to the *nearest* other sample
(the code's min, though its variable is called avg_distances); a lone sample has d = 0, and a group
whose d are all 0 gets w = 1 (the code would divide by 0).
(v) groups: the code pools the samples of one prompt drawn twice in an epoch; here a group is
one draw (train.group_size samples).
(vi) the code multiplies each sample's policy term by s_i / mean_batch(s); every sample of a
step shares its σ here, so the factor is 1 and is left out (EXPLORENET's per-element std scales
have no s_i: there the KL divides by each element's std, the factor is not applied).
(vii) the threshold compares the KL as measured under ``train.kl_convention`` and
``sampling.log_prob_reduction``: their 3e-4 is meant with ``flow_grpo`` and ``mean``. A step's KL
is the mean over its loss terms of KL_j over the whole minibatch's gated samples; the code's is a
mean over its micro-batches (train.batch_size samples) too, a mean of means.
(viii) the refresh happens at the end of the epoch (``end_epoch``), not at the next one's start:
no weight changes in between, so the copied weights are the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from flowalign.domains import Annotated, above, at_least, between

from flowalign.objectives.flow_grpo import flow_grpo_loss, plus_gaussian_kl

RISK_WINDOW = 20  # epochs of mean uncertainty the controller compares against (the code's buffer)


# -- the advantage: diversity-aware, without the std ---------------------------------------------
def nearest_neighbour_distance(features: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """d_i = min over the other samples j of i's group of 1 − clip(cos(e_i, e_j), −1, 1).
    features: [B, D]; group_ids: [B]. Returns float64 [B] (0 for a sample alone in its group)."""
    e = features.double()
    e = e / e.norm(dim=1, keepdim=True)
    d = torch.zeros(len(e), dtype=torch.float64)
    for gid in torch.unique(group_ids):
        members = torch.nonzero(group_ids == gid).flatten()
        if len(members) < 2:
            continue
        dist = 1 - (e[members] @ e[members].T).clamp(-1, 1)
        dist.fill_diagonal_(float("inf"))
        d[members] = dist.min(dim=1).values
    return d


def diversity_factor(distance: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """d_i / mean of d over i's group (1 where that mean is 0). distance, group_ids: [B] → [B]."""
    factor = torch.ones_like(distance)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        mean = distance[members].mean()
        if mean > 0:
            factor[members] = distance[members] / mean
    return factor


def centred_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """r_i − mean of the finite rewards of i's group. rewards: [B] (NaN = dropped, stays NaN);
    group_ids: [B] → float32 [B]."""
    out = torch.full_like(rewards, float("nan"), dtype=torch.float32)
    valid = torch.isfinite(rewards)
    for gid in torch.unique(group_ids[valid]):
        members = valid & (group_ids == gid)
        r = rewards[members].float()
        out[members] = r - r.mean()
    return out


def gardo_advantages(base: torch.Tensor, factor: torch.Tensor, clip: float) -> torch.Tensor:
    """A = clip(base·w, ±clip) with w = 1 where base < 0 and the diversity factor elsewhere: only
    samples above their group's mean are amplified or damped by their novelty. base, factor: [B] → [B]."""
    w = torch.where(base < 0, torch.ones_like(base), factor.to(base))
    return (base * w).clamp(-clip, clip)


# -- the gate: which samples the KL regularises ---------------------------------------------------
def descending_ranks(values: torch.Tensor) -> torch.Tensor:
    """1 for the highest value, N for the lowest; ties in order of position. [N] → float64 [N]."""
    order = torch.sort(values.double(), descending=True, stable=True).indices
    ranks = torch.empty(len(values), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    return ranks


def uncertainty(main: torch.Tensor, auxiliary: torch.Tensor) -> torch.Tensor:
    """u = rank(main) − mean over the auxiliary rewards of their ranks. main: [N]; auxiliary: [K, N]
    → float64 [N]."""
    return descending_ranks(main) - torch.stack([descending_ranks(a) for a in auxiliary]).mean(0)


def uncertainty_gate(u: torch.Tensor, fraction: float) -> torch.Tensor:
    """u > the (100 − 100·fraction)-th percentile (linear, as numpy's) of the u ≥ 0: about
    ``fraction`` of the non-negative u. u: [N] → bool [N]."""
    positive = u[u >= 0]
    if len(positive) == 0:
        return torch.zeros_like(u, dtype=torch.bool)
    threshold = torch.quantile(positive.double(), (100 - fraction * 100) / 100)
    return u > threshold


@dataclass
class RiskController:
    """The adaptive share of gated samples: ``fraction`` after each epoch's ``update(mean u of the
    u ≥ 0)``. ``history``: the last RISK_WINDOW epochs' means."""

    base: float = 0.1
    low: float = 0.02
    high: float = 0.2
    rate: float = 0.1
    fraction: float = 0.1
    history: list[float] = field(default_factory=list)

    def update(self, mean_u: float) -> float:
        if not self.history:
            self.fraction = self.base
        elif mean_u > max(self.history):
            self.fraction *= 1 + self.rate
        elif mean_u < min(self.history):
            self.fraction *= 1 - self.rate
        self.fraction = min(max(self.fraction, self.low), self.high)
        self.history = (self.history + [mean_u])[-RISK_WINDOW:]
        return self.fraction


# -- the loss of one step --------------------------------------------------------------------------
def gardo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    beta: float = 0.0,
    gate: torch.Tensor | None = None,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-GRPO's clipped policy term (``flow_grpo_loss`` at β = 0) over the samples of ``weight``
    plus β times the Gaussian KL to the reference over those of them that are gated.

    log_prob (with grad), old_log_prob, advantages: [B]; gate: bool [B] (needed when β > 0);
    mean (with grad), ref_mean: [B, ...] the step's transition means under θ and the reference; std:
    the KL's s, broadcastable; weight: [B] in {0, 1} (all when None). Returns (loss, stats:
    Flow-GRPO's, kl over the gated samples, gated: their share of the weighted ones)."""
    loss, stats = flow_grpo_loss(log_prob, old_log_prob, advantages, clip_range=clip_range, weight=weight)
    w = torch.ones_like(log_prob) if weight is None else weight.float()
    gated = torch.zeros_like(w) if gate is None else w * gate.to(w)
    if beta > 0:
        if gate is None:
            raise ValueError("beta > 0 needs gate")
        loss, kl = plus_gaussian_kl(loss, beta, mean, ref_mean, std, gated, reduction)
        stats["kl"] = kl.detach()
    stats["gated"] = gated.sum() / w.sum().clamp(min=1.0)
    return loss, stats


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from flowalign.ema import EMA  # noqa: E402
from flowalign.objectives.base import register  # noqa: E402
from flowalign.objectives.flow_grpo import FlowGRPO, kl_std  # noqa: E402

ADVANTAGE_SCALES = ("none", "std")


@dataclass
class GARDOOptions:
    """``train.*`` options of method gardo (their source values in the module docstring)."""

    # reward components (of reward.weights, weight 0 to score them untrained) whose ranks the trained
    # reward's rank is compared with; the KL (train.kl_beta > 0) regularises the samples they disagree on
    gardo_gate_rewards: list[str] = field(default_factory=list)
    gardo_gate_fraction: Annotated[float, between(0, 1)] = 0.1  # the first epoch's share of gated samples
    gardo_gate_min: Annotated[float, between(0, 1)] = 0.02  # the adaptive share's bounds
    gardo_gate_max: Annotated[float, between(0, 1)] = 0.2
    gardo_gate_rate: Annotated[float, between(0, 1, high_open=True)] = 0.1  # its change when u leaves its range
    # refresh the reference to the policy after an optimizer step whose mean KL exceeds this ...
    gardo_kl_threshold: Annotated[float, above(0)] = 3e-4
    # ... or when this many epochs passed since the last refresh
    gardo_refresh_every: Annotated[int, at_least(1)] = 15
    gardo_diversity: bool = True  # scale above-mean advantages by the sample's novelty in its group
    # none: A = r − group mean, the authors' (no std); std: the trainer's configured advantages
    gardo_advantage_scale: str = "none"


@register
class GARDO(FlowGRPO):
    """GARDO: Flow-GRPO's rollouts, trained steps and clipped loss, on diversity-aware advantages,
    with the KL to a refreshed copy of the weights on the gated samples only. Keeps the reference
    and the gate's controller (checkpointed) when ``train.kl_beta`` > 0."""

    name = "gardo"
    rollout = "sde"
    predictions = ("velocity",)
    options = (*FlowGRPO.options, GARDOOptions)
    per_reward_advantages = False

    def __init__(self, ctx):
        super().__init__(ctx)
        t = self.config.train
        self.stateful = t.kl_beta > 0
        self.reference = EMA(ctx.params, 0.0) if self.stateful else None  # decay 0: update() copies θ
        self.controller = RiskController(t.gardo_gate_fraction, t.gardo_gate_min, t.gardo_gate_max,
                                         t.gardo_gate_rate, t.gardo_gate_fraction)
        self.reset = False  # an optimizer step's KL passed the threshold: refresh at the epoch's end
        self.last_refresh = 0  # the epoch the reference was last refreshed at (0: the initial weights)
        self.current = False  # the per-sample terms below are this epoch's (inner epochs reuse them)
        self.base = self.factor = self.gate = None  # [N] each, by position in the epoch
        self.first_term = 0  # the epoch's first loss term: a new minibatch starts there
        self.step_kl: list[torch.Tensor] = []  # the current optimizer step's per-term KLs

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        names = t.gardo_gate_rewards
        return super().validate(config) + [
            ("train.gardo_gate_rewards", t.kl_beta == 0 or len(names) > 0,
             "must name at least one auxiliary reward component when train.kl_beta > 0 (the gate compares "
             "the trained reward's ranks with theirs)"),
            ("train.gardo_gate_rewards", all(n in config.reward.weights for n in names),
             "must name components of reward.weights (give one weight 0 to score it without training on it)"),
            ("train.gardo_gate_min", 0 <= t.gardo_gate_min <= t.gardo_gate_fraction <= t.gardo_gate_max <= 1,
             "must satisfy 0 ≤ gardo_gate_min ≤ gardo_gate_fraction ≤ gardo_gate_max ≤ 1"),
            ("train.gardo_gate_rate", 0 <= t.gardo_gate_rate < 1, "must be in [0, 1)"),
            ("train.gardo_kl_threshold", t.gardo_kl_threshold > 0, "must be > 0"),
            ("train.gardo_refresh_every", t.gardo_refresh_every >= 1, "must be ≥ 1"),
            ("train.gardo_advantage_scale", t.gardo_advantage_scale in ADVANTAGE_SCALES,
             "must be none (r − group mean, the authors') or std (the trainer's advantages)"),
        ]

    def begin_update(self, batch) -> None:
        """The epoch's per-sample terms, once per epoch (inner epochs reuse them): the centred
        rewards, the diversity factors and the gate (the controller moves once per epoch)."""
        if self.current:
            return
        t, dist = self.config.train, self.ctx.dist
        self.current, self.first_term = True, self.terms(batch)[0]
        self.base = centred_rewards(batch.rewards, batch.group_ids)
        features = batch.traj.samples.flatten(1).cpu()  # a group's samples live on one process
        self.factor = (diversity_factor(nearest_neighbour_distance(features, batch.group_ids), batch.group_ids)
                       if t.gardo_diversity else torch.ones(len(batch.specs), dtype=torch.float64))
        if self.reference is None:
            return
        main = dist.gather(batch.rewards)
        auxiliary = torch.stack([dist.gather(batch.components[n]) for n in t.gardo_gate_rewards])
        ok = torch.isfinite(main) & torch.isfinite(auxiliary).all(0)
        gate = torch.zeros(len(main), dtype=torch.bool)
        if ok.any():
            u = uncertainty(main[ok], auxiliary[:, ok])  # sums to 0: some u ≥ 0
            self.controller.update(u[u >= 0].mean().item())
            gate[ok] = uncertainty_gate(u, self.controller.fraction)
        self.gate = gate[dist.mine(len(batch.specs))]

    def loss(self, mb, j):
        if j == self.first_term:  # a new minibatch: the last step's KLs were consumed (or the step skipped)
            self.step_kl = []
        rows = mb.traj.trained[:, j]
        if rows.any() and not rows.all():  # step_mode fraction: rescore the rows that train step j (FlowGRPO.loss)
            mb = mb.select(rows.nonzero().squeeze(1))
        t, s, sub = self.config.train, self.config.sampling, mb.traj
        idx = mb.idx.cpu()
        base = self.base[idx] if t.gardo_advantage_scale == "none" else mb.advantages.cpu()
        advantages = torch.nan_to_num(gardo_advantages(base, self.factor[idx], t.advantage_clip), nan=0.0)
        mb = dataclasses.replace(mb, advantages=advantages.to(mb.advantages))
        weight = self.trained_weight(mb, j)
        gate = None if self.reference is None else self.gate[idx].to(weight.device)
        ref_mean = None
        if gate is not None and bool((gate & weight).any()):  # the reference's forward first: before θ's graph
            ref_mean = self.transition(mb, j, "old", self.reference).mean
        out = self.transition(mb, j)
        std = out.std
        if t.kl_convention != "exact":
            std = kl_std(std, float(sub.schedule.sigmas[j]), float(sub.schedule.sigmas[j + 1]),
                         convention=t.kl_convention, sde=s.sde)
        loss, stats = gardo_loss(out.log_prob, sub.log_probs[:, j], mb.advantages, clip_range=t.clip_range,
                                 beta=t.kl_beta if ref_mean is not None else 0.0, gate=gate, mean=out.mean,
                                 ref_mean=ref_mean, std=std, weight=weight, reduction=s.log_prob_reduction)
        self.step_kl.append(stats["kl"])
        return loss, stats

    def after_step(self) -> None:
        """The step's KL, averaged over its loss terms and the processes (the code's logged kl_loss),
        above the threshold: refresh at the epoch's end."""
        if self.reference is None or not self.step_kl:
            return
        kl = self.ctx.dist.across_processes([torch.stack(self.step_kl).mean().item()]).mean().item()
        self.reset |= kl > self.config.train.gardo_kl_threshold
        self.step_kl = []

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        self.current = False
        if self.reference is None:
            return {}
        next_epoch = epoch + 1  # the code decides at the next epoch's start; no weight changes in between
        refresh = self.reset or next_epoch - self.last_refresh > self.config.train.gardo_refresh_every
        if refresh:
            self.reference.update()  # θ_ref ← θ
            self.reset, self.last_refresh = False, next_epoch
        return {"train/gardo_gate_fraction": self.controller.fraction,
                "train/gardo_gated": float(self.gate.float().mean()), "train/gardo_refresh": float(refresh)}

    def components(self) -> dict:
        return {"reference": self} if self.stateful else {}

    def state_dict(self) -> dict:
        c = self.controller
        history = torch.zeros(RISK_WINDOW, dtype=torch.float64)  # the first risk_count hold the means
        history[:len(c.history)] = torch.tensor(c.history, dtype=torch.float64)
        return {**self.reference.state_dict(), "reset": torch.tensor(int(self.reset)),
                "last_refresh": torch.tensor(self.last_refresh), "gate_fraction": torch.tensor(c.fraction, dtype=torch.float64),
                "risk_history": history, "risk_count": torch.tensor(len(c.history))}

    def load_state_dict(self, state: dict) -> None:
        self.reference.load_state_dict(state)
        self.reset, self.last_refresh = bool(state["reset"]), int(state["last_refresh"])
        self.controller.fraction = float(state["gate_fraction"])
        self.controller.history = state["risk_history"][:int(state["risk_count"])].tolist()
