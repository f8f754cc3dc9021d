"""DanceGRPO (Xue et al. 2025) as a preset of Flow-GRPO: DanceGRPO's SDE (a flat noise schedule,
``sampling.sde: dance_grpo``, or ``dance_grpo_euler``: the same step without the score term, its
code's ``sde_solver=False``), no KL term and no reference model. Its other options are general
ones a recipe sets (configs/shapes_dance_grpo.yaml): ``sampling.shared_group_noise``,
``sampling.step_mode: fraction``, ``train.keep_extremes`` (best-of-N) and
``train.per_reward_advantages`` (one clipped objective per reward component)."""

from __future__ import annotations

from flowalign.objectives.base import register
from flowalign.objectives.flow_grpo import FlowGRPO


@register
class DanceGRPO(FlowGRPO):
    name = "dance_grpo"

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        return super().validate(config) + [
            ("train.kl_beta", config.train.kl_beta == 0,
             "must be 0 for dance_grpo (no reference model); use method=flow_grpo for a KL"),
            ("sampling.sde", config.sampling.sde in ("dance_grpo", "dance_grpo_euler"),
             "must be dance_grpo (or dance_grpo_euler, without the score term) for method dance_grpo (its "
             "flat-noise SDE); use method=flow_grpo for another step"),
        ]
