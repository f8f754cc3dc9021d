"""The trained model of a run: the adapter loaded and checked, the prompt cache, LoRA or full
fine-tuning, gradient checkpointing, the optimizer, all prepared by Accelerate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowalign.config import RunConfig
from flowalign.preflight import check_loaded_adapter
from pipelines import load_adapter
from pipelines.base import PromptEmbeddingCache


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
    if m.lora_rank > 0:
        with torch.random.fork_rng(devices=[]):  # the LoRA's random init is part of the run's seed
            torch.manual_seed(t.seed)
            adapter.add_lora(m.lora_rank, m.lora_alpha, m.lora_targets)
    else:
        adapter.enable_full_finetune(keep_reference=t.kl_beta > 0)
    if m.gradient_checkpointing:
        adapter.enable_gradient_checkpointing()
    params = [p for p in adapter.trainable().parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, betas=tuple(t.adam_betas), weight_decay=t.weight_decay)
    model, optimizer = accelerator.prepare(adapter.trainable(), optimizer)
    return TrainedModel(adapter, encode, params, model, optimizer)
