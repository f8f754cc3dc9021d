"""Rollout: run a sampler over an adapter and keep the whole trajectory for training.

Shapes: B samples, S steps; latents x [B, ...]. The trajectory stores every latent so each
stochastic transition can be rescored under the current policy with ``transition`` (the flow SDEs
for velocity models, DDIM for ε-prediction models).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from flowalign.samplers.ddim import ddim_step
from flowalign.samplers.flow_sde import FLOW_SDE_STEPS, StepOutput, ode_step
from flowalign.samplers.steps import StepPlan
from flowalign.samplers.tree import TreeShape
from pipelines.base import Conditioning, Schedule


def _select(tensor: torch.Tensor | None, index):
    return None if tensor is None else tensor[index]


@dataclass
class Trajectory:
    """latents: float32 [B, S + 1, ...] (x_0 is the initial noise, x_S the sample);
    log_probs: [B, S] (0 at ODE steps); trained: bool [B, S]; noise_levels: η per step [S];
    sigmas [S + 1], timesteps [S] as in the schedule; cond: the conditioning used;
    alphas_cumprod, alphas_cumprod_prev [S]: the schedule's ᾱ's (DDIM rollouts only, else None);
    std_scales, step_noise [B, S, ...]: the exploration multiplier each step sampled with and its
    standard-normal draw (rollouts with a ``noise_scale``, else None; 1 and 0 at deterministic steps);
    uncond [B, S, ...]: CFG's unconditional prediction at each step (rollouts with ``keep_uncond``, else None)."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    trained: torch.Tensor
    noise_levels: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    cond: Conditioning
    alphas_cumprod: torch.Tensor | None = None
    alphas_cumprod_prev: torch.Tensor | None = None
    std_scales: torch.Tensor | None = None
    step_noise: torch.Tensor | None = None
    uncond: torch.Tensor | None = None

    def __getitem__(self, index) -> "Trajectory":
        """Select samples; the per-step schedule tensors are shared."""
        return Trajectory(self.latents[index], self.log_probs[index], self.trained[index], self.noise_levels,
                          self.sigmas, self.timesteps, self.cond[index], self.alphas_cumprod,
                          self.alphas_cumprod_prev, _select(self.std_scales, index), _select(self.step_noise, index),
                          _select(self.uncond, index))

    @staticmethod
    def cat(parts: list["Trajectory"]) -> "Trajectory":
        first = parts[0]

        def join(name: str):
            return None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])

        return Trajectory(join("latents"), join("log_probs"), join("trained"), first.noise_levels, first.sigmas,
                          first.timesteps, Conditioning.cat([p.cond for p in parts]), first.alphas_cumprod,
                          first.alphas_cumprod_prev, join("std_scales"), join("step_noise"), join("uncond"))

    @property
    def schedule(self) -> Schedule:
        """The schedule the trajectory was sampled with (what a transition function takes)."""
        return Schedule(self.sigmas, self.timesteps, self.alphas_cumprod, self.alphas_cumprod_prev)

    @property
    def samples(self) -> torch.Tensor:
        return self.latents[:, -1]


def native_bf16(device) -> bool:
    """Whether ``device`` multiplies bf16 much faster than float32: a CUDA GPU that has bf16, or a CPU
    with AMX tiles. (The demo model's forward, one thread, docs/sampling_precision_cpu.json: in bf16 it
    costs 0.5× the float32 one with AMX, 0.8–0.9× with AVX512-BF16 alone, 1.7× and 3.7× emulated on
    AVX512 or AVX2.)"""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return device.type == "cpu" and amx is not None and amx()


AUTOCAST_REFUSAL = ("must be none for {}: only flow and DDIM rollouts sampled one by one have steps to run at a "
                    "lower precision (not offline groups, trees or masked unmasking)")


def autocast_applies(objective_cls, config) -> bool:
    """Whether ``sampling.autocast`` has steps to act on in ``objective_cls``'s rollouts."""
    return objective_cls.rollout in ("ode", "sde") and objective_cls.tree_shape(config) is None


def resolved_autocast(precision: str, device) -> str:
    """``sampling.autocast`` as it runs on ``device``: auto → bf16 where ``native_bf16``, else none."""
    if precision == "auto":
        return "bf16" if native_bf16(device) else "none"
    return precision


@contextlib.contextmanager
def sampling_precision(adapter, precision: str, merge: bool = True):
    """``sampling.autocast``: the denoiser calls inside run under ``torch.autocast`` at ``precision``
    (bf16 | fp16 | auto, ``resolved_autocast``) on the adapter's device and, with ``merge`` (weights not
    sharded), a LoRA merged into the weights (``adapter.merged_lora``: under autocast the three products
    of an unmerged LoRA layer, each weight cast anew, cost about as much as the rest of the model);
    "none": nothing changes."""
    precision = resolved_autocast(precision, adapter.device)
    if precision == "none":
        yield
        return
    with torch.autocast(torch.device(adapter.device).type, dtype=AUTOCAST_DTYPES[precision]), \
            adapter.merged_lora() if merge else contextlib.nullcontext():
        yield


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LowPrecisionSteps:
    """``sampling_precision`` switched on and off step by step along a rollout (a LoRA merged once
    per run of low-precision steps, not once per step)."""

    def __init__(self, adapter, precision: str, merge: bool):
        self.adapter, self.precision, self.merge = adapter, precision, merge
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> LowPrecisionSteps:
        return self

    def __exit__(self, *exc) -> None:
        self.at(False)  # the base weights back, whatever happened in the step

    def at(self, low: bool) -> None:
        """The next step runs at low precision (``low`` and a precision is set) or at full precision."""
        low = low and self.precision != "none"
        if low and self.stack is None:
            self.stack = contextlib.ExitStack()
            self.stack.enter_context(sampling_precision(self.adapter, self.precision, self.merge))
        elif not low and self.stack is not None:
            self.stack.close()
            self.stack = None


def transition(adapter, x, step: int, schedule: Schedule, eta, cond, guidance_scale, *, sde: str = "flow_grpo",
               noise=None, prev_sample=None, reduction="mean", model=None, std_scale=None) -> StepOutput:
    """One step from x at ``step``: sample with ``noise``, score ``prev_sample``, or (η = 0)
    neither. ε-prediction adapters (``adapter.prediction == "epsilon"``) take the DDIM step, whose
    parameterisation and x̂0 clipping are the adapter's; velocity models take the ``sde`` step
    of ``FLOW_SDE_STEPS`` (flow_grpo | cps | dance_grpo), or the Euler step at η = 0.
    ``std_scale`` [B, ...]: a per-element multiplier of the SDE std (EXPLORENET; flow SDEs only)."""
    # under sampling.autocast the model answers in bf16 / fp16; the solver steps in x's float32
    out = adapter.predict(x, schedule.timesteps[step], cond, guidance_scale, model=model).to(x.dtype)
    return step_from_prediction(adapter, out, x, step, schedule, eta, sde=sde, noise=noise, prev_sample=prev_sample,
                                reduction=reduction, std_scale=std_scale)


def step_from_prediction(adapter, out, x, step: int, schedule: Schedule, eta, *, sde: str = "flow_grpo", noise=None,
                         prev_sample=None, reduction="mean", std_scale=None) -> StepOutput:
    """``transition`` given the model's output ``out`` [B, ...] at x [B, ...] (a tree rollout predicts
    once per node and steps each of its children from the same output)."""
    if adapter.prediction == "epsilon":
        if std_scale is not None:
            raise ValueError("a per-element exploration std is defined for the flow SDEs, not for DDIM")
        return ddim_step(out, x, schedule.alphas_cumprod[step], schedule.alphas_cumprod_prev[step], eta,
                         prediction_type=adapter.prediction_type, clip_sample_range=adapter.clip_sample_range,
                         noise=noise, prev_sample=prev_sample, reduction=reduction)
    sigmas = schedule.sigmas
    if eta == 0:
        x_next = ode_step(out, x, sigmas[step], sigmas[step + 1])
        return StepOutput(x_next, x_next, torch.zeros(()), torch.zeros(x.shape[0], device=x.device))
    return FLOW_SDE_STEPS[sde](out, x, sigmas[step], sigmas[step + 1], eta, noise=noise, prev_sample=prev_sample,
                               sigma_fallback=float(sigmas[1]), reduction=reduction, std_scale=std_scale)


@torch.no_grad()
def rollout(adapter, cond: Conditioning, noise: torch.Tensor, schedule: Schedule, plan: StepPlan, *,
            guidance_scale: float = 1.0, generator: torch.Generator | None = None, sde: str = "flow_grpo",
            reduction: str = "mean", noise_scale=None, keep_uncond: bool = False, precision: str = "none",
            low_precision_stochastic: bool = False, merge: bool = True) -> Trajectory:
    """Sample from ``noise`` [B, ...] with a stochastic step where ``plan.noise_levels`` > 0 (the
    ``sde`` of a velocity model, DDIM for an ε-prediction one) and a deterministic step elsewhere
    (log-prob 0 there). Step noise is drawn from ``generator`` (on its device, then moved), one
    [B, ...] draw per stochastic step, in the order diffusers' pipelines draw it: with η = 0 a
    velocity model reproduces the pipeline, and a DDIM rollout with the same generator reproduces
    ``pipe(..., eta=η)``. ``noise_scale(x, step) → m [B, ...]`` (EXPLORENET) sets each stochastic
    step's per-element std multiplier; the trajectory keeps m and the draws for rescoring.
    ``keep_uncond``: the trajectory also keeps CFG's unconditional prediction of every step (a
    training forward can then take it instead of running that branch: ``DenoiserAdapter.given_uncond``).
    ``precision`` (``sampling.autocast``): the deterministic steps, and with ``low_precision_stochastic``
    (log-probs that nobody rescores) the stochastic ones too, run under ``sampling_precision`` (``merge``:
    a LoRA merged in); a step whose log-prob trains stays at full precision, so the first rescoring
    gives ratio 1."""
    steps = schedule.num_steps
    if len(plan.noise_levels) != steps:
        raise ValueError(f"plan has {len(plan.noise_levels)} steps, schedule {steps}")
    if adapter.prediction == "epsilon" and schedule.alphas_cumprod is None:
        raise ValueError("an ε-prediction rollout needs a schedule with alphas_cumprod (the adapter's)")
    if keep_uncond and guidance_scale <= 1.0:
        raise ValueError(f"keep_uncond needs CFG (guidance_scale > 1), got {guidance_scale}")
    x = noise.float()
    latents, log_probs, scales, draws, unconds = [x], torch.zeros(x.shape[0], steps), [], [], []
    with LowPrecisionSteps(adapter, precision, merge) as low_precision:
        for i in range(steps):
            eta = float(plan.noise_levels[i])
            low_precision.at(eta == 0 or low_precision_stochastic)
            eps, m = None, None
            if eta > 0:
                eps = torch.randn(x.shape, generator=generator,
                                  device=generator.device if generator else "cpu").to(x.device)
                m = noise_scale(x, i) if noise_scale is not None else None
            if noise_scale is not None:
                scales.append(torch.ones_like(x) if m is None else m.float())
                draws.append(torch.zeros_like(x) if eps is None else eps)
            with adapter.recording_uncond() if keep_uncond else contextlib.nullcontext() as record:
                out = transition(adapter, x, i, schedule, eta, cond, guidance_scale, sde=sde, noise=eps,
                                 reduction=reduction, std_scale=m)
            if keep_uncond:
                if len(record) != 1:  # a family whose CFG bypasses DenoiserAdapter.guided records nothing
                    raise ValueError(f"{type(adapter).__name__} recorded {len(record)} unconditional predictions "
                                     f"at step {i}, expected 1 (its CFG must go through DenoiserAdapter.guided)")
                unconds.append(record[0].to(x.dtype))
            x, log_probs[:, i] = out.prev_sample, out.log_prob.cpu()
            latents.append(x)
    return Trajectory(torch.stack(latents, dim=1), log_probs.to(x.device), plan.trained.to(x.device),
                      plan.noise_levels, schedule.sigmas, schedule.timesteps, cond, schedule.alphas_cumprod,
                      schedule.alphas_cumprod_prev, torch.stack(scales, dim=1) if scales else None,
                      torch.stack(draws, dim=1) if draws else None, torch.stack(unconds, dim=1) if unconds else None)


@torch.no_grad()
def tree_rollout(adapter, cond: Conditioning, roots: torch.Tensor, schedule: Schedule, plan: StepPlan,
                 shape: TreeShape, *, guidance_scale: float = 1.0, generator: torch.Generator | None = None,
                 sde: str = "flow_grpo", reduction: str = "mean") -> Trajectory:
    """Sample one tree of ``shape`` (``flowalign.samplers.tree``) from each root noise of ``roots``
    [R, ...]: the model predicts once per node, and a step that branches into k children steps each
    of them from that one prediction with its own noise draw (× ``shape.split_noise_scale``; the
    log-prob is under the step's std, as rescoring computes it). ``cond``: [R·L] the leaves'
    conditioning, tree by tree (a tree's leaves share its prompt); ``plan.trained`` [R·L, S].

    Returns the leaves' Trajectory [R·L, S + 1, ...], tree-major and depth-first within a tree:
    leaves sharing a prefix carry the same latents and log-probs there, and ``trained`` is the plan's
    restricted to each edge's owner (``TreeShape.edge_owner``: every edge trains once). Step noise is
    one [N_{i+1}, ...] draw per stochastic step over the depth-(i + 1) nodes, children of a node
    consecutive: with every branch 1 this is ``rollout`` with the same generator, to the last digit."""
    steps, leaves = schedule.num_steps, shape.leaves
    if shape.num_steps != steps or len(plan.noise_levels) != steps:
        raise ValueError(f"tree shape has {shape.num_steps} steps, plan {len(plan.noise_levels)}, schedule {steps}")
    if len(cond) != len(roots) * leaves:
        raise ValueError(f"{len(roots)} roots of {leaves} leaves need {len(roots) * leaves} conditionings, got {len(cond)}")
    for i in shape.split_steps:
        if not plan.noise_levels[i] > 0:
            raise ValueError(f"step {i} branches but is deterministic (η = 0): its children would be identical")
    if adapter.prediction == "epsilon" and schedule.alphas_cumprod is None:
        raise ValueError("an ε-prediction rollout needs a schedule with alphas_cumprod (the adapter's)")
    x = roots.float()
    first_leaf = torch.arange(len(roots), device=x.device) * leaves  # each node's first leaf: its prompt's row
    nodes, node_log_probs = [x], []
    for i in range(steps):
        k, eta = shape.branches[i], float(plan.noise_levels[i])
        out = adapter.predict(x, schedule.timesteps[i], cond[first_leaf], guidance_scale)
        x, out = x.repeat_interleave(k, dim=0), out.repeat_interleave(k, dim=0)
        eps = None
        if eta > 0:
            eps = torch.randn(x.shape, generator=generator, device=generator.device if generator else "cpu").to(x.device)
            eps = eps * shape.split_noise_scale if k > 1 else eps
        step = step_from_prediction(adapter, out, x, i, schedule, eta, sde=sde, noise=eps, reduction=reduction)
        first_leaf = (first_leaf[:, None] + torch.arange(k, device=x.device) * shape.leaves_below(i + 1)).flatten()
        x = step.prev_sample
        nodes.append(x)
        node_log_probs.append(step.log_prob.cpu())
    trees = torch.arange(len(roots))[:, None]
    leaf = torch.arange(leaves)[None, :]

    def at_depth(d: int) -> torch.Tensor:  # [R·L]: each leaf's depth-d node, in that depth's node order
        return (trees * shape.nodes_at(d) + leaf // shape.leaves_below(d)).flatten()

    latents = torch.stack([nodes[d][at_depth(d).to(x.device)] for d in range(steps + 1)], dim=1)
    log_probs = torch.stack([node_log_probs[i][at_depth(i + 1)] for i in range(steps)], dim=1)
    trained = plan.trained.to(x.device) & shape.edge_owner().repeat(len(roots), 1).to(x.device)
    return Trajectory(latents, log_probs.to(x.device), trained, plan.noise_levels, schedule.sigmas, schedule.timesteps,
                      cond, schedule.alphas_cumprod, schedule.alphas_cumprod_prev)


def group_noise(adapter, groups: int, group_size: int, generator: torch.Generator, shared: bool) -> torch.Tensor:
    """Initial noise [groups·group_size, ...]; ``shared``: one draw per group, repeated (the
    group's samples then differ only by SDE noise)."""
    if shared:
        return adapter.initial_noise(groups, generator).repeat_interleave(group_size, dim=0)
    return adapter.initial_noise(groups * group_size, generator)
