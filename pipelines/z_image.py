"""Adapter for Z-Image and its distilled Z-Image-Turbo (``ZImagePipeline``).

Latents x: [B, C, h, w] (C the VAE's 16 channels, h = H / 8), float32 as the pipeline keeps them.
The transformer takes a list of per-sample latents [C, 1, h, w] and of per-sample caption features
[L_i, D]; it is fed the reversed time 1 − σ (= (1000 − t) / 1000) and predicts −v, so ``predict``
negates its output: v ≈ ε − x0 at timestep t = 1000·σ, as every flow adapter here.

Conditioning: {"embeds": [B, L, D] (Qwen3's second-to-last hidden states of the chat-templated
prompt), "mask": [B, L]}: the pipeline keeps only each prompt's real tokens (a list), so they are
zero-padded to ``max_sequence_length`` (``pad_token_list``) and unpadded again in ``predict``.

Guidance means what ``ZImagePipeline``'s does: guidance_scale g > 0 guides as cond + g·(cond − neg)
against ``negative_prompt`` ("" unless given; the two batched [cond, neg] in one pass, the
pipeline's order), 0 switches CFG off (Turbo: ``guidance_scale=0``, 9 steps, i.e. 8 transformer
calls with nonzero σ plus the last). ``cfg_normalization`` r > 0 caps each guided prediction's norm
at r × the conditional one's; ``cfg_truncation`` τ < 1 drops guidance at steps whose 1 − σ exceeds τ
(per sample, so a trained step with its own t sees the same rule).

Schedule: σ's linspace(1, 1/S, S) set with mu = calculate_shift(the packed sequence length) as the
pipeline sets them (a scheduler with a fixed shift, as Turbo's, ignores mu).
"""

from __future__ import annotations

import copy

import torch
from diffusers import ZImagePipeline
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import DenoiserAdapter, pad_tokens


class ZImageAdapter(DenoiserAdapter):
    """A ``ZImagePipeline`` as the RL core sees it (loading, noise, LoRA, reference, decoding and
    saving: ``DenoiserAdapter``). Options: ``max_sequence_length`` (the pipeline's 512),
    ``negative_prompt``, ``cfg_normalization`` (0: off), ``cfg_truncation`` (1: off)."""

    prediction = "velocity"
    family = "z_image"
    rollout_uncond_supported = False  # its negative branch is its own call, not DenoiserAdapter.guided
    pipeline_class = ZImagePipeline
    model_folder = "transformer"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # every (single-stream) attention, refiners included

    def __init__(self, pipe: ZImagePipeline, *, device: str | torch.device = "cpu", max_sequence_length: int = 512,
                 negative_prompt: str = "", cfg_normalization: float = 0.0, cfg_truncation: float = 1.0,
                 height: int | None = None, width: int | None = None):
        super().__init__(pipe, device=device, height=height, width=width)
        self.check_size(2 * pipe.vae_scale_factor, "Z-Image patchifies 2×2 latents")
        self.scheduler = copy.deepcopy(pipe.scheduler)
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.cfg_normalization = float(cfg_normalization)
        self.cfg_truncation = float(cfg_truncation)

    def default_size(self) -> tuple[int, int]:
        return 1024, 1024  # ZImagePipeline.__call__'s default

    def latent_shape(self) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor
        return (self.model.config.in_channels, self.height // f, self.width // f)

    # -- conditioning --------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """prompts: B strings → {"embeds": [B, L, D], "mask": [B, L]} with L = max_sequence_length."""
        embeds, _ = self.pipe.encode_prompt(list(prompts), device=self.device, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)  # it rewrites the list
        padded = [pad_tokens(e[None], None, self.max_sequence_length) for e in embeds]
        return Conditioning({"embeds": torch.cat([e for e, _ in padded]), "mask": torch.cat([m for _, m in padded])})


    # -- sampling ------------------------------------------------------------------------
    def schedule(self, num_steps: int) -> Schedule:
        """What ``ZImagePipeline`` sets: ``shifted_flow_schedule`` over its packed sequence length."""
        return self.shifted_flow_schedule(num_steps)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 0.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, C, h, w] at timestep t = 1000·σ (scalar or [B]); CFG as the pipeline's when
        guidance_scale > 0 (see the module docstring)."""
        model = self.denoiser if model is None else model
        n = len(x)
        reversed_time = (1000 - self.batch_timesteps(t, n)) / 1000
        scale = torch.full((n,), float(guidance_scale), device=self.device)
        if self.cfg_truncation <= 1:
            scale = torch.where(reversed_time > self.cfg_truncation, torch.zeros_like(scale), scale)
        if not bool((scale > 0).any()):
            return -self._forward(model, x, reversed_time, cond.tensors)
        if self.splits_uncond():  # the negative branch on its own, without a graph (DenoiserAdapter.guided)
            out = self._forward(model, x, reversed_time, cond.tensors)
            with torch.no_grad():
                neg = self._forward(model, x, reversed_time, self.negative_tensors(cond))
            return -self._guide(out, neg, scale)
        negative = self.negative_tensors(cond)  # [cond, neg], the pipeline's order
        tensors = {k: torch.cat([v, negative[k]]) for k, v in cond.tensors.items()}
        out = self._forward(model, torch.cat([x, x]), reversed_time.repeat(2), tensors)
        return -self._guide(out[:n], out[n:], scale)

    def _forward(self, model: nn.Module, x: torch.Tensor, reversed_time: torch.Tensor,
                 tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One transformer pass over latents x [N, C, h, w] at reversed times [N] → its output [N, C, h, w]."""
        inputs = x.to(self.model.dtype).unsqueeze(2)
        captions = [e[m.bool()].to(self.model.dtype) for e, m in zip(tensors["embeds"], tensors["mask"])]
        out = model(list(inputs.unbind(0)), reversed_time, captions, return_dict=False)[0]
        return torch.stack([o.float() for o in out]).squeeze(2)

    def _guide(self, pos: torch.Tensor, neg: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """pos + g·(pos − neg) per sample [B, C, h, w] (g = 0: pos), each capped at cfg_normalization × |pos|."""
        g = scale.view(-1, 1, 1, 1)
        neg = self.uncond_branch(neg)
        guided = pos + g * (pos - neg)
        if self.cfg_normalization > 0:
            pos_norm = torch.linalg.vector_norm(pos.flatten(1), dim=1).view(-1, 1, 1, 1)
            new_norm = torch.linalg.vector_norm(guided.flatten(1), dim=1).view(-1, 1, 1, 1)
            cap = pos_norm * self.cfg_normalization
            guided = torch.where(new_norm > cap, guided * (cap / new_norm), guided)
        return torch.where(g > 0, guided, pos)
