""""Can I run this?": parameters, a training-memory estimate and the download size of a run's
model, without a weight or a download. The trained denoiser is built from its config on PyTorch's
meta device (shapes only, no memory): a shipped config of a real model the recipes name
(``flowalign/model_configs/``, SOURCES.md there), or a local folder's own. The frozen parts
(text encoders, VAE) are counted from ``model_configs/models.json``.

Per process, before sharding (bytes: b = 2 for bfloat16 / float16 weights, 4 for float32):

    frozen weights     P_frozen · b                   (text encoders left out with offload_text_encoders)
    trained weights    P_train · 4 + gradients P_train · 4 + AdamW 8 · P_train (adamw8bit: 2 · P_train)
                       (+ P_train · 4 for the EMA; full fine-tuning with kl_beta > 0: a reference copy P · b)
    activations        per block 34 · s · B · h bytes at 16-bit activations (Korthikanti et al. 2022,
                       "Reducing Activation Recomputation", fused attention: no s² term), twice that in
                       float32; with gradient checkpointing s · B · h · a per block plus one block's full set

s: tokens per sample (latent patches + text tokens), B: train_batch_size (× 2 with CFG in the
training forward), h: hidden width. An estimate for planning (±50 %), not a measurement:
docs/memory.md measures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from flowalign.config import RunConfig

CONFIGS = Path(__file__).parent / "model_configs"
DENOISERS = ("transformer", "transformer_2", "unet", "model")


def _count(n: float) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB"


def local_frozen(folder: Path) -> dict[str, int]:
    """Parameters of a local diffusers folder's other models (text encoders, VAE), each built from
    its config on the meta device (model_index.json names their classes)."""
    import diffusers
    import torch
    import transformers

    index = json.loads((folder / "model_index.json").read_text()) if (folder / "model_index.json").is_file() else {}
    counts = {}
    for name, spec in index.items():
        if name in DENOISERS or not isinstance(spec, list) or spec[0] not in ("diffusers", "transformers") \
                or not (folder / name / "config.json").is_file():
            continue
        # a diffusers / transformers model class named by the folder's model_index.json (not an adapter)
        model_cls = getattr(diffusers if spec[0] == "diffusers" else transformers, spec[1], None)
        if model_cls is None or not hasattr(model_cls, "from_config" if spec[0] == "diffusers" else "_from_config"):
            continue
        with torch.device("meta"):
            model = (model_cls.from_config(model_cls.load_config(folder / name)) if spec[0] == "diffusers"
                     else model_cls._from_config(transformers.AutoConfig.from_pretrained(folder / name)))
        counts[name] = sum(p.numel() for p in model.parameters())
    return counts


def model_facts(path: str) -> dict | None:
    """``models.json``'s entry for a hub id, or None."""
    table = json.loads((CONFIGS / "models.json").read_text())
    return table.get(path)


def denoiser_configs(path: str) -> dict[str, dict]:
    """Component → diffusers config of the trained denoiser(s): shipped for the recipes' hub ids,
    else read from a local diffusers folder ({} when neither)."""
    from pipelines.base import resolve_model_path

    roots = [CONFIGS / path]
    try:
        roots.append(Path(resolve_model_path(path)))
    except FileNotFoundError:
        pass
    for root in roots:
        found = {name: json.loads((root / name / "config.json").read_text()) for name in DENOISERS
                 if (root / name / "config.json").is_file()}
        if found:
            return found
    return {}


def base_is_local(path: str) -> bool:
    from flowalign.model_card import base_kind

    return base_kind(path) != "hub"


def build_on_meta(config: dict):
    """The diffusers model a config describes, on the meta device (no memory)."""
    import diffusers
    import torch

    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def lora_parameters(model, rank: int, targets) -> int:
    """Weights of a rank-``rank`` LoRA on every nn.Linear whose name is a target or ends in
    ``.target`` (peft's matching): rank · (in + out) each."""
    import torch

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            count += rank * (module.in_features + module.out_features)
    return count


def _hidden_and_blocks(cfg: dict) -> tuple[int | None, int]:
    heads, dim = cfg.get("num_attention_heads") or cfg.get("n_heads"), cfg.get("attention_head_dim")
    hidden = cfg.get("dim") or (heads * dim if heads and dim else None)
    blocks = (cfg.get("num_layers") or cfg.get("n_layers") or 0) + (cfg.get("num_single_layers") or 0) \
        + 2 * (cfg.get("n_refiner_layers") or 0)
    return hidden, blocks


def tokens_per_sample(config: RunConfig, facts: dict) -> int:
    """Latent patches at the configured (or default) size and frames, plus the text tokens."""
    m = config.model
    height, width = m.height or facts["default_size"][0], m.width or facts["default_size"][1]
    cell = facts["vae_scale"] * facts["patch"]
    frames = 1
    if facts.get("default_frames"):
        frames = ((m.num_frames or facts["default_frames"]) - 1) // facts["temporal_compression"] + 1
    text = m.kwargs.get("max_sequence_length", facts["text_tokens"]) + facts.get("extra_text_tokens", 0)
    return math.ceil(height / cell) * math.ceil(width / cell) * frames + text


def estimate(config: RunConfig, adapter_cls) -> dict:
    """Parameters, the memory estimate's parts (bytes) and the download size where known."""
    m, t = config.model, config.train
    facts = model_facts(m.path)
    import diffusers

    configs = denoiser_configs(m.path)
    if not configs or not all(hasattr(diffusers, c.get("_class_name", "")) for c in configs.values()):
        return {"known": False}
    models = {name: build_on_meta(cfg) for name, cfg in configs.items()}
    denoiser = sum(p.numel() for model in models.values() for p in model.parameters())
    frozen = facts["frozen"] if facts else {}
    if not facts and base_is_local(m.path):
        from pipelines.base import resolve_model_path

        frozen = local_frozen(Path(resolve_model_path(m.path)))
    known_frozen = sum(v for v in frozen.values() if v)
    from pipelines.denoiser import DenoiserAdapter

    declared = adapter_cls.lora_targets if isinstance(adapter_cls, type) and issubclass(adapter_cls, DenoiserAdapter) \
        else ("to_q", "to_k", "to_v", "to_out.0")
    targets = m.lora_targets or declared
    trained = (sum(lora_parameters(model, m.lora_rank, targets) for model in models.values()) if m.lora_rank
               else denoiser)
    b = 4 if m.dtype == "float32" else 2
    text_encoders = sum(v for k, v in frozen.items() if v and k.startswith(("text_encoder", "image_encoder")))
    weights = (known_frozen - (text_encoders if m.offload_text_encoders else 0)) * b
    weights += denoiser * b if m.lora_rank else 0
    optimizer = trained * (4 + 4 + (2 if t.optimizer == "adamw8bit" else 8))
    optimizer += trained * 4 if t.ema_decay > 0 else 0
    optimizer += denoiser * b if not m.lora_rank and t.kl_beta > 0 else 0
    out = {"known": True, "denoiser": denoiser, "trained": trained, "frozen": frozen, "weights": weights,
           "optimizer": optimizer, "dtype_bytes": b, "activations": None, "download": None}
    hidden, blocks = _hidden_and_blocks(next(iter(configs.values())))
    if facts and hidden and blocks:
        s = tokens_per_sample(config, facts)
        batch = t.train_batch_size * (2 if config.sampling.guidance_scale > 1 else 1)
        a = 2 if (t.mixed_precision != "no" or m.dtype != "float32") else 4
        per_block = 17 * s * batch * hidden * a
        out["activations"] = (blocks * s * batch * hidden * a + per_block if m.gradient_checkpointing
                              else blocks * per_block)
        out.update(tokens=s, batch=batch)
    if facts and all(frozen.values()):
        out["download"] = (known_frozen + denoiser) * 2  # the repositories' 16-bit safetensors
    return out


def lines(config: RunConfig, adapter_cls) -> list[tuple[str, str]]:
    """The dry run's "can I run this?" lines."""
    from flowalign.model_card import KNOWN_BASES, base_kind

    m = config.model
    try:
        e = estimate(config, adapter_cls)
    except (ImportError, AttributeError, TypeError, ValueError) as error:  # a config this diffusers cannot build
        return [("parameters", f"not estimated ({type(error).__name__}: {str(error).splitlines()[0]})")]
    out = []
    if not e["known"]:
        out.append(("parameters", f"not estimated: no diffusers config of {m.path} shipped "
                                  "(flowalign/model_configs/) or on disk"))
    else:
        frozen = ", ".join(f"{k} {_count(v)}" if v else f"{k} unknown" for k, v in e["frozen"].items())
        out.append(("parameters", f"denoiser {_count(e['denoiser'])} (its config on the meta device)"
                                  + (f"; frozen: {frozen}" if frozen else "")
                                  + f"; trained {e['trained'] / 1e6:.1f} M"
                                  + (f" (LoRA rank {m.lora_rank})" if m.lora_rank else " (full fine-tuning)")))
        parts = [f"weights {_gb(e['weights'])}", f"trained state {_gb(e['optimizer'])}"]
        total = e["weights"] + e["optimizer"]
        if e["activations"] is not None:
            parts.append(f"activations {_gb(e['activations'])} ({e['tokens']} tokens × batch {e['batch']}"
                         f"{', gradient checkpointing' if m.gradient_checkpointing else ''})")
            total += e["activations"]
        else:
            parts.append("activations not estimated")
        out.append(("memory estimate", f"≈ {_gb(total)} per process on the accelerator ({', '.join(parts)}; "
                                       "±50 %, before FSDP / ZeRO sharding; flowalign/memory_estimate.py)"))
        out.append(("download", f"≈ {_gb(e['download'])} (every component at 16 bits per weight)"
                    if e["download"] else "size not known (a component's size is missing in models.json)"
                    if base_kind(m.path) == "hub" else "none (a local or built-in model)"))
    if m.path in KNOWN_BASES:
        license, name, link, gated = KNOWN_BASES[m.path]
        text = f"{name} ({link})" if name else license
        out.append(("license", text + ("; a gated repository: accept its terms on the hub page and log in "
                                       "(`hf auth login` or HF_TOKEN) before the first run" if gated else "")))
    return out
