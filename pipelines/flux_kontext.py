"""Adapter for FLUX.1-Kontext (``FluxKontextPipeline``): FLUX.1 conditioned on an input image
(editing). Everything is ``FluxAdapter``'s (latents, guidance embedding, true CFG, schedule);
the conditioning adds the input image.

Conditioning: FLUX's {"embeds", "pooled"} and, when ``encode`` is given images, "image_latents"
[B, (h/2)·(w/2), 4C]: the input image, resized to the output's height × width, encoded by the
VAE (its mode, as the pipeline takes it), shifted and scaled, and packed into tokens. ``predict``
appends them after the latent tokens with position ids whose first coordinate is 1 (the
pipeline's), and keeps the prediction of the latent tokens. The negative branch of true CFG
sees the same image. At η = 0 a rollout equals ``pipe(image=input, height=H, width=W,
max_area=H·W, _auto_resize=False)`` for an input of that size (the pipeline otherwise resizes
the output to about a megapixel and the input to a preferred Kontext resolution).
"""

from __future__ import annotations

import torch
from diffusers import FluxKontextPipeline

from pipelines.base import Conditioning, load_condition_image
from pipelines.flux import FluxAdapter


class FluxKontextAdapter(FluxAdapter):
    """A ``FluxKontextPipeline`` as the RL core sees it; options as ``FluxAdapter``'s."""

    family = "flux_kontext"
    pipeline_class = FluxKontextPipeline
    conditioning_image = True  # prompt records carry "image" (flowalign.prompts), encode(prompts, images=)

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list | None = None) -> Conditioning:
        """prompts: B strings, images: B paths or PIL images (optional) → FLUX's conditioning plus
        "image_latents" [B, (h/2)·(w/2), 4C]."""
        cond = super().encode(prompts)
        if images is None:
            return cond
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} conditioning images")
        pixels = torch.cat([self.pipe.image_processor.preprocess(load_condition_image(i, self.height, self.width),
                                                                  self.height, self.width) for i in images])
        latents = self.pipe._encode_vae_image(pixels.to(self.device, self.pipe.vae.dtype), generator=None)
        n, c, h, w = latents.shape
        cond.tensors["image_latents"] = self.pipe._pack_latents(latents, n, c, h, w)
        return cond
