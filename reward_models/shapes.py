"""The shapes verifier: a programmatic GenEval-style judge of a shapes-world image.

Detection: every pixel goes to the nearest palette colour (or to the background, or to "none"
when it is far from all of them); 8-connected components of one colour with at least
``min_area`` pixels are objects; an object's class is the shape template (square, inscribed
circle, upward triangle, all fitted to the component's bounding box) with the highest IoU.

Judgement is strict, like GenEval's: the detected objects must be exactly the requested ones
(each include item's class, colour if given, and exact count; nothing extra), and a position
relation must hold between object centres with a margin of ``size / 16`` pixels.
``accuracy`` is that 0/1 verdict; ``score`` is partial credit, the fraction of the individual
checks (one per include item, one for "nothing extra", one per relation) that pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage

from flowalign.worlds.shapes import BACKGROUND, COLORS, _relation_holds
from reward_models.base import Reward, register_reward

_PALETTE_NAMES = ["background", *COLORS]
_PALETTE = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32)  # [K, 3]


@dataclass
class DetectedObject:
    shape: str
    color: str
    cx: float
    cy: float
    area: int


def _templates(h: int, w: int) -> dict[str, np.ndarray]:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    circle = ((yy - cy) / (h / 2)) ** 2 + ((xx - cx) / (w / 2)) ** 2 <= 1.0
    # Upward triangle: at row y the half-width grows linearly from 0 (top) to w/2 (bottom).
    half = (yy + 0.5) / h * (w / 2)
    triangle = np.abs(xx - cx) <= half
    return {"circle": circle, "square": np.ones((h, w), bool), "triangle": triangle}


def detect_objects(image: np.ndarray, min_area: int = 10, max_color_dist: float = 90.0) -> list[DetectedObject]:
    """Objects in one image. image: uint8 [H, W, 3]. Returns a list of ``DetectedObject``."""
    pixels = image.astype(np.float32)
    dist = np.linalg.norm(pixels[:, :, None, :] - _PALETTE[None, None], axis=-1)  # [H, W, K]
    label = dist.argmin(-1)
    label[dist.min(-1) > max_color_dist] = -1
    objects = []
    for k, name in enumerate(_PALETTE_NAMES):
        if name == "background":
            continue
        components, n = ndimage.label(label == k, structure=np.ones((3, 3)))
        for i, sl in enumerate(ndimage.find_objects(components), start=1):
            mask = components[sl] == i
            area = int(mask.sum())
            if area < min_area:
                continue
            ious = {s: (mask & t).sum() / (mask | t).sum() for s, t in _templates(*mask.shape).items()}
            ys, xs = np.nonzero(components == i)
            objects.append(DetectedObject(max(ious, key=ious.get), name, float(xs.mean()), float(ys.mean()), area))
    return objects


def _matches(obj: DetectedObject, item: dict) -> bool:
    return obj.shape == item["class"] and ("color" not in item or obj.color == item["color"])


def judge(objects: list[DetectedObject], spec: dict, size: int) -> tuple[float, float]:
    """(accuracy ∈ {0, 1}, score ∈ [0, 1]) of detected objects against one spec."""
    checks = []
    for item in spec["include"]:
        checks.append(sum(_matches(o, item) for o in objects) == item["count"])
    checks.append(len(objects) == sum(item["count"] for item in spec["include"]))
    for item in spec["include"]:
        if "position" in item:
            rel, ref = item["position"]
            mine = [o for o in objects if _matches(o, item)]
            theirs = [o for o in objects if _matches(o, spec["include"][ref])]
            checks.append(bool(mine) and bool(theirs) and all(
                _relation_holds(rel, (a.cx, a.cy), (b.cx, b.cy), size / 16) for a in mine for b in theirs))
    return float(all(checks)), sum(checks) / len(checks)


@register_reward("shapes")
class ShapesVerifier(Reward):
    """GenEval-style verifier for the built-in shapes world.

    >>> import random
    >>> from flowalign.worlds.shapes import render_scene, prompt_split
    >>> spec = prompt_split("test")[0]
    >>> image = torch.from_numpy(np.array(render_scene(spec, random.Random(0)))).permute(2, 0, 1) / 255
    >>> ShapesVerifier()(image[None], [spec["prompt"]], [spec])["accuracy"].tolist()
    [1.0]
    """

    components = ("accuracy", "score")

    def __init__(self, min_area: int = 10):
        self.min_area = min_area

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        """samples: float [B, 3, H, W] in [0, 1]. Returns {"accuracy": [B], "score": [B]}."""
        images = (samples.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        results = [judge(detect_objects(img, self.min_area), spec, img.shape[0]) for img, spec in zip(images, metadata)]
        acc, score = zip(*results) if results else ((), ())
        return {"accuracy": torch.tensor(acc, dtype=torch.float32), "score": torch.tensor(score, dtype=torch.float32)}
