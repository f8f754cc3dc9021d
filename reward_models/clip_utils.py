"""Plumbing shared by the CLIP-family rewards (aesthetic, clip_score, pickscore, hpsv2).

Every loader takes a hub id or a local folder; a path that does not exist, or a hub id that
cannot be fetched, raises ``ModelNotFoundError`` naming what was tried. Heavy libraries
(transformers, open_clip) are imported inside the functions, so importing a reward module is cheap.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from pipelines.base import ModelNotFoundError

OPEN_CLIP_CONFIG = "open_clip_config.json"


def pick_device(device: str | torch.device | None) -> torch.device:
    """``None`` → the GPU when there is one, else the CPU."""
    return torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")


def to_uint8(samples: torch.Tensor) -> torch.Tensor:
    """samples float [B, 3, H, W] in [0, 1] → uint8 [B, 3, H, W] on the CPU.

    The reference pipelines score 8-bit images (ddpo-pytorch rounds ``x · 255``), so we do too.
    """
    return (samples.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def to_pil(samples: torch.Tensor) -> list[Image.Image]:
    """samples float [B, 3, H, W] in [0, 1] → B RGB PIL images."""
    return [Image.fromarray(a) for a in to_uint8(samples).permute(0, 2, 3, 1).numpy()]


def normalize(features: torch.Tensor) -> torch.Tensor:
    """features [B, D] → unit L2 norm along D."""
    return features / features.norm(dim=-1, keepdim=True)


def projected(output) -> torch.Tensor:
    """The embedding from ``CLIPModel.get_{image,text}_features``: transformers 4.x returns the
    tensor, 5.x a ModelOutput whose ``pooler_output`` holds the projected embedding [B, D]."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def load_state_dict_file(path: str, what: str) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file or a ``torch.save`` file (loaded with
    ``weights_only=True``: tensors only, no pickled code)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelNotFoundError(f"{what} not found: tried {file.resolve()}")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    state = torch.load(file, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)  # a Lightning checkpoint nests it


def resolve_local_or_hub(name_or_path: str, what: str) -> tuple[str, bool]:
    """(path, True) for an existing local file or folder, (hub id, False) otherwise.

    Like ``pipelines.base.resolve_model_path``, but for files too and with a reward's wording:
    anything that looks like a path (starts with ``.``, ``/`` or ``~``, or has two or more
    ``/``) must exist, and the error names the absolute path tried.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path), True
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelNotFoundError(f"{what} not found: tried {path.resolve()}")
    return name_or_path, False


def hub_failure(what: str, name: str, error: Exception, hint: str) -> ModelNotFoundError:
    first = str(error).splitlines()[0] if str(error) else ""
    return ModelNotFoundError(f"could not load {what} {name!r}: no local path {Path(name).expanduser().resolve()} "
                              f"and the hub id failed ({type(error).__name__}: {first}). {hint}")


def load_transformers(cls, name_or_path: str, what: str, **kwargs):
    """``cls.from_pretrained`` on a hub id or a local folder saved with ``save_pretrained``."""
    resolved, local = resolve_local_or_hub(name_or_path, what)
    try:
        return cls.from_pretrained(resolved, **kwargs)
    except OSError as error:
        if local:
            raise
        raise hub_failure(what, name_or_path, error, "Pass a local folder saved with save_pretrained.") from error


def open_clip_id(name_or_path: str) -> str:
    """A local open_clip folder (``open_clip_config.json`` + weights, the layout of an open_clip hub
    repo) → ``"local-dir:FOLDER"``; ``"hf-hub:org/repo"`` or a bare ``"org/repo"`` that is not a
    folder → ``"hf-hub:org/repo"``."""
    if name_or_path.startswith("hf-hub:"):
        return name_or_path
    name = name_or_path.removeprefix("local-dir:")
    resolved, local = resolve_local_or_hub(name, "open_clip model folder")
    if local:
        if not (Path(resolved) / OPEN_CLIP_CONFIG).is_file():
            raise ModelNotFoundError(f"not an open_clip folder: {Path(resolved).resolve() / OPEN_CLIP_CONFIG} "
                                     "is missing (expected open_clip_config.json + open_clip_pytorch_model.bin "
                                     "or open_clip_model.safetensors)")
        return f"local-dir:{resolved}"
    if name_or_path.startswith("local-dir:"):
        raise ModelNotFoundError(f"open_clip model folder not found: tried {Path(name).expanduser().resolve()}")
    return f"hf-hub:{resolved}"


def load_open_clip(name_or_path: str, device: torch.device, load_weights: bool = True):
    """An open_clip model (eval mode, on ``device``), its evaluation transform (PIL → [3, S, S])
    and tokenizer, from a hub id or a local folder; with ``load_weights=False`` also from a
    built-in architecture name (``"ViT-H-14"``: random weights the caller then overwrites)."""
    import open_clip

    if name_or_path in open_clip.list_models():
        if load_weights:  # a bare architecture name has no weights: it would score noise
            raise ValueError(f"{name_or_path!r} is an open_clip architecture without weights; pass a hub id "
                             "(hf-hub:org/repo) or a local open_clip folder")
        model_id = name_or_path
    else:
        model_id = open_clip_id(name_or_path)
    try:
        # load_weights=False skips weights that the caller overwrites (open_clip ≥ 3 knows the flag)
        extra = {} if load_weights else {"load_weights": False}
        model, _, preprocess = open_clip.create_model_and_transforms(model_id, device=device, **extra)
        tokenizer = open_clip.get_tokenizer(model_id)
    except (OSError, RuntimeError) as error:
        if not model_id.startswith("hf-hub:"):
            raise
        raise hub_failure("open_clip model", name_or_path, error,
                          "Pass a local open_clip folder (open_clip_config.json + weights).") from error
    return model.eval(), preprocess, tokenizer
