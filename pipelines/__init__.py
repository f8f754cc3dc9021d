"""Model adapters around diffusers pipelines, one per family, and offline tiny-model builders."""

from pipelines.base import Adapter, Conditioning, ModelNotFoundError, Schedule, resolve_model_path

FAMILIES = {"sd3": "pipelines.sd3:SD3Adapter", "sd": "pipelines.sd:SDAdapter", "sdxl": "pipelines.sdxl:SDXLAdapter",
            "flux": "pipelines.flux:FluxAdapter", "wan": "pipelines.wan:WanAdapter"}
FAMILIES["chess"] = "pipelines.chess:ChessAdapter"  # masked discrete diffusion (prediction "logits")


def adapter_class(family: str):
    """The adapter class of a model family by name (imported lazily: families have heavy deps)."""
    import importlib

    if family not in FAMILIES:
        raise KeyError(f"unknown model family {family!r}; available: {', '.join(sorted(FAMILIES))}")
    module, name = FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["Adapter", "Conditioning", "ModelNotFoundError", "Schedule", "adapter_class", "resolve_model_path"]
