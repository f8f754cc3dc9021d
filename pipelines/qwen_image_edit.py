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

from pipelines.base import Conditioning, load_image
from pipelines.denoiser import pad_tokens
from pipelines.qwen_image import QwenImageAdapter


class QwenImageEditAdapter(QwenImageAdapter):
    """A ``QwenImageEditPipeline`` as the RL core sees it; options as ``QwenImageAdapter``'s."""

    family = "qwen_image_edit"
    pipeline_class = QwenImageEditPipeline
    conditioning_image = True  # prompt records carry "image" (flowalign.prompts), encode(prompts, images=)
    condition_area = 1024 * 1024  # the pipeline's condition size (calculate_dimensions' target area)
    several_images = False  # Edit-Plus: a list of input images per prompt

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list | None = None) -> Conditioning:
        """prompts: B instructions, images: B paths or PIL images (Edit-Plus: each may be a list of
        them) → the conditioning above."""
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{self.pipeline_class.__name__} needs conditioning images for each prompt (prompt "
                             "records with \"image\")")
        parts = []
        for prompt, group in zip(prompts, images):
            group = list(group) if isinstance(group, (list, tuple)) else [group]
            if len(group) > 1 and not self.several_images:
                raise ValueError(f"Qwen-Image-Edit takes one input image per prompt, {prompt!r} has {len(group)} "
                                 "(several: model.family=qwen_image_edit_plus)")
            prepared = [self._prepare(load_image(image)) for image in group]
            shapes = [shape for _, _, shape in prepared]
            if getattr(self, "condition_shapes", shapes) != shapes:
                raise ValueError(f"the input images of one run must share their number and aspect ratios (one token "
                                 f"layout): {shapes} after {self.condition_shapes}")
            self.condition_shapes = shapes
            prompt_images = [picture for picture, _, _ in prepared]
            tensors = {}
            for key, text in (("", prompt), ("negative_", self.negative_prompt)):
                embeds, mask = self.pipe.encode_prompt(
                    [text], image=prompt_images if self.several_images else prompt_images[0], device=self.device,
                    max_sequence_length=self.max_sequence_length)
                tensors[f"{key}embeds"], tensors[f"{key}mask"] = pad_tokens(embeds, mask, self.max_sequence_length)
            packed = []
            for _, pixels, _ in prepared:
                latents = self.pipe._encode_vae_image(pixels.to(self.device, self.pipe.vae.dtype), generator=None)
                n, c, _, h, w = latents.shape
                packed.append(self.pipe._pack_latents(latents, n, c, h, w))
            tensors["image_latents"] = torch.cat(packed, dim=1)  # the images' tokens one after another
            parts.append(Conditioning(tensors))
        return Conditioning.cat(parts)

    def _prepare(self, image):
        """One input image (RGB PIL) → (what the text encoder sees, the VAE's pixels [1, 3, 1, H', W'],
        its token grid (1, H'/16, W'/16)): both at the condition size (``calculate_dimensions``)."""
        width, height, _ = calculate_dimensions(self.condition_area, image.size[0] / image.size[1])
        picture = self.pipe.image_processor.resize(image, height, width)
        pixels = self.pipe.image_processor.preprocess(picture, height, width).unsqueeze(2)
        return picture, pixels, self._grid(height, width)

    def _grid(self, height: int, width: int) -> tuple[int, int, int]:
        f = self.pipe.vae_scale_factor
        return (1, height // f // 2, width // f // 2)

    def negative(self) -> Conditioning:
        raise RuntimeError("Qwen-Image-Edit's negative branch depends on the input image: it is in each sample's "
                           "conditioning (negative_embeds, negative_mask)")

    def negative_tokens(self, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        return cond.tensors["negative_embeds"], cond.tensors["negative_mask"]
