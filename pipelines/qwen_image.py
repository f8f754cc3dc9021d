"""Adapter for Qwen-Image (``QwenImagePipeline``).

Latents x: [B, C, h, w] with C the VAE's channels (16) and h = H / 8; as with FLUX, the adapter
keeps x unpacked and packs 2×2 patches into the transformer's token sequence [B, (h/2)·(w/2), 4C]
inside ``predict`` (the steps are elementwise, so the pipeline's ``output_type="latent"`` result is
``QwenImagePipeline._pack_latents`` of our samples). The VAE is a (causal 3-D) video VAE: an image
is one frame, and ``decode`` unnormalises with its per-channel latents_mean / latents_std.

Conditioning: {"embeds": [B, L, D] (Qwen2.5-VL's last hidden states of the prompt, after the
pipeline drops its system template), "mask": [B, L] (1 for a prompt token)}, zero-padded to
``max_sequence_length`` tokens so that prompts encoded one by one concatenate (``pad_tokens``).
``predict`` cuts a batch to its longest prompt, as the pipeline pads it (``trim_tokens``).

Guidance. ``guidance_scale`` > 1 is the pipeline's ``true_cfg_scale`` against ``negative_prompt``
(" " unless given; the pipeline guides only when one is passed): two forward passes as the
pipeline makes them, combined as neg + g·(cond − neg) and rescaled per token to the conditional
prediction's norm (the norm over each packed token's 4C channels). Qwen-Image has no guidance
embedding.

Timesteps: the schedule's are the scheduler's 1000·σ; the transformer takes σ = t / 1000.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from diffusers import QwenImagePipeline
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import (JOINT_ATTENTION_LORA_TARGETS, DenoiserAdapter, mean_std_latents, pad_tokens,
                                trim_tokens)


def norm_rescaled_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG on packed predictions [B, N, 4C]: neg + g·(cond − neg), rescaled so that
    each token's norm over its last dimension is the conditional prediction's."""
    combined = uncond + scale * (cond - uncond)
    return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))


class QwenImageAdapter(DenoiserAdapter):
    """A ``QwenImagePipeline`` as the RL core sees it (loading, noise, LoRA, reference and saving:
    ``DenoiserAdapter``).

    ``max_sequence_length``: text tokens kept per prompt (the pipeline's 512); ``negative_prompt``:
    the negative branch of true CFG (Qwen-Image's examples use " ").
    """

    prediction = "velocity"
    family = "qwen_image"
    rollout_uncond_supported = False  # its negative branch is its own call, not DenoiserAdapter.guided
    pipeline_class = QwenImagePipeline
    model_folder = "transformer"
    lora_targets = JOINT_ATTENTION_LORA_TARGETS  # the image and text streams' attention projections

    def __init__(self, pipe: QwenImagePipeline, *, device: str | torch.device = "cpu", max_sequence_length: int = 512,
                 negative_prompt: str = " ", height: int | None = None, width: int | None = None):
        super().__init__(pipe, device=device, height=height, width=width)
        self.check_size(2 * pipe.vae_scale_factor, "Qwen-Image packs 2×2 latent patches")
        self.scheduler = copy.deepcopy(pipe.scheduler)
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt

    def latent_shape(self) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor
        return (self.model.config.in_channels // 4, self.height // f, self.width // f)

    # -- conditioning --------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """prompts: B strings → {"embeds": [B, L, D], "mask": [B, L]} with L = max_sequence_length."""
        embeds, mask = self.pipe.encode_prompt(prompts, device=self.device,
                                               max_sequence_length=self.max_sequence_length)
        embeds, mask = pad_tokens(embeds, mask, self.max_sequence_length)
        return Conditioning({"embeds": embeds, "mask": mask})


    # -- sampling ------------------------------------------------------------------------
    def schedule(self, num_steps: int) -> Schedule:
        """What ``QwenImagePipeline`` sets: ``shifted_flow_schedule`` over its packed sequence length."""
        return self.shifted_flow_schedule(num_steps)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, C, h, w] for unpacked latents x [B, C, h, w] at timestep t = 1000·σ (scalar or
        [B]); true CFG with the norm rescale when guidance_scale > 1 (see the module docstring)."""
        model = self.denoiser if model is None else model
        n, c, h, w = x.shape
        packed = self.pipe._pack_latents(x.to(self.model.dtype), n, c, h, w)
        t = self.batch_timesteps(t, n)
        tensors = cond.tensors
        v = self._forward(model, packed, t, tensors["embeds"], tensors["mask"], tensors, (h, w))
        if guidance_scale > 1.0:
            embeds, mask = self.negative_tokens(cond)
            with torch.no_grad() if self.splits_uncond() else contextlib.nullcontext():
                negative = self.uncond_branch(self._forward(model, packed, t, embeds, mask, tensors, (h, w)))
            v = norm_rescaled_cfg(v, negative, guidance_scale)
        return self.pipe._unpack_latents(v, self.height, self.width, self.pipe.vae_scale_factor).squeeze(2)

    def negative_tokens(self, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """The negative branch's text tokens and mask [B, L, D], [B, L] for the samples of ``cond``."""
        negative = self.negative().tensors
        return (negative["embeds"].expand(len(cond), *negative["embeds"].shape[1:]),
                negative["mask"].expand(len(cond), -1))

    def _forward(self, model: nn.Module, packed: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor,
                 mask: torch.Tensor, tensors: dict[str, torch.Tensor], latent_size: tuple[int, int]) -> torch.Tensor:
        """One transformer pass on packed latents [B, N, 4C] (with an edit's packed input images after
        them, ``tensors["image_latents"]``) → packed velocity [B, N, 4C]."""
        dtype = self.model.dtype
        embeds, mask = trim_tokens(embeds, mask)
        h, w = latent_size
        shapes = [(1, h // 2, w // 2)]
        tokens = packed.shape[1]
        if "image_latents" in tensors:  # Qwen-Image-Edit
            packed = torch.cat([packed, tensors["image_latents"].to(dtype)], dim=1)
            shapes.extend(self.condition_shapes)  # one token grid per input image
        return model(hidden_states=packed, timestep=t.to(dtype) / 1000, guidance=None, encoder_hidden_states_mask=mask,
                     encoder_hidden_states=embeds.to(dtype), img_shapes=[shapes] * len(packed),
                     return_dict=False)[0][:, :tokens]

    # -- decoding ------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] → images float [B, 3, H, W] in [0, 1] (one-frame video VAE)."""
        vae = self.pipe.vae
        latents = mean_std_latents(x0.unsqueeze(2).to(vae.dtype), vae.config)
        images = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)
