"""The trained model of a run: the adapter loaded and checked, the prompt cache, LoRA (random, or
read from ``model.init_lora``) or full fine-tuning, gradient checkpointing, TF32, the optimizer
(AdamW or bitsandbytes' 8-bit AdamW), all prepared by Accelerate.

``check_setup`` is the part that needs no weights (preflight calls it before any model loads): the
init LoRA folder and its format, and that bitsandbytes imports and steps on this machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from flowalign.config import ConfigError, RunConfig, source_of
from flowalign.logs import get_logger
from flowalign.preflight import check_loaded_adapter
from pipelines import load_adapter
from pipelines.base import PromptEmbeddingCache

log = get_logger("model_setup")
DIFFUSERS_LORA = "pytorch_lora_weights.safetensors"  # what a run's final/ holds (save_lora_weights)
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # peft's save_pretrained
PEFT_PREFIX = "base_model.model."  # peft's PeftModel prefixes every key with it
UNSUPPORTED_LORA = ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern")  # set: refused, not approximated


@dataclass
class TrainedModel:
    adapter: object
    encode: object  # prompts → Conditioning (the prompt cache when on)
    params: list  # the parameters that train
    model: torch.nn.Module  # the prepared (DDP / FSDP) trainable module
    optimizer: torch.optim.Optimizer


def build_model(config: RunConfig, accelerator, objective_cls, adapter=None) -> TrainedModel:
    """``adapter``: one already loaded (``flowalign.train(adapter=...)``), on the run's device; its
    LoRA or full fine-tuning is set up on it in place. None: ``model.path`` is loaded."""
    m, t = config.model, config.train
    # attention is set here, before the LoRA and any frozen reference copy; num_frames only when set
    if adapter is None:
        adapter = load_adapter(m.family, m.path, dtype=m.dtype, device=accelerator.device, height=m.height,
                               width=m.width, num_frames=m.num_frames, attention=m.attention, options=m.kwargs)
    check_loaded_adapter(config, adapter, objective_cls)
    adapter.detach_uncond = t.detach_uncond  # the guided prediction's gradient (pipelines/denoiser.py)
    encode = PromptEmbeddingCache(adapter, m.prompt_cache_size, offload=m.offload_text_encoders) \
        if m.prompt_cache_size else adapter.encode
    set_tf32(t.allow_tf32, accelerator.device)
    if m.lora_rank > 0:
        with torch.random.fork_rng(devices=[]):  # the LoRA's random init is part of the run's seed
            torch.manual_seed(t.seed)
            if m.init_lora:  # its random init is overwritten, but drawn here all the same
                init_lora(adapter, m.init_lora, source_of(config, "model.init_lora"))
            else:
                adapter.add_lora(m.lora_rank, m.lora_alpha, m.lora_targets)
    else:
        adapter.enable_full_finetune(keep_reference=t.kl_beta > 0)
    if m.gradient_checkpointing:
        adapter.enable_gradient_checkpointing()
    params = [p for p in adapter.trainable().parameters() if p.requires_grad]
    optimizer = make_optimizer(params, t)
    model, optimizer = accelerator.prepare(adapter.trainable(), optimizer)
    if t.compile:
        compile_denoisers(adapter)
    return TrainedModel(adapter, encode, params, model, optimizer)


def compile_denoisers(adapter) -> None:
    """``train.compile``: each denoiser's forward compiled in place (``nn.Module.compile``), so that the
    rollouts, the training forward (through any wrapper) and the reference policy all run it, and the
    state dict keeps its keys. Compiled once per input shape and LoRA state (guards), then reused."""
    from pipelines.denoiser import DenoiserAdapter

    denoisers = adapter.denoisers() if isinstance(adapter, DenoiserAdapter) else {"model": adapter.model}
    for module in denoisers.values():
        module.compile()


# -- the optimizer and TF32 -------------------------------------------------------------------
def make_optimizer(params: list, t) -> torch.optim.Optimizer:
    """``train.optimizer``: torch's AdamW, or bitsandbytes' AdamW8bit (both moments quantised to 8 bits
    blockwise; tensors under 4096 values, e.g. most LoRA matrices, keep 32-bit state)."""
    kwargs = dict(lr=t.learning_rate, betas=tuple(t.adam_betas), weight_decay=t.weight_decay)
    if t.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def set_tf32(enabled: bool, device) -> str | None:
    """``train.allow_tf32``: TF32 for float32 matmuls (cuBLAS) and convolutions (cuDNN) on CUDA; on
    another device nothing is set and one line says so. Returns that line (None when nothing to say)."""
    if not enabled:
        return None
    if torch.device(device).type != "cuda":
        line = f"train.allow_tf32: the run is on {torch.device(device).type}, not CUDA; nothing to set"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        line = "train.allow_tf32: float32 matmuls and convolutions run in TF32"
    log.info(line)
    return line


# -- starting from an existing LoRA ------------------------------------------------------------
def read_lora(path: str | Path, prefix: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A LoRA folder → (rank, alpha and targets as peft's LoraConfig names them: ``r``,
    ``lora_alpha``, ``target_modules``; the weights in peft naming, ``<module>.lora_A.weight`` with
    no model prefix). Two layouts: diffusers' (a run's ``final/``: ``pytorch_lora_weights.safetensors``,
    keys ``<prefix>.<module>...``, its peft config in the file's ``lora_adapter_metadata``; a file
    without it: rank from ``lora_A``, alpha = rank, targets = the modules named) and peft's
    (``adapter_config.json`` + ``adapter_model.safetensors``). ValueError naming what is wrong."""
    from safetensors import safe_open

    from flowalign.untrusted import check_lora_state, safetensors_header

    path = Path(path)
    for weights in (path / DIFFUSERS_LORA, path / PEFT_WEIGHTS):
        if weights.is_file():
            safetensors_header(weights, "model.init_lora")  # a truncated or foreign file named, not a traceback
    if (path / DIFFUSERS_LORA).is_file():
        with safe_open(str(path / DIFFUSERS_LORA), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
            state = {k: f.get_tensor(k) for k in f.keys()}
        state = {k.removeprefix(prefix + "."): v for k, v in state.items()}
        config = {k.removeprefix(prefix + "."): v for k, v in meta.items()}
    elif (path / PEFT_CONFIG).is_file() and (path / PEFT_WEIGHTS).is_file():
        config = json.loads((path / PEFT_CONFIG).read_text())
        with safe_open(str(path / PEFT_WEIGHTS), "pt") as f:
            state = {k.removeprefix(PEFT_PREFIX): f.get_tensor(k) for k in f.keys()}
    else:
        raise ValueError(f"{path}: neither {DIFFUSERS_LORA} (a run's final/) nor {PEFT_CONFIG} + {PEFT_WEIGHTS} "
                         "(a peft adapter folder)")
    check_lora_state(state, path, "model.init_lora")
    down = {k[: -len(".lora_A.weight")]: v for k, v in state.items() if k.endswith(".lora_A.weight")}
    if not down or any(not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight")) for k in state):
        odd = [k for k in state if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight"))]
        raise ValueError(f"{path}: not a LoRA in peft / diffusers naming (<module>.lora_A.weight, .lora_B.weight); "
                         f"found keys such as {(odd or list(state))[:3]}")
    if config.get("peft_type", "LORA") != "LORA" or any(config.get(k) for k in UNSUPPORTED_LORA):
        used = [k for k in ("peft_type", *UNSUPPORTED_LORA) if config.get(k) and config.get(k) != "LORA"]
        raise ValueError(f"{path}: a LoRA with {', '.join(used)} is not supported as model.init_lora (plain LoRA only)")
    ranks = {v.shape[0] for v in down.values()}
    if "r" not in config and len(ranks) > 1:
        raise ValueError(f"{path}: its layers have different ranks {sorted(ranks)} and no config says which")
    rank = int(config.get("r") or ranks.pop())
    targets = config.get("target_modules") or sorted(down)
    return {"r": rank, "lora_alpha": config.get("lora_alpha") or rank,
            "target_modules": sorted(targets) if isinstance(targets, list) else targets}, state


def init_lora(adapter, path: str, where: str = "config") -> None:
    """Attach the LoRA at ``path`` (``read_lora``) to the adapter's denoiser, trainable, every
    weight of it loaded: the run starts exactly where that LoRA's run ended."""
    from flowalign.untrusted import check_lora_fits, warn_partial

    if len(adapter.denoisers()) != 1:
        raise ConfigError(f"{where}: model.init_lora: a family with several denoisers "
                          f"({', '.join(adapter.denoisers())}) cannot start from one LoRA folder")
    try:
        config, state = read_lora(path, adapter.model_folder)
    except ValueError as error:
        raise ConfigError(f"{where}: model.init_lora: {error}") from None
    targets = config["target_modules"]
    check_lora_fits(state, adapter.model, adapter.model_folder, path, f"{where}: model.init_lora")
    try:
        adapter.add_lora(config["r"], config["lora_alpha"], [targets] if isinstance(targets, str) else targets)
    except Exception as error:  # noqa: BLE001  (peft: targets this model lacks)
        raise ConfigError(f"{where}: model.init_lora: {path}: its targets do not fit this model ({type(error).__name__}:"
                          f" {str(error).splitlines()[0][:200]})") from None
    expected = set(adapter.trained_state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ConfigError(f"{where}: model.init_lora: {path} does not fit this model: "
                          f"{len(missing)} LoRA weights missing (e.g. {missing[:2]}), {len(extra)} unknown "
                          f"(e.g. {extra[:2]})")
    adapter.load_trained_state_dict(state)
    if (Path(path) / DIFFUSERS_LORA).is_file():
        warn_partial(Path(path) / DIFFUSERS_LORA, {f"{adapter.model_folder}.{k}": v for k, v in state.items()})
    log.info("model.init_lora: started from %s (rank %d, alpha %g, %d LoRA tensors)", path, config["r"],
             config["lora_alpha"], len(state))


def check_setup(config: RunConfig) -> None:
    """What needs no weights: the init LoRA folder holds a LoRA we read (its tensors are checked
    against the model once it loads); 8-bit AdamW's bitsandbytes imports and takes a step here."""
    m, t = config.model, config.train
    if m.init_lora:
        where = source_of(config, "model.init_lora")
        if not Path(m.init_lora).is_dir():
            raise ConfigError(f"{where}: model.init_lora: no folder {Path(m.init_lora).resolve()}")
        try:
            read_lora(m.init_lora, "transformer")  # the prefix only renames keys; here: the format
        except ValueError as error:
            raise ConfigError(f"{where}: model.init_lora: {error}") from None
    if t.optimizer == "adamw8bit":
        check_bitsandbytes(source_of(config, "train.optimizer"))


def check_bitsandbytes(where: str = "config") -> None:
    """bitsandbytes imports and its AdamW8bit steps on this machine's device (CUDA when there is
    one, else the CPU), on one 4096-value tensor: its smallest 8-bit case. ConfigError otherwise."""
    install = 'pip install bitsandbytes  (or: pip install "flowalign[bnb]")'
    try:
        import bitsandbytes as bnb
    except Exception as error:  # noqa: BLE001  (ImportError, or a broken native library)
        raise ConfigError(f"{where}: train.optimizer: adamw8bit needs bitsandbytes, which does not import "
                          f"({type(error).__name__}: {error}); install it with `{install}`, or use "
                          "train.optimizer=adamw") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        weight = torch.nn.Parameter(torch.zeros(4096, device=device))
        weight.grad = torch.ones_like(weight)
        bnb.optim.AdamW8bit([weight], lr=1e-3).step()
    except Exception as error:  # noqa: BLE001
        raise ConfigError(f"{where}: train.optimizer: bitsandbytes {getattr(bnb, '__version__', '?')} cannot run "
                          f"AdamW8bit on {device} here ({type(error).__name__}: {error}); use "
                          "train.optimizer=adamw") from None
