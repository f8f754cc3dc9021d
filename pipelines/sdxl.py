"""Adapter for Stable Diffusion XL (``StableDiffusionXLPipeline``); the UNet family's common part
(DDIM schedule, CFG, predict) is ``pipelines/unet.py``.

Conditioning: {"embeds": [B, L, D1 + D2] (both encoders' penultimate hidden states),
"pooled": [B, P] (the second encoder's projection, the UNet's ``text_embeds``), "time_ids":
[B, 6] (original size, crop top-left, target size = (H, W), (0, 0), (H, W), the pipeline's
defaults)}. The negative is what the pipeline uses with no negative prompt: zeros when its
config has ``force_zeros_for_empty_prompt`` (SDXL base), else the empty prompt's encoding.
"""

from __future__ import annotations

import torch
from diffusers import StableDiffusionXLPipeline

from pipelines.base import Conditioning
from pipelines.unet import UNetAdapter


class SDXLAdapter(UNetAdapter):
    family = "sdxl"
    pipeline_class = StableDiffusionXLPipeline
    added_conditions = {"pooled": "text_embeds", "time_ids": "time_ids"}

    def encode_pair(self, prompts: list[str], negative: bool) -> tuple[Conditioning, Conditioning | None]:
        embeds, negative_embeds, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=negative)
        time_ids = torch.tensor([[self.height, self.width, 0, 0, self.height, self.width]], dtype=torch.float32,
                                device=self.device).expand(len(prompts), -1)
        positive = Conditioning({"embeds": embeds, "pooled": pooled, "time_ids": time_ids})
        if not negative:
            return positive, None
        return positive, Conditioning({"embeds": negative_embeds, "pooled": negative_pooled, "time_ids": time_ids})

    def vae_latents(self, x0: torch.Tensor) -> torch.Tensor:
        """x0·latents_std / scaling_factor + latents_mean when the VAE config has them, else x0 / scaling_factor."""
        config = self.pipe.vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is None or std is None:
            return super().vae_latents(x0)
        shape = (1, -1, 1, 1)
        mean, std = torch.tensor(mean).view(shape).to(x0), torch.tensor(std).view(shape).to(x0)
        return x0 * std / config.scaling_factor + mean

    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        if vae.dtype == torch.float16 and vae.config.force_upcast:  # SDXL's VAE overflows in float16
            vae.to(torch.float32)
            try:
                return super().decode(x0)
            finally:
                vae.to(torch.float16)
        return super().decode(x0)
