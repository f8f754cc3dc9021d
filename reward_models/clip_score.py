"""CLIP score: the cosine similarity of an open_clip model's image and prompt embeddings.

Real weights: e.g. ``hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K``. A local folder in the
layout of an open_clip hub repo (``open_clip_config.json`` + ``open_clip_pytorch_model.bin`` or
``open_clip_model.safetensors``) loads through open_clip's ``local-dir:`` schema. The raw
cosine is returned (in [-1, 1]); CLIPScore papers' ``w · max(cos, 0)`` is a weight and a clip away.
"""

from __future__ import annotations

import torch

from reward_models.base import Reward, register_reward
from reward_models.clip_utils import load_open_clip, normalize, pick_device, to_pil


@torch.no_grad()
def open_clip_cosine(model, preprocess, tokenizer, samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """cos(image, prompt) per sample, float [B] on the CPU.

    samples float [B, 3, H, W] in [0, 1]. ``preprocess`` is the model's evaluation transform on
    8-bit PIL images (resize, centre crop, normalise), exactly what open_clip and HPSv2 score on.
    """
    device = next(model.parameters()).device
    pixels = torch.stack([preprocess(image) for image in to_pil(samples)]).to(device)
    image = normalize(model.encode_image(pixels).float())
    text = normalize(model.encode_text(tokenizer(prompts).to(device)).float())
    return (image * text).sum(-1).cpu()


@register_reward("clip_score")
class ClipScore(Reward):
    """``model``: ``hf-hub:org/repo``, ``org/repo`` or a local open_clip folder. Example::

        reward = ClipScore("hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K")
        reward(images, prompts, metadata)["clip_score"]  # float [B] in [-1, 1]
    """

    components = ("clip_score",)
    modality = "image"

    def __init__(self, model: str = "hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K", device: str | None = None):
        self.model, self.preprocess, self.tokenizer = load_open_clip(model, pick_device(device))

    def __call__(self, samples, prompts, metadata):
        return {"clip_score": open_clip_cosine(self.model, self.preprocess, self.tokenizer, samples, prompts)}
