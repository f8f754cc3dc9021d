"""Stochastic samplers: pure functions of tensors and schedules, never of a model class."""

from flowalign.samplers.ddim import ddim_step
from flowalign.samplers.flow_sde import StepOutput, flow_grpo_sde_step, gaussian_log_prob, ode_step
from flowalign.samplers.steps import StepPlan, plan_steps

__all__ = ["StepOutput", "ddim_step", "flow_grpo_sde_step", "gaussian_log_prob", "ode_step", "StepPlan", "plan_steps"]
