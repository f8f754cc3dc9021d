"""JPEG (in)compressibility (DDPO): the size of the sample encoded as JPEG at quality 95."""

from __future__ import annotations

import io

import torch
from PIL import Image

from reward_models.base import Reward, register_reward


def jpeg_kilobytes(samples: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """samples: float [B, 3, H, W] in [0, 1] → JPEG sizes in kB, float [B]."""
    arrays = (samples.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_compressibility")
class JpegCompressibility(Reward):
    """Negative JPEG size in kB: smaller files score higher.

    >>> JpegCompressibility()(torch.zeros(1, 3, 32, 32), ["x"], [{}])["jpeg_compressibility"] < 0
    tensor([True])
    """

    components = ("jpeg_compressibility",)
    modality = "image"  # JpegIncompressibility inherits it

    def __init__(self, quality: int = 95):
        self.quality = quality

    def __call__(self, samples, prompts, metadata):
        return {"jpeg_compressibility": -jpeg_kilobytes(samples, self.quality)}


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(JpegCompressibility):
    """JPEG size in kB: larger files score higher."""

    components = ("jpeg_incompressibility",)

    def __call__(self, samples, prompts, metadata):
        return {"jpeg_incompressibility": jpeg_kilobytes(samples, self.quality)}
