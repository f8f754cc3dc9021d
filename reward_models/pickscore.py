"""PickScore (Kirstain et al. 2023): a CLIP ViT-H/14 fine-tuned on Pick-a-Pic preferences.

score = exp(logit_scale) · cos(text embedding, image embedding), as in the PickScore README
(real model ``yuvalkirstain/PickScore_v1``, processor ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``;
the real logit scale is 100; Flow-GRPO divides the score by 26, which here is a component
weight: ``reward.weights={pickscore: 0.0385}``).
"""

from __future__ import annotations

import torch

from reward_models.base import Reward, register_reward
from reward_models.clip_utils import load_transformers, normalize, pick_device, projected, to_uint8


@register_reward("pickscore")
class PickScore(Reward):
    """``model``: hub id or local ``CLIPModel`` folder; ``processor``: hub id or local
    ``CLIPProcessor`` folder (tokenizer + ``preprocessor_config.json``). Example::

        reward = PickScore()  # the real model and processor from the hub
        reward(images, ["a red fox"] * len(images), [{}] * len(images))["pickscore"]  # float [B]
    """

    components = ("pickscore",)
    modality = "image"

    def __init__(self, model: str = "yuvalkirstain/PickScore_v1",
                 processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", device: str | None = None):
        from transformers import CLIPModel, CLIPProcessor

        self.device = pick_device(device)
        self.processor = load_transformers(CLIPProcessor, processor, "CLIP processor")
        self.model = load_transformers(CLIPModel, model, "PickScore model").to(self.device).eval()
        # PickScore truncates prompts at 77 tokens, the text tower's length
        self.max_length = min(self.processor.tokenizer.model_max_length,
                              self.model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def embed(self, samples: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """samples float [B, 3, H, W] in [0, 1], B prompts → unit image and text embeddings [B, D] each."""
        pixels = self.processor(images=to_uint8(samples), return_tensors="pt")["pixel_values"].to(self.device)
        text = self.processor(text=prompts, padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt").to(self.device)
        image = projected(self.model.get_image_features(pixel_values=pixels))
        words = projected(self.model.get_text_features(input_ids=text["input_ids"],
                                                       attention_mask=text["attention_mask"]))
        return normalize(image), normalize(words)

    @torch.no_grad()
    def __call__(self, samples, prompts, metadata):
        image, text = self.embed(samples, prompts)
        return {"pickscore": (self.model.logit_scale.exp() * (image * text).sum(-1)).float().cpu()}
