"""Files a run loads, checked as untrusted input before (or right after) they are used: a local
model folder (``model_index.json``, each component's ``config.json``, its weights' headers) and a
LoRA file (readable, finite, rank-consistent, for modules the model has). Each failure is one
line naming the file and what is wrong (ConfigError); nothing here reads more than headers,
except a LoRA's tensors, which are small.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowalign.errors import ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def _json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: {path}: not UTF-8 text (a corrupt file)") from None
    except ValueError as error:
        raise ConfigError(f"{what}: {path}: not valid JSON ({error}); the file is corrupt") from None


def safetensors_header(path: Path, what: str) -> list[str]:
    """The tensor names of a safetensors file, from its header (the file is fully covered by it:
    a truncated file fails here)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    except Exception as error:  # noqa: BLE001  (SafetensorError, OSError: the file's problem either way)
        raise ConfigError(f"{what}: {path}: not a readable safetensors file ({str(error).splitlines()[0]}); it is "
                          "truncated or corrupt") from None


def check_model_folder(path: str, what: str = "model.path", sizes=(None, None)) -> None:
    """A local diffusers folder a pipeline can load: model_index.json (UTF-8 JSON), every component it
    lists present, each component's config.json valid JSON, each model component's weights present
    and their safetensors headers readable; ``sizes`` (height, width) multiples of what the model
    needs. A path that is not a local folder passes (built-in demo names and hub ids are resolved
    elsewhere)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise ConfigError(f"{what}: {folder}: no model_index.json, so not a diffusers pipeline folder (save one with "
                          "pipeline.save_pretrained, or name a hub id)")
    index = _json(index_file, what)
    if not isinstance(index, dict):
        raise ConfigError(f"{what}: {index_file}: not a mapping of components")
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or spec[0] is None:
            continue
        sub = folder / name
        if not sub.is_dir():
            raise ConfigError(f"{what}: {folder}: model_index.json lists the component {name!r}, but there is no "
                              f"folder {sub}")
        config = sub / "config.json"
        if config.is_file():
            _json(config, what)
            weights = [p for p in sub.iterdir() if p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json")]
            if not weights:
                raise ConfigError(f"{what}: {sub}: the {name} has a config.json but no weights file")
            for file in weights:
                if file.suffix == ".safetensors":
                    safetensors_header(file, what)
    multiple = size_multiple(folder)
    for key, size in zip(("model.height", "model.width"), sizes):
        if size is not None and multiple and size % multiple:
            raise ConfigError(f"{what}: {key} {size} is not a multiple of {multiple} (this model's VAE downsampling × "
                              f"patch size): use {max(multiple, size // multiple * multiple)}")


def size_multiple(folder: Path) -> int | None:
    """The pixel multiple an image size must be for the folder's model: the VAE's downsampling
    (2^(len(block_out_channels) − 1)) × the denoiser's patch size; None when unknown."""
    try:
        vae = json.loads((folder / "vae" / "config.json").read_text())
        scale = 2 ** (len(vae["block_out_channels"]) - 1)
        patch = 1
        for name in ("transformer", "unet"):
            if (folder / name / "config.json").is_file():
                patch = int(json.loads((folder / name / "config.json").read_text()).get("patch_size") or 1)
        return scale * patch
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_lora_file(path: Path, what: str) -> dict:
    """The tensors of a LoRA safetensors file, checked: readable, every value finite, and each
    module's lora_A [r, in] and lora_B [out, r] of one rank r."""
    from safetensors.torch import load_file

    safetensors_header(path, what)
    try:
        state = load_file(str(path))
    except Exception as error:  # noqa: BLE001
        raise ConfigError(f"{what}: {path}: not a readable LoRA ({str(error).splitlines()[0]})") from None
    check_lora_state(state, path, what)
    return state


def check_lora_state(state: dict, path, what: str) -> None:
    import torch

    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ConfigError(f"{what}: {path}: the LoRA holds NaN/Inf in {len(bad)} of {len(state)} tensors (e.g. "
                          f"{bad[0]}); it was saved from a diverged run")
    for key, down in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        up = state.get(key[: -len(".lora_A.weight")] + ".lora_B.weight")
        if up is None:
            raise ConfigError(f"{what}: {path}: the LoRA has {key} but no matching lora_B")
        if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1]:
            raise ConfigError(f"{what}: {path}: a LoRA of inconsistent shape at {key[: -len('.lora_A.weight')]}: "
                              f"lora_A {list(down.shape)}, lora_B {list(up.shape)} (rank must agree)")


def check_lora_fits(state: dict, model, prefix: str, path, what: str) -> None:
    """Every module the LoRA names exists in ``model`` as a layer of the LoRA's in/out sizes."""
    modules = dict(model.named_modules())
    unknown, wrong = [], []
    for key, down in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key[: -len(".lora_A.weight")].removeprefix(prefix + ".")
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if module is None or weight is None:
            unknown.append(name)
        elif weight.ndim == 2 and (weight.shape[1] != down.shape[1]
                                   or weight.shape[0] != state[key.replace("lora_A", "lora_B")].shape[0]):
            wrong.append(f"{name} (LoRA {down.shape[1]}→{state[key.replace('lora_A', 'lora_B')].shape[0]}, "
                         f"layer {weight.shape[1]}→{weight.shape[0]})")
    if unknown:
        raise ConfigError(f"{what}: {path}: the LoRA has weights for {len(unknown)} module(s) this model lacks (e.g. "
                          f"{unknown[:2]}): it was trained on another model")
    if wrong:
        raise ConfigError(f"{what}: {path}: the LoRA's shape does not fit this model at {wrong[:2]}")


LORA_FILE = "pytorch_lora_weights.safetensors"  # a run's final/ and a checkpoint's policy/


def check_policy_weights(weights, load):
    """``load()`` (an adapter with ``weights`` fused in) with ``weights`` checked as untrusted: a LoRA
    file readable, finite and rank-consistent before loading, for modules the loaded model has
    after; a failure to load named with the folder (ConfigError). A LoRA holding fewer target
    kinds than its metadata names is said in a warning."""

    if weights is None:
        return load()
    what = f"weights {weights}"
    lora = Path(weights) / LORA_FILE
    state = read_lora_file(lora, what) if lora.is_file() else None
    try:
        adapter = load()
    except (ConfigError, FileNotFoundError):
        raise
    except Exception as error:  # noqa: BLE001  (diffusers, peft and torch each raise their own)
        raise ConfigError(f"{what}: cannot be loaded into this model ({type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0][:300]})") from None
    if state is not None:
        check_lora_fits(state, adapter.model, adapter.model_folder, lora, what)
        warn_partial(lora, state)
    return adapter


def warn_partial(lora: Path, state: dict) -> None:
    """A warning when the LoRA's metadata names targets it holds no weights for."""
    import sys

    targets = _metadata_targets(lora)
    named = {k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")}
    absent = [t for t in targets if not any(n.endswith("." + t) or n == t for n in named)]
    if absent:
        print(f"flowalign: warning: {lora}: the LoRA's metadata names the targets {targets}, but it holds no "
              f"weights for {absent}: only part of the trained LoRA is applied", file=sys.stderr, flush=True)


def _metadata_targets(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = (f.metadata() or {}).get("lora_adapter_metadata")
    try:
        targets = {k.split(".", 1)[-1]: v for k, v in json.loads(meta or "{}").items()}.get("target_modules") or []
    except ValueError:
        return []
    return sorted(targets) if isinstance(targets, list) else [targets]
