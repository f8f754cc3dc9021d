"""Model adapters around diffusers pipelines, one per family, and offline tiny-model builders.

``load_adapter`` is the one place an adapter is built (the trainer, ``flowalign sample / grid /
eval``): it checks the family's options, loads the weights and sets the attention backend.
"""

from __future__ import annotations

import inspect
import types
import typing

from pipelines.base import Adapter, Conditioning, ModelNotFoundError, Schedule, resolve_model_path

FAMILIES = {"sd3": "pipelines.sd3:SD3Adapter", "sd": "pipelines.sd:SDAdapter", "sdxl": "pipelines.sdxl:SDXLAdapter",
            "flux": "pipelines.flux:FluxAdapter", "wan": "pipelines.wan:WanAdapter"}
FAMILIES["chess"] = "pipelines.chess:ChessAdapter"  # masked discrete diffusion (prediction "logits")
FAMILIES["ltx2"] = "pipelines.ltx2:LTX2Adapter"  # joint audio-video latents (pipelines/joint.py)
FAMILIES["av_demo"] = "pipelines.av_demo:AVDemoAdapter"  # the built-in joint audio-video demo model
FAMILIES["qwen_image"] = "pipelines.qwen_image:QwenImageAdapter"
FAMILIES["flux2"] = "pipelines.flux2:Flux2KleinAdapter"  # FLUX.2 klein (base and step-distilled)
FAMILIES["z_image"] = "pipelines.z_image:ZImageAdapter"  # Z-Image and Z-Image-Turbo
FAMILIES["flux_kontext"] = "pipelines.flux_kontext:FluxKontextAdapter"  # image-conditioned (editing)
FAMILIES["qwen_image_edit"] = "pipelines.qwen_image_edit:QwenImageEditAdapter"  # image-conditioned (editing)
FAMILIES["wan_i2v"] = "pipelines.wan_i2v:WanImageToVideoAdapter"  # image-conditioned (image-to-video)

# constructor arguments that have their own setting (model.height, ...) or that the loader sets
LOADER_ARGUMENTS = ("self", "pipe", "device", "height", "width", "num_frames")
# options every image / video adapter takes besides its constructor's: decode-time VAE switches
# (DenoiserAdapter.enable_vae_tiling / enable_vae_slicing: less memory, tiling changes seams slightly)
LOAD_OPTIONS = {"vae_tiling": bool, "vae_slicing": bool}


def adapter_class(family: str):
    """The adapter class of a model family by name (imported lazily: families have heavy deps)."""
    import importlib

    if family not in FAMILIES:
        raise KeyError(f"unknown model family {family!r}; available: {', '.join(sorted(FAMILIES))}")
    module, name = FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), name)


def adapter_options(family: str) -> dict[str, tuple[object, object]]:
    """The options ``model.kwargs`` may set for ``family``: name → (type annotation, default).
    They are the adapter constructor's keyword arguments (less those with a setting of their own)
    and, for the families with a VAE, ``LOAD_OPTIONS``."""
    cls = adapter_class(family)
    hints = typing.get_type_hints(cls.__init__)
    options = {name: (hints.get(name, typing.Any), p.default)
               for name, p in inspect.signature(cls.__init__).parameters.items()
               if name not in LOADER_ARGUMENTS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    pipeline = getattr(cls, "pipeline_class", None)
    has_vae = pipeline is not None and "vae" in pipeline._get_signature_keys(pipeline)[0]
    if hasattr(cls, "enable_vae_tiling") and has_vae:
        options.update({name: (tp, False) for name, tp in LOAD_OPTIONS.items()})
    return options


def check_adapter_options(family: str, options: dict) -> None:
    """Raise ``ValueError`` naming the first option ``family``'s adapter does not take, or whose
    value has the wrong type."""
    accepted = adapter_options(family)
    cls_name = adapter_class(family).__name__
    for name, value in options.items():
        if name not in accepted:
            own = f" (it has its own setting: model.{name})" if name in LOADER_ARGUMENTS[3:] else ""
            raise ValueError(f"{name!r} is not an option of {cls_name} (model family {family!r}){own}; "
                             f"it accepts: {', '.join(accepted) or 'none'}")
        tp, _ = accepted[name]
        if not _matches(value, tp):
            raise ValueError(f"{name!r} of {cls_name} must be {_type_text(tp)}, got {type(value).__name__} {value!r}")


def _matches(value, tp) -> bool:
    if tp is typing.Any:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp in (int, str, bool):
        return isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
    origin = typing.get_origin(tp) or tp
    return not isinstance(origin, type) or isinstance(value, origin)


def _type_text(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def folder_family(path: str) -> str | None:
    """The family whose pipeline class a local model folder's ``model_index.json`` names, or None
    (a hub id, a folder without one, or a pipeline no family wraps)."""
    import json
    from pathlib import Path

    try:
        index = Path(resolve_model_path(path)) / "model_index.json"
    except ModelNotFoundError:  # the loader says which path was tried
        return None
    if not index.is_file():
        return None
    name = json.loads(index.read_text()).get("_class_name")
    for family in FAMILIES:
        pipeline = getattr(adapter_class(family), "pipeline_class", None)
        if getattr(pipeline, "__name__", None) == name:
            return family
    return None


def check_folder_family(family: str, path: str) -> None:
    """Raise ``ValueError`` when ``path`` is a local folder of another family's pipeline (it would
    otherwise fail deep inside diffusers with a missing-component error)."""
    found = folder_family(path)
    if found is not None and found != family:
        pipeline = adapter_class(found).pipeline_class.__name__
        raise ValueError(f"model {path!r} is a {pipeline} (model family {found!r}), not a {family!r} model: "
                         f"set model.family={found} (flowalign sample/grid/eval: --family {found})")


def load_adapter(family: str, path: str, *, dtype: str = "float32", device="cpu", trained=None,
                 height: int | None = None, width: int | None = None, num_frames: int | None = None,
                 attention: str = "auto", options: dict | None = None):
    """An adapter of ``family`` loaded from ``path`` (a built-in demo name, a local diffusers folder
    or a hub id), ``trained`` weights fused in when given (a ``save_trained`` folder).

    ``options``: ``model.kwargs``, checked against ``adapter_options(family)`` before any weight
    loads. ``attention``: auto | sdpa | xformers | a backend of diffusers' dispatcher (``pipelines.attention``), applied to the
    pipeline's diffusers models before any LoRA or frozen reference copy is made, so those share it.
    ``height``, ``width``, ``num_frames``: passed only when set (families without a size refuse them).
    """
    from pipelines.attention import announce, resolve_attention, set_dispatcher_backend

    cls = adapter_class(family)
    options = dict(options or {})
    check_adapter_options(family, options)
    check_folder_family(family, path)
    backend, message = resolve_attention(attention, device, getattr(cls, "supports_xformers", True))
    switches = {name: options.pop(name) for name in LOAD_OPTIONS if name in options}
    sizes = {k: v for k, v in (("height", height), ("width", width), ("num_frames", num_frames)) if v is not None}
    adapter = cls.from_pretrained(path, dtype=dtype, device=device, trained=trained, **sizes, **options)
    if backend not in ("sdpa", "xformers"):  # a backend of diffusers' attention dispatcher
        message = set_dispatcher_backend(adapter.denoisers().values(), backend)
        backend = "sdpa" if message else backend
    announce(message)
    if backend == "xformers":
        adapter.enable_xformers()
    adapter.attention = backend
    if switches.get("vae_tiling"):
        adapter.enable_vae_tiling()
    if switches.get("vae_slicing"):
        adapter.enable_vae_slicing()
    return adapter


__all__ = ["Adapter", "Conditioning", "ModelNotFoundError", "Schedule", "adapter_class", "adapter_options",
           "check_adapter_options", "check_folder_family", "folder_family", "load_adapter", "resolve_model_path"]
