"""Objectives: one file per method, each a pure loss kernel returning ``(loss, stats)`` and the
class that plugs it into the loop (``flowalign/objectives/base.py``). The registry lines:"""

from flowalign.objectives import awm, dance_grpo, dgpo, diffusion_nft, dpo, flow_grpo, gdro, grpo_guard, masked_ddpo  # noqa: F401
