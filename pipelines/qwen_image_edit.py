"""Adapter for Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image conditioned on an input
image. Latents, schedule, true CFG with its norm rescale and decoding are ``QwenImageAdapter``'s.

Conditioning, from ``encode(prompts, images)`` (an edit needs its image), per sample:

* "embeds", "mask": Qwen2.5-VL's hidden states of the edit template with the instruction *and the
  input image* (its vision tokens are part of the prompt), padded to ``max_sequence_length``;
* "negative_embeds", "negative_mask": the same for ``negative_prompt`` with the same image (the
  pipeline encodes its negative prompt with the image too, so the negative branch is per sample);
* "image_latents" [B, N_img, 4C]: the input image resized to the pipeline's condition size, VAE
  mode latents normalised by latents_mean / latents_std, packed; ``predict`` appends them after
  the latent tokens (``img_shapes`` lists both grids) and keeps the prediction of the latent tokens.

The condition size is the pipeline's: ``condition_area`` pixels (1024² for the real model) at the
input's aspect ratio, multiples of 32 (``calculate_dimensions``); every input of a run must have
the same aspect ratio (one token count). At η = 0 a rollout equals ``QwenImageEditPipeline`` with
the same image, height and width. Qwen-Image-Edit-Plus (several input images,
``QwenImageEditPlusPipeline``) is not covered.
"""

from __future__ import annotations

import torch
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

from pipelines.base import Conditioning
from pipelines.denoiser import pad_tokens
from pipelines.qwen_image import QwenImageAdapter


class QwenImageEditAdapter(QwenImageAdapter):
    """A ``QwenImageEditPipeline`` as the RL core sees it; options as ``QwenImageAdapter``'s."""

    family = "qwen_image_edit"
    pipeline_class = QwenImageEditPipeline
    conditioning_image = True  # prompt records carry "image" (flowalign.prompts), encode(prompts, images=)
    condition_area = 1024 * 1024  # the pipeline's condition size (calculate_dimensions' target area)

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list | None = None) -> Conditioning:
        """prompts: B instructions, images: B paths or PIL images → the conditioning above."""
        from PIL import Image

        if images is None or len(images) != len(prompts):
            raise ValueError("Qwen-Image-Edit needs one conditioning image per prompt (prompt records with \"image\")")
        parts = []
        for prompt, image in zip(prompts, images):
            image = (Image.open(image) if isinstance(image, str) else image).convert("RGB")
            width, height, _ = calculate_dimensions(self.condition_area, image.size[0] / image.size[1])
            shape = (1, height // self.pipe.vae_scale_factor // 2, width // self.pipe.vae_scale_factor // 2)
            if getattr(self, "condition_shape", shape) != shape:
                raise ValueError(f"conditioning images of one run must share an aspect ratio: {shape} after "
                                 f"{self.condition_shape}")
            self.condition_shape = shape
            picture = self.pipe.image_processor.resize(image, height, width)
            tensors = {}
            for key, text in (("", prompt), ("negative_", self.negative_prompt)):
                embeds, mask = self.pipe.encode_prompt([text], image=picture, device=self.device,
                                                       max_sequence_length=self.max_sequence_length)
                tensors[f"{key}embeds"], tensors[f"{key}mask"] = pad_tokens(embeds, mask, self.max_sequence_length)
            pixels = self.pipe.image_processor.preprocess(picture, height, width).unsqueeze(2)
            latents = self.pipe._encode_vae_image(pixels.to(self.device, self.pipe.vae.dtype), generator=None)
            n, c, _, h, w = latents.shape
            tensors["image_latents"] = self.pipe._pack_latents(latents, n, c, h, w)
            parts.append(Conditioning(tensors))
        return Conditioning.cat(parts)

    def negative(self) -> Conditioning:
        raise RuntimeError("Qwen-Image-Edit's negative branch depends on the input image: it is in each sample's "
                           "conditioning (negative_embeds, negative_mask)")

    def negative_tokens(self, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        return cond.tensors["negative_embeds"], cond.tensors["negative_mask"]
