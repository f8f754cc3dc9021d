"""Adapter for Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``, Qwen-Image-Edit-2509 and later):
Qwen-Image-Edit with several input images per prompt. Everything is ``QwenImageEditAdapter``'s
(latents, schedule, true CFG with the per-sample negative branch, decoding, LoRA); what differs is
how the inputs are prepared, as the pipeline prepares them:

* the text encoder sees each input resized to ``prompt_image_area`` pixels (384², the pipeline's
  ``CONDITION_IMAGE_SIZE``) at its aspect ratio, announced in the prompt as "Picture 1: …",
  "Picture 2: …" before the instruction;
* the VAE encodes each input at ``condition_area`` pixels (1024², ``VAE_IMAGE_SIZE``);
  "image_latents" [B, N_1 + N_2 + …, 4C] holds the inputs' packed tokens one after another, and
  ``predict`` lists one token grid per input after the output's (``img_shapes``).

A prompt record's "image" is then a list of paths (jsonl; CSV: paths separated by "|",
``flowalign.prompts``); a single path is one input. Every record of a run must have the same
number of inputs with the same aspect ratios (one token layout). At η = 0 a rollout equals
``QwenImageEditPlusPipeline`` given the same images, height and width (the pipeline takes one
prompt per call).
"""

from __future__ import annotations

from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE,
                                                                        calculate_dimensions)

from pipelines.qwen_image_edit import QwenImageEditAdapter


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """A ``QwenImageEditPlusPipeline`` as the RL core sees it; options as ``QwenImageAdapter``'s."""

    family = "qwen_image_edit_plus"
    pipeline_class = QwenImageEditPlusPipeline
    several_images = True
    condition_area = VAE_IMAGE_SIZE  # what the VAE encodes of each input
    prompt_image_area = CONDITION_IMAGE_SIZE  # what the text encoder sees of each input

    def _prepare(self, image):
        """One input image (RGB PIL) → (the text encoder's picture at ``prompt_image_area``, the VAE's
        pixels [1, 3, 1, H', W'] at ``condition_area``, their token grid (1, H'/16, W'/16))."""
        ratio = image.size[0] / image.size[1]
        prompt_width, prompt_height = calculate_dimensions(self.prompt_image_area, ratio)
        width, height = calculate_dimensions(self.condition_area, ratio)
        picture = self.pipe.image_processor.resize(image, prompt_height, prompt_width)
        pixels = self.pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
        return picture, pixels, self._grid(height, width)
