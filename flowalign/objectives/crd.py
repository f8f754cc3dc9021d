"""CRD: Centered Reward Distillation (arXiv 2603.14128), on the forward process.

KL-regularised reward maximisation against an anchor policy p_a has the closed-form optimum
p*(x|c) ∝ p_a(x|c)·exp(r(x, c)/β), so β·log p*/p_a equals the reward up to a per-prompt constant
β·log Z(c). CRD takes a slowly moving old copy of the weights as the anchor, estimates log p_θ/p_old
through the flow-matching ELBO (r_θ below) and regresses β·r_θ onto the external reward after
centring both within the same set of samples: the constant cancels in the difference and never has
to be estimated. Rollouts keep only their final samples x0
(ODE solver, no log-probabilities); they are drawn by a slowly moving "sampling" copy of the weights.
Per sample, for a noising draw (σ, ε) (``../shared/METHODS.md`` notation):

    x_σ      = (1 − σ)·x0 + σ·ε,   v = ε − x0
    w_θ      = max(mean|v_θ − v|, 1e-5),  w_old likewise  (detached; the "adaptive logp"; 1 when off)
    r_θ(x)   = −mean[ (v_θ − v)²/w_θ − (v_old − v)²/w_old ]        (implicit reward, v_old detached)
    r(x)     = clip(A/A_max, −1, 1)/2 + 1/2 ∈ [0, 1]               (the external reward, A_max = 5)
    centring over a set S with weights p (Σ p = 1; uniform by default):
    R_c      = r − Σ_S p·r,      R_θ,c = r_θ − sg(Σ_S p·r_θ)        (sg: stop-gradient)
    ℓ        = mean_S (β·R_θ,c − R_c)²            ("mse"; "bce": BCE-with-logits(β·R_θ,c, sigmoid(R_c)))
    L        = ℓ·A_max/β  +  λ·mean_S (c_min + r·(1 − c_min))·‖v_θ − v_ref^cfg‖²,  c_min = 1e-4/λ

v_ref^cfg is the reference (LoRA off) evaluated with classifier-free guidance at scale
``train.crd_kl_cfg`` (``Context.predict(..., guidance_scale, policy="ref")``): the KL pulls the
CFG-free policy toward the guided teacher, so the tuned model needs no CFG at sampling. The
"reward-adaptive" weight lets well-rewarded samples drift less from it (c_min for r = 0, 1 for r = 1).
When β·R_θ,c = R_c on every sample (the implicit rewards match the centred ones) ℓ is exactly 0;
with r_θ ≡ 0 (θ = old, as at the run's start) the gradient is −(2·A_max/n)·Σ_i R_c,i·∇r_θ,i over the
minibatch's n samples: raise the implicit reward of above-centre samples, lower it for the others.
``crd_loss`` implements ℓ·A_max/β and the KL; ``implicit_reward`` r_θ.

Term by term against the authors' code, Flow-Factory ``src/flow_factory/trainers/crd.py`` and
``hparams/training_args.py`` (X-GenGroup/Flow-Factory at a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c;
read, not copied), and what we do:
(i) r_θ, its adaptive weights (float64, clipped at 1e-5, means over all non-batch elements), r, the
centring with the centre of r_θ detached, the mse / bce losses, the factor A_max/β (their
``adv_clip_range[1] / max(crd_beta, 1e-8)``) and the reward-adaptive KL with base 1e-4: as theirs.
(ii) weights p (``train.crd_weight_temp``): < 0 uniform (their default and SD3.5 example); > 0 two
centrings, softmax(r/T) and softmax(−r/T), the loss the mean of the two; 0 their "hard selection",
softmax of r over the samples with r > 0 and (for the second) r < 0, uniform where none: as theirs,
including that r ∈ [0, 1] makes the second set empty (so uniform) and the first all but r = 0.
(iii) the centring set S. Theirs is each micro-batch gathered over the GPUs, in rollout order (they
do not shuffle: the code's comment says the centring "needs same-prompt grouping"): under their
group-contiguous sampler on one GPU that is 8 samples of one prompt's 24; on their 8-GPU SD3.5
example it is 8 samples from each of 8 prompts, so prompts mix. We centre within each prompt's
whole group (a minibatch holds whole groups), the prompt-centred reward the derivation needs.
(iv) timesteps: per micro-batch they draw ``num_train_timesteps`` schedule steps, stratified over
the steps in ``timestep_range`` (0.99: every step of a 10-step SD3.5 schedule), each shared by
the batch, with fresh ε per sample and step; each is one gradient-accumulation term. Here
``train.noise_draws`` steps per group, stratified the same way (strata of linspace(0, L − 1, K + 1),
index = lower + ⌊u·(upper − lower)⌋, so the last step is never drawn and K > L repeats steps), shared
by the group (its centring set), ε per sample; one loss term each. Not the whole minibatch: each
group draws its own.
(v) old and sampling copies (``use_old_for_loss``; ``train.crd_old_for_loss``: false anchors r_θ at
the reference instead): exponential blends of the trained weights, copy ← d·copy + (1 − d)·θ after
every epoch, d from their decay schedule "start_step-start_value-slope-end_value" at the optimizer
steps taken so far (d = start_value before start_step, then min(start_value + (step − start)·slope,
end_value); d ≤ 0 copies, d ≥ 1 freezes) or one of their presets. Rollouts always come from the
sampling copy. Both start at the initial weights; both and the step count are checkpointed.
(vi) not implemented: their time-sampling strategies other than "discrete", and timestep_range
other than every step (the schedule's last σ here is well above their 0.01 cut).
Further decision: samples with a NaN reward (``valid`` false) take no part in centring or loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flowalign.domains import Annotated, above, at_least, finite

from flowalign.objectives.base import velocity_kl, weighted_mean
from flowalign.objectives.diffusion_nft import optimality_probability

# the authors' named decay schedules: (start_step, start_value, slope, end_value)
DECAY_PRESETS = {
    "0": (0, 0.0, 0.0, 0.0), "1": (0, 0.0, 0.001, 0.5), "2": (75, 0.0, 0.0075, 0.999), "3": (0, 1.0, 0.0, 1.0),
    "4": (0, 0.0, 0.02, 0.99), "5": (0, 0.0, 0.01, 0.5), "6": (0, 0.0, 0.0075, 0.999),
    "none": (0, 0.0, 0.0, 0.0), "slow": (0, 0.0, 0.001, 0.5), "medium": (75, 0.0, 0.0075, 0.999),
    "offline": (0, 1.0, 0.0, 1.0), "fast": (0, 0.0, 0.02, 0.99), "moderate": (0, 0.0, 0.01, 0.5),
}
CRD_LOSSES = ("mse", "bce")
KL_BASE = 1e-4  # the reward-adaptive KL's weight at r = 0, in units of λ: c_min = 1e-4 / λ
ADAPTIVE_FLOOR = 1e-5  # floor of the adaptive weights mean|v − target|


def parse_decay(spec: str) -> tuple[int, float, float, float]:
    """A decay schedule, a preset name (``DECAY_PRESETS``) or "start_step-start_value-slope-end_value"
    → (start_step, start_value, slope, end_value); ValueError otherwise."""
    spec = str(spec).strip()
    if spec in DECAY_PRESETS:
        return DECAY_PRESETS[spec]
    parts = spec.split("-")
    if len(parts) != 4:
        raise ValueError(f"a preset ({', '.join(DECAY_PRESETS)}) or 'start_step-start_value-slope-end_value', "
                         f"got {spec!r}")
    start, value, slope, end = (float(p) for p in parts)
    return int(start), value, slope, end


def decay_at_step(step: int, spec: str) -> float:
    """The copy's blend d after ``step`` optimizer steps: start_value before start_step, then
    min(start_value + (step − start_step)·slope, end_value)."""
    start, value, slope, end = parse_decay(spec)
    return value if step < start else min(value + (step - start) * slope, end)


def implicit_reward(v_theta: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor,
                    adaptive: bool = True) -> torch.Tensor:
    """r_θ = −mean[(v_θ − v)²/w_θ − (v_old − v)²/w_old], w = max(mean|pred − v|, 1e-5) detached (float64)
    when ``adaptive``, else 1. v_theta (with grad), v_old, target: [B, ...] → float32 [B]."""
    err_theta = v_theta.float() - target.float()
    err_old = (v_old.detach().float() - target.float())
    if adaptive:
        dims = tuple(range(1, err_theta.ndim))
        w_theta = err_theta.detach().double().abs().mean(dims, keepdim=True).clamp(min=ADAPTIVE_FLOOR)
        w_old = err_old.double().abs().mean(dims, keepdim=True).clamp(min=ADAPTIVE_FLOOR)
        return -(err_theta**2 / w_theta - err_old**2 / w_old).flatten(1).mean(1).float()
    return -(err_theta**2 - err_old**2).flatten(1).mean(1)


def centring_weights(r: torch.Tensor, temp: float, valid: torch.Tensor) -> list[torch.Tensor]:
    """The centring weights p over each set (rows): [uniform] for temp < 0, else [p⁺, p⁻] (module
    docstring (ii)). r: [G, k] in [0, 1]; valid: bool [G, k] (invalid members weigh 0) → list of [G, k]."""
    uniform = valid.float() / valid.float().sum(1, keepdim=True).clamp(min=1.0)
    if temp < 0:
        return [uniform]
    out = []
    for sign in (1.0, -1.0):
        if temp == 0:  # their hard selection: softmax of r over the members on the chosen side of 0
            chosen = valid & (sign * r > 0)
            logits = torch.where(chosen, r, torch.full_like(r, float("-inf")))
            p = torch.where(chosen.any(1, keepdim=True), torch.softmax(logits, 1).nan_to_num(0.0), uniform)
        else:
            p = torch.softmax(torch.where(valid, sign * r / temp, torch.full_like(r, float("-inf"))), 1).nan_to_num(0.0)
        out.append(p)
    return out


def crd_loss(
    r_theta: torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    advantage_max: float,
    loss_type: str = "mse",
    weight_temp: float = -1.0,
    valid: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    reward_adaptive_kl: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The CRD loss L of one noising draw for a minibatch of centring sets (module docstring).

    r_theta (with grad): [G, k] implicit rewards; r: [G, k] external rewards in [0, 1]; valid: bool
    [G, k], the samples that take part (all when None); kl (with grad): [G, k] mean‖v_θ − v_ref‖² per
    sample (needed when kl_beta > 0). Each direction's loss is the mean over valid samples; with two
    directions (weight_temp ≥ 0) their mean.
    Returns (loss scalar = ℓ·A_max/β + KL term; stats: policy_loss (ℓ·A_max/β), crd_matching (ℓ),
    crd_r_theta (mean r_θ), crd_gap (mean |β·R_θ,c − R_c| of the first direction), kl).
    """
    if beta <= 0:
        raise ValueError(f"CRD needs beta > 0, got {beta}")
    valid = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.bool()
    w = valid.float()
    r_theta32, r32 = r_theta.float(), r.float()
    terms, gaps = [], []
    for p in centring_weights(r32, weight_temp, valid):
        r_c = r32 - (r32 * p).sum(1, keepdim=True)
        r_theta_c = r_theta32 - (r_theta32.detach() * p).sum(1, keepdim=True)
        if loss_type == "mse":
            per_sample = (beta * r_theta_c - r_c) ** 2
        elif loss_type == "bce":
            per_sample = F.binary_cross_entropy_with_logits(beta * r_theta_c, torch.sigmoid(r_c), reduction="none")
        else:
            raise ValueError(f"loss_type must be one of {', '.join(CRD_LOSSES)}, got {loss_type!r}")
        terms.append(weighted_mean(per_sample.flatten(), w.flatten()))
        gaps.append((beta * r_theta_c - r_c).detach().abs())
    matching = torch.stack(terms).mean()
    policy_loss = matching * advantage_max / beta
    loss, kl_mean = policy_loss, torch.zeros((), device=r.device)
    if kl_beta > 0:
        if kl is None:
            raise ValueError("kl_beta > 0 needs kl")
        kl_mean = weighted_mean(kl.float().flatten(), w.flatten())
        if reward_adaptive_kl:
            c_min = KL_BASE / kl_beta
            loss = loss + kl_beta * weighted_mean(((c_min + r32 * (1 - c_min)) * kl.float()).flatten(), w.flatten())
        else:
            loss = loss + kl_beta * kl_mean
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "crd_matching": matching.detach(), "kl": kl_mean.detach(),
                 "crd_r_theta": weighted_mean(r_theta32.detach().flatten(), w.flatten()),
                 "crd_gap": weighted_mean(gaps[0].flatten(), w.flatten())}
    return loss, stats


def stratified_steps(n: int, levels: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """The authors' stratified draw of k schedule indices among ``levels``, for n sets: long [n, k],
    index j in [⌊b_j⌋, ⌊b_{j+1}⌋) of b = linspace(0, levels − 1, k + 1) (⌊b_j⌋ when the two coincide)."""
    bounds = torch.linspace(0, levels - 1, k + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(n, k, generator=generator) * (upper - lower)).long()


# -- the objective (flowalign/objectives/base.py) ------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from flowalign.ema import EMA  # noqa: E402
from flowalign.objectives.base import register, whole_groups_rule  # noqa: E402
from flowalign.objectives.forward_process import ForwardProcessObjective, NoisingOptions  # noqa: E402


@dataclass
class CRDOptions:
    """``train.*`` options of method crd (the authors' names without the ``crd_`` prefix, same meaning)."""

    crd_beta: Annotated[float, above(0)] = 1.0  # β: the implicit reward's scale against the centred external one
    crd_loss: str = "mse"  # their crd_loss_type: mse (squared error) or bce (cross-entropy against sigmoid(R_c))
    crd_old_for_loss: bool = True  # their use_old_for_loss: r_θ against the old copy (false: the reference)
    crd_adaptive_logp: bool = True  # their adaptive_logp: each squared error divided by its detached mean absolute error
    # their weight_temp: < 0 uniform centring, > 0 softmax two ways, 0 hard selection
    crd_weight_temp: Annotated[float, finite("< 0: uniform centring")] = -1.0
    # their old_model_decay: the old copy's blend "start_step-start_value-slope-end_value" over optimizer
    # steps, or a preset name (none, slow, medium, offline, fast, moderate, 0 … 6)
    crd_old_decay: str = "0-0.25-0.005-0.999"
    crd_sampling_decay: str = "75-0.0-0.0075-0.999"  # their sampling_model_decay: the sampling copy's, the same form
    crd_kl_cfg: Annotated[float, at_least(0)] = 4.5  # their kl_cfg: the reference's CFG scale in the KL (≤ 1: none)
    crd_reward_adaptive_kl: bool = True  # their reward_adaptive_kl: KL weight c_min + r·(1 − c_min)


@register
class CRD(ForwardProcessObjective):
    """CRD: ODE rollouts by the sampling copy; ``train.noise_draws`` stratified schedule steps per
    group and minibatch (one loss term each, ε per sample), a minibatch of whole groups, each group
    its own centring set. The old and sampling copies are blended at each epoch's end on the
    authors' schedules; they and the optimizer-step count are this objective's checkpointed state."""

    name = "crd"
    rollout = "ode"
    predictions = ("velocity",)
    options = (NoisingOptions, CRDOptions)
    per_reward_advantages = True  # summed with the reward weights
    stateful = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.unit = self.config.train.group_size  # a group is a centring set: it trains together
        self.old = EMA(ctx.params, 0.0)  # anchors r_θ
        self.sampling = EMA(ctx.params, 0.0)  # draws the rollouts
        self.steps = 0  # optimizer steps taken (the decay schedules' clock)

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t = config.train
        rules = [("train.noise_draws", t.noise_draws >= 1, "must be ≥ 1"),  # stratified: more than the steps repeats some
                 whole_groups_rule(config, "crd"),
                 ("train.group_size", t.group_size >= 2, "must be at least 2 for crd (centring needs two samples)"),
                 ("train.crd_beta", t.crd_beta > 0, "must be > 0"),
                 ("train.crd_loss", t.crd_loss in CRD_LOSSES, f"must be one of {', '.join(CRD_LOSSES)}, got {t.crd_loss!r}"),
                 ("model.lora_rank", config.model.lora_rank > 0 or t.kl_beta > 0 or t.crd_old_for_loss,
                  "must be > 0 for crd with train.crd_old_for_loss false and train.kl_beta 0: the reference is the "
                  "adapter with the LoRA disabled (full fine-tuning keeps a reference copy only with train.kl_beta > 0)")]
        for key in ("crd_old_decay", "crd_sampling_decay"):
            try:
                parse_decay(getattr(t, key))
                ok, message = True, ""
            except ValueError as e:
                ok, message = False, f"must be {e}"
            rules.append((f"train.{key}", ok, message))
        return rules

    def sampling_weights(self):
        return self.sampling.swapped_in()

    def begin_update(self, batch) -> None:
        """Per group: train.noise_draws stratified schedule steps from its shard's noise stream; per
        sample: ε for each (the draws indexed by sample, as ``ForwardProcessObjective``)."""
        dist, k, draws = self.ctx.dist, self.config.train.group_size, self.config.train.noise_draws
        traj = batch.traj
        per_shard, levels, shape = len(traj.latents) // len(dist.streams), len(traj.timesteps), tuple(traj.samples.shape[1:])
        steps, noise = [], []
        for streams in dist.streams:
            g = streams["noise"]
            steps.append(stratified_steps(per_shard // k, levels, draws, g).repeat_interleave(k, dim=0))
            noise.append(torch.randn(per_shard, draws, *shape, generator=g))
        self.draws = torch.cat(steps).to(dist.device), torch.cat(noise).to(dist.device)

    def loss(self, mb, j):
        """CRD on one noising draw per group of the minibatch (whole groups, in order)."""
        ctx, t, cond = self.ctx, self.config.train, mb.traj.cond
        x0, x_t, _, timestep, eps = self.noised(mb, j)
        # the copies' and the reference's forwards before θ's: swapping weights in later would break its graph
        if t.crd_old_for_loss:
            v_old = ctx.predict(x_t, timestep, cond, policy="old", weights=self.old)
        else:
            v_old = ctx.predict(x_t, timestep, cond, policy="ref")
        v_ref = ctx.predict(x_t, timestep, cond, max(t.crd_kl_cfg, 1.0), policy="ref") if t.kl_beta > 0 else None
        v_theta = ctx.predict(x_t, timestep, cond)
        r_theta = implicit_reward(v_theta, v_old, eps - x0, t.crd_adaptive_logp)
        r = optimality_probability(ctx.scalarise(mb.advantages), t.advantage_clip)
        kl = velocity_kl(v_theta, v_ref) if v_ref is not None else None
        k = t.group_size
        return crd_loss(r_theta.view(-1, k), r.view(-1, k), beta=t.crd_beta, advantage_max=t.advantage_clip,
                        loss_type=t.crd_loss, weight_temp=t.crd_weight_temp, valid=mb.valid.view(-1, k),
                        kl=None if kl is None else kl.view(-1, k), kl_beta=t.kl_beta,
                        reward_adaptive_kl=t.crd_reward_adaptive_kl)

    def after_step(self) -> None:
        self.steps += 1

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        t = self.config.train
        stats = {}
        for name, copy, spec in (("old", self.old, t.crd_old_decay), ("sampling", self.sampling, t.crd_sampling_decay)):
            copy.decay = min(max(decay_at_step(self.steps, spec), 0.0), 1.0)  # ≤ 0 copies θ, ≥ 1 keeps the copy
            copy.update()
            stats[f"train/crd_{name}_decay"] = copy.decay
        return stats

    def components(self) -> dict:
        return {"crd": self}  # crd.safetensors: both copies and the step count

    def state_dict(self) -> dict:
        return {**{f"old.{k}": v for k, v in self.old.state_dict().items()},
                **{f"sampling.{k}": v for k, v in self.sampling.state_dict().items()}, "steps": torch.tensor(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        for prefix, copy in (("old.", self.old), ("sampling.", self.sampling)):
            copy.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self.steps = int(state["steps"])
