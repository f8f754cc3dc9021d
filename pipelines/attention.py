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
* any backend of diffusers' attention dispatcher (``DISPATCHER_BACKENDS``: ``flash``, ``sage``,
  ``_native_cudnn``, ``flex``, ``_native_math``, …): ``set_attention_backend`` on every denoiser,
  for the families whose attention goes through the dispatcher (FLUX.1, FLUX.2, Kontext, Wan,
  LTX-2, Qwen-Image, Z-Image). Where the backend cannot run (its package is missing, or it needs
  CUDA and the model is elsewhere) or the family's attention does not go through the dispatcher
  (SD3's ``JointAttnProcessor2_0`` and the UNets' ``AttnProcessor2_0`` call SDPA themselves, so the
  dispatcher setting would be a silent no-op), the run goes on with sdpa and says so in one line.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads lazily: the CLI's --help never imports it
    import torch

# diffusers 0.42's AttentionBackendName values (tests/test_attention_dispatch.py keeps the two equal)
DISPATCHER_BACKENDS = (
    "flash", "flash_hub", "flash_varlen", "flash_varlen_hub", "flash_4_hub", "_flash_3", "_flash_varlen_3",
    "_flash_3_hub", "_flash_3_varlen_hub", "aiter_fa2_hub", "flex", "native", "_native_cudnn", "_native_efficient",
    "_native_flash", "_native_math", "_native_npu", "_native_xla", "sage", "sage_hub", "sage_blackwell_hub",
    "sage_varlen", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton", "xformers")
# dispatcher backends that run on a CPU; the others need their accelerator (CUDA, or an NPU / XLA device)
CPU_DISPATCHER_BACKENDS = ("native", "_native_math", "_native_efficient", "flex")
BACKENDS = ("auto", "sdpa", "xformers", *(b for b in DISPATCHER_BACKENDS if b != "xformers"))


def xformers_unavailable(device: str | torch.device, family_supports: bool = True) -> str | None:
    """Why xformers cannot run here (a short reason), or None when it can."""
    import torch  # here, not at the top: flowalign.config reads BACKENDS without loading torch

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
    if requested not in ("auto", "xformers"):  # a dispatcher backend
        reason = dispatcher_unavailable(requested, device)
        return (requested, None) if reason is None else ("sdpa", fallback_message(reason, requested))
    reason = xformers_unavailable(device, family_supports)
    if reason is None:
        return "xformers", None
    if requested == "auto":
        return "sdpa", None
    return "sdpa", fallback_message(reason)


def fallback_message(reason: str, requested: str = "xformers") -> str:
    return (f"flowalign: attention: {requested} requested but {reason}; falling back to sdpa "
            "(torch.nn.functional.scaled_dot_product_attention)")


def dispatcher_unavailable(backend: str, device: str | torch.device) -> str | None:
    """Why diffusers' dispatcher backend ``backend`` cannot run here (a short reason), or None."""
    import torch
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    kind = torch.device(device).type
    if backend not in CPU_DISPATCHER_BACKENDS and kind == "cpu":
        return f"the model runs on cpu, and the {backend} kernels need an accelerator"
    try:
        _check_attention_backend_requirements(AttentionBackendName(backend))
    except (RuntimeError, ImportError) as error:
        return str(error).split(". ")[0]
    return None


def attention_modules(model: torch.nn.Module) -> list:
    """``model``'s diffusers attention layers (what ``set_attention_backend`` visits)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))]


def uses_dispatcher(model: torch.nn.Module) -> bool:
    """True when every attention layer of ``model`` calls diffusers' attention dispatcher (its
    processor carries ``_attention_backend``), so ``set_attention_backend`` reaches all of them."""
    layers = attention_modules(model)
    return bool(layers) and all(hasattr(m.processor, "_attention_backend") for m in layers)


def set_dispatcher_backend(denoisers, backend: str) -> str | None:
    """``set_attention_backend(backend)`` on each denoiser; None, or the fallback line (nothing is
    set) when one of them does not go through the dispatcher."""
    denoisers = list(denoisers)
    if not all(uses_dispatcher(m) for m in denoisers):
        names = sorted({type(a.processor).__name__ for m in denoisers for a in attention_modules(m)})
        return fallback_message(f"this model family's attention ({', '.join(names)}) does not go through diffusers' "
                                "attention dispatcher", backend)
    for model in denoisers:
        model.set_attention_backend(backend)
    return None


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
