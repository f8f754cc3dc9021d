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

``soft_score`` relaxes every check of ``score`` to [0, 1], the way a detector's confidence
relaxes GenEval's verdict, so that a sample that is *almost* right earns more than one that is
far off: an object's class becomes a softmax over its template IoUs (temperature
``SHAPE_TEMPERATURE``: a clear square is ≈ 1.0 square, a blob between circle and square ≈ 0.5
each); an include item earns the mean of its ``count`` best-matching objects of the right
colour (missing objects earn 0); "nothing extra" decays as 1 / (1 + |detected − requested|);
a relation is a sigmoid of its centre offset past the margin. Its argmax-and-threshold limit is
``score``. It is a training signal: held-out results are reported in the strict ``accuracy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import ndimage

from reward_models.worlds.shapes import BACKGROUND, COLORS, _relation_holds, relation_offset
from reward_models.base import Reward, register_reward

SHAPE_TEMPERATURE = 0.05
_PALETTE_NAMES = ["background", *COLORS]
_PALETTE = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32)  # [K, 3]


@dataclass
class DetectedObject:
    shape: str
    color: str
    cx: float
    cy: float
    area: int
    ious: dict[str, float] = field(default_factory=dict)  # IoU with each shape template

    def shape_probability(self, shape: str) -> float:
        """Softmax over the template IoUs at temperature ``SHAPE_TEMPERATURE``."""
        logits = np.array(list(self.ious.values())) / SHAPE_TEMPERATURE
        probs = np.exp(logits - logits.max())
        return float(probs[list(self.ious).index(shape)] / probs.sum())


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
            objects.append(DetectedObject(max(ious, key=ious.get), name, float(xs.mean()), float(ys.mean()), area,
                                          {s: float(v) for s, v in ious.items()}))
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


def soft_judge(objects: list[DetectedObject], spec: dict, size: int) -> float:
    """``score`` with every check relaxed to [0, 1] (see the module docstring)."""

    def match(o: DetectedObject, item: dict) -> float:
        return o.shape_probability(item["class"]) * ("color" not in item or o.color == item["color"])

    checks, best = [], []
    for item in spec["include"]:
        ranked = sorted(objects, key=lambda o: match(o, item), reverse=True)[: item["count"]]
        best.append(ranked)
        checks.append(sum(match(o, item) for o in ranked) / item["count"])
    checks.append(1 / (1 + abs(len(objects) - sum(item["count"] for item in spec["include"]))))
    for item, mine in zip(spec["include"], best):
        if "position" in item:
            rel, ref = item["position"]
            theirs = best[ref]
            pairs = [relation_offset(rel, (a.cx, a.cy), (b.cx, b.cy)) for a in mine for b in theirs]
            # Offsets in units of size/16 past the strict margin; 0 offset → 0.5.
            checks.append(float(np.mean([1 / (1 + np.exp(-(d - size / 16) / (size / 32))) for d in pairs]))
                          if pairs else 0.0)
    return sum(checks) / len(checks)


@register_reward("shapes")
class ShapesVerifier(Reward):
    """GenEval-style verifier for the built-in shapes world.

    >>> import random
    >>> from reward_models.worlds.shapes import render_scene, prompt_split
    >>> spec = prompt_split("test")[0]
    >>> image = torch.from_numpy(np.array(render_scene(spec, random.Random(0)))).permute(2, 0, 1) / 255
    >>> ShapesVerifier()(image[None], [spec["prompt"]], [spec])["accuracy"].tolist()
    [1.0]
    """

    components = ("accuracy", "score", "soft_score")

    def __init__(self, min_area: int = 10):
        self.min_area = min_area

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        """samples: float [B, 3, H, W] in [0, 1]. Returns {"accuracy", "score", "soft_score"}: each [B]."""
        images = (samples.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        results = []
        for img, spec in zip(images, metadata):
            objects = detect_objects(img, self.min_area)
            results.append((*judge(objects, spec, img.shape[0]), soft_judge(objects, spec, img.shape[0])))
        columns = zip(*results) if results else ((), (), ())
        return {name: torch.tensor(col, dtype=torch.float32) for name, col in zip(self.components, columns)}
