"""Adapter for Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``); the UNet family's common
part (DDIM schedule, CFG, predict) is ``pipelines/unet.py``.

Conditioning: {"embeds": [B, L, D]}, the text encoder's last hidden states, as the pipeline
encodes them; its negative is the empty prompt's. The safety checker is not loaded: the reward
sees the raw decoded images.
"""

from __future__ import annotations

from diffusers import StableDiffusionPipeline

from pipelines.base import Conditioning
from pipelines.unet import UNetAdapter


class SDAdapter(UNetAdapter):
    family = "sd"
    pipeline_class = StableDiffusionPipeline

    @classmethod
    def pipeline_kwargs(cls, path: str) -> dict:
        return {"safety_checker": None, "requires_safety_checker": False}

    def encode_pair(self, prompts: list[str], negative: bool) -> tuple[Conditioning, Conditioning | None]:
        embeds, negative_embeds = self.pipe.encode_prompt(prompts, self.device, 1, negative)
        return Conditioning({"embeds": embeds}), Conditioning({"embeds": negative_embeds}) if negative else None
