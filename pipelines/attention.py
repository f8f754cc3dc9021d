"""Which attention kernel a family's diffusers models run: ``model.attention: auto | sdpa | xformers``.

* ``sdpa``: PyTorch's ``torch.nn.functional.scaled_dot_product_attention``, which every diffusers
  attention processor of these families calls by default (SD3's ``JointAttnProcessor2_0``, the
  UNets' ``AttnProcessor2_0``, FLUX's and Wan's processors through diffusers' attention dispatcher,
  whose default backend is "native" SDPA). PyTorch picks a fused kernel itself (flash or
  memory-efficient on CUDA, a flash kernel on CPU) and falls back to its unfused math otherwise.
* ``xformers``: diffusers' ``enable_xformers_memory_efficient_attention()`` on the pipeline's
  diffusers models (the denoiser and the VAE). Only when ``xformers`` imports and the model runs
  on CUDA: xformers' kernels are CUDA-only. Asked for where it cannot run, the run goes on with
  sdpa and says so in exactly one line (``fallback_message``).
* ``auto``: xformers where it can run, else sdpa, silently (the expected case on a CPU).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

BACKENDS = ("auto", "sdpa", "xformers")


def xformers_unavailable(device: str | torch.device, family_supports: bool = True) -> str | None:
    """Why xformers cannot run here (a short reason), or None when it can."""
    if not family_supports:
        return "this model family has no xformers attention path"
    if importlib.util.find_spec("xformers") is None:
        return "xformers is not installed"
    if torch.device(device).type != "cuda":
        return f"the model runs on {torch.device(device).type}, and xformers' kernels are CUDA-only"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import xformers.ops  # noqa: F401
    except Exception as error:  # noqa: BLE001  (a broken build: say why, then run with sdpa)
        return f"importing xformers failed ({type(error).__name__}: {error})"
    return None


def resolve_attention(requested: str, device: str | torch.device,
                      family_supports: bool = True) -> tuple[str, str | None]:
    """(the backend to use: "sdpa" | "xformers", the fallback line to show or None).

    Only an explicit ``xformers`` that cannot run produces a line; ``auto`` falls back silently.
    """
    if requested not in BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "sdpa":
        return "sdpa", None
    reason = xformers_unavailable(device, family_supports)
    if reason is None:
        return "xformers", None
    if requested == "auto":
        return "sdpa", None
    return "sdpa", fallback_message(reason)


def fallback_message(reason: str) -> str:
    return (f"flowalign: attention: xformers requested but {reason}; falling back to sdpa "
            "(torch.nn.functional.scaled_dot_product_attention)")


def announce(message: str | None) -> None:
    """Print the fallback line once per machine (the local main process of a distributed run)."""
    if message and os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


def attention_processors(model: torch.nn.Module) -> dict[str, int]:
    """How many attention layers of ``model`` use each processor class (and, for processors that
    go through diffusers' dispatcher, which backend): e.g. {"JointAttnProcessor2_0": 2}."""
    counts: dict[str, int] = {}
    processors = getattr(model, "attn_processors", None) or {}
    for processor in processors.values():
        name = type(processor).__name__
        backend = getattr(processor, "_attention_backend", None)
        if backend is not None:
            name += f"[{getattr(backend, 'value', backend)}]"
        counts[name] = counts.get(name, 0) + 1
    return counts


def uses_sdpa(model: torch.nn.Module) -> bool:
    """True when every attention layer of ``model`` calls PyTorch SDPA: a ``*2_0`` processor, or a
    dispatcher processor left on the default ("native") backend; False for xformers or the
    unfused ``AttnProcessor``."""
    processors = list((getattr(model, "attn_processors", None) or {}).values())
    if not processors:
        return False
    for processor in processors:
        name = type(processor).__name__
        if "XFormers" in name:
            return False
        backend = getattr(processor, "_attention_backend", None)
        if backend is not None:
            if getattr(backend, "value", backend) != "native":
                return False
        elif hasattr(processor, "_attention_backend"):
            continue  # a dispatcher processor on the active default backend (native SDPA unless set)
        elif not name.endswith("2_0"):
            return False
    return True
