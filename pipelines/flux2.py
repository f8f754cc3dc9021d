"""Adapter for FLUX.2 klein (``Flux2KleinPipeline``), the base and the step-distilled checkpoints.

Latents x: [B, 4C, h/2, w/2]: the VAE's latents (C channels, h = H / vae_scale_factor) with 2×2
patches folded into channels and normalised by the VAE's batch-norm statistics: the layout the
pipeline draws its noise in and denoises (its token sequence is x flattened over h/2 · w/2). The
pipeline's ``output_type="latent"`` result is what the VAE decodes: ``vae_latents(x0)``
(un-normalised, unpatchified [B, C, h, w]).

Conditioning: {"embeds": [B, L, 3D]}: Qwen3's hidden states at ``text_encoder_out_layers``
(klein: 9, 18, 27) concatenated per token, the chat-templated prompt padded to
``max_sequence_length`` tokens (the pipeline pads to that length and passes no mask, so every
prompt has the same L). Token ids (T, H, W, L coordinates) are made in ``predict`` as the pipeline
makes them.

Guidance. The base checkpoint (``is_distilled`` false) guides as the pipeline does when
guidance_scale > 1: neg + g·(cond − neg) against the empty prompt, the two batched here in one
pass. The step-distilled checkpoint takes no guidance: guidance_scale must be 1. klein has no
guidance embedding. FLUX.2-dev (``Flux2Pipeline``: a Mistral text encoder, a guidance embedding)
is not this adapter.

Schedule: σ's linspace(1, 1/S, S) shifted with the pipeline's ``compute_empirical_mu(sequence
length, S)``; the transformer takes σ = t / 1000.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from diffusers import Flux2KleinPipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import JOINT_ATTENTION_LORA_TARGETS, DenoiserAdapter

# the double-stream blocks' joint attention, and the single-stream blocks' fused QKV + MLP input projection
LORA_TARGETS = (*JOINT_ATTENTION_LORA_TARGETS, "to_qkv_mlp_proj")


class Flux2KleinAdapter(DenoiserAdapter):
    """A ``Flux2KleinPipeline`` as the RL core sees it (loading, noise, CFG batching, LoRA, reference
    and saving: ``DenoiserAdapter``).

    ``max_sequence_length``: text tokens per prompt (the pipeline's 512); ``text_encoder_out_layers``:
    the Qwen3 hidden states that form the conditioning (klein's 9, 18, 27).
    """

    prediction = "velocity"
    family = "flux2"
    pipeline_class = Flux2KleinPipeline
    model_folder = "transformer"
    lora_targets = LORA_TARGETS

    def __init__(self, pipe: Flux2KleinPipeline, *, device: str | torch.device = "cpu", max_sequence_length: int = 512,
                 text_encoder_out_layers: list[int] | tuple[int, ...] = (9, 18, 27), height: int | None = None,
                 width: int | None = None):
        super().__init__(pipe, device=device, height=height, width=width)
        self.check_size(2 * pipe.vae_scale_factor, "FLUX.2 patchifies 2×2 latents")
        self.scheduler = copy.deepcopy(pipe.scheduler)
        self.max_sequence_length = max_sequence_length
        self.text_encoder_out_layers = tuple(text_encoder_out_layers)
        self.distilled = bool(pipe.config.is_distilled)

    def latent_shape(self) -> tuple[int, ...]:
        f = 2 * self.pipe.vae_scale_factor
        return (self.model.config.in_channels, self.height // f, self.width // f)

    # -- conditioning --------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """prompts: B strings → {"embeds": [B, max_sequence_length, 3D]}."""
        embeds, _ = self.pipe.encode_prompt(prompts, device=self.device, max_sequence_length=self.max_sequence_length,
                                            text_encoder_out_layers=self.text_encoder_out_layers)
        return Conditioning({"embeds": embeds})


    # -- sampling ------------------------------------------------------------------------
    def schedule(self, num_steps: int) -> Schedule:
        """What ``Flux2KleinPipeline`` sets (see the module docstring)."""
        _, h, w = self.latent_shape()
        mu = compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)
        return self.flow_schedule(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, 4C, h/2, w/2] at timestep t = 1000·σ (scalar or [B]); CFG against "" when
        guidance_scale > 1 (base checkpoint only)."""
        if self.distilled and guidance_scale != 1.0:
            raise ValueError(f"this FLUX.2 klein checkpoint is step-distilled (is_distilled): it takes no guidance, "
                             f"guidance_scale must be 1.0, got {guidance_scale}")
        model = self.denoiser if model is None else model
        dtype = self.model.dtype

        def forward(x, tensors):
            n, c, h, w = x.shape
            embeds = tensors["embeds"].to(dtype)
            v = model(hidden_states=self.pipe._pack_latents(x).to(dtype),
                      timestep=self.batch_timesteps(t, n).to(dtype) / 1000, guidance=None,
                      encoder_hidden_states=embeds, txt_ids=self.pipe._prepare_text_ids(embeds).to(self.device),
                      img_ids=self.pipe._prepare_latent_ids(x).to(self.device), return_dict=False)[0]
            return v.permute(0, 2, 1).reshape(n, c, h, w)

        return self.guided(forward, x, cond, guidance_scale)

    # -- decoding ------------------------------------------------------------------------
    def vae_latents(self, x0: torch.Tensor) -> torch.Tensor:
        """x0 [B, 4C, h/2, w/2] → the VAE's latents [B, C, h, w]: un-normalised with its batch-norm
        statistics and unpatchified (the pipeline's ``output_type="latent"``)."""
        bn = self.pipe.vae.bn
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.pipe.vae.config.batch_norm_eps).to(x0)
        return self.pipe._unpatchify_latents(x0 * std + bn.running_mean.view(1, -1, 1, 1).to(x0))
