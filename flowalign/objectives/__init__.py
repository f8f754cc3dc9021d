"""Objectives: one file per method, each a pure loss kernel returning ``(loss, stats)`` and the
class that plugs it into the loop (``flowalign/objectives/base.py``). The registry lines:"""

from flowalign.objectives import awm, branch_grpo, crd, dance_grpo, dgpo, diffusion_nft, flow_grpo, gardo, gdro, grpo_guard, masked_ddpo  # noqa: F401
