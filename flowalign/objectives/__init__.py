"""Objectives: one file per method, each a pure loss kernel returning ``(loss, stats)`` and the
class that plugs it into the loop (``flowalign/objectives/base.py``). The registry lines, one per method:"""

from flowalign.objectives import awm  # noqa: F401
from flowalign.objectives import branch_grpo  # noqa: F401
from flowalign.objectives import crd  # noqa: F401
from flowalign.objectives import dance_grpo  # noqa: F401
from flowalign.objectives import dgpo  # noqa: F401
from flowalign.objectives import diffusion_nft  # noqa: F401
from flowalign.objectives import dpo  # noqa: F401
from flowalign.objectives import flow_dppo  # noqa: F401
from flowalign.objectives import flow_grpo  # noqa: F401
from flowalign.objectives import gardo  # noqa: F401
from flowalign.objectives import gdro  # noqa: F401
from flowalign.objectives import grpo_guard  # noqa: F401
from flowalign.objectives import masked_ddpo  # noqa: F401
