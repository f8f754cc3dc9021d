"""The shapes edit verifier: does an edited image carry out its instruction on its input scene, and
change nothing else? (The edit world: ``reward_models/worlds/shapes_edit.py``.)

Both the output and the input (the record's "image", resized to the output's size, nearest) go
through the shapes detector (``reward_models/shapes.py``: palette colours, connected components,
template classes). With the edited object named by its class (one per scene), margin m = size / 8:

* ``instruction``: exactly one object of the edited class in the output, and for a recolour its
  colour is the new one; for a move its centre moved at least m in the instruction's direction
  (the world asks for size / 4) and less than m across it;
* ``preserved``: the output holds the input's classes, one object each, nothing more; every other
  object keeps its colour and its centre (within m); the edited object keeps its centre (recolour)
  or its colour (move);
* ``edit_accuracy``: both (the strict 0/1 verdict held-out results are reported in).

A record without an input image or an edit scores NaN (dropped and counted by the trainer).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from PIL import Image

from reward_models.base import Reward, register_reward
from reward_models.shapes import DetectedObject, detect_objects
from reward_models.worlds.shapes_edit import DIRECTIONS


def judge_edit(output: list[DetectedObject], source: list[DetectedObject], edit: dict, size: int) -> tuple[bool, bool]:
    """(instruction followed, rest preserved) for the objects detected in an output and its input."""
    margin = size / 8
    if Counter(o.shape for o in output) != Counter(o.shape for o in source) or \
            len(source) != len({o.shape for o in source}):
        return False, False  # added, removed or reclassified objects: neither can be judged
    before = {o.shape: o for o in source}
    after = {o.shape: o for o in output}
    if edit["class"] not in before:
        return False, False
    old, new = before[edit["class"]], after[edit["class"]]
    dx, dy = new.cx - old.cx, new.cy - old.cy
    if edit["kind"] == "recolor":
        instruction = new.color == edit["to"]
        kept = max(abs(dx), abs(dy)) < margin
    else:
        ux, uy = DIRECTIONS[edit["direction"]]
        along, across = dx * ux + dy * uy, abs(dx * uy - dy * ux)
        instruction = along >= margin and across < margin
        kept = new.color == old.color
    others = all(after[s].color == o.color and max(abs(after[s].cx - o.cx), abs(after[s].cy - o.cy)) < margin
                 for s, o in before.items() if s != edit["class"])
    return instruction, kept and others


@register_reward("shapes_edit")
class ShapesEditVerifier(Reward):
    """Edits of the shapes edit world, judged against their input scenes (module docstring). Example::

        reward = ShapesEditVerifier()
        reward(images, [r["prompt"] for r in records], records)["edit_accuracy"]  # float [B] in {0, 1}
    """

    components = ("edit_accuracy", "instruction", "preserved")
    modality = "image"

    def __init__(self, min_area: int = 10):
        self.min_area = min_area

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        """samples: float [B, 3, H, W] in [0, 1]; metadata: the edit records ("image", "edit")."""
        images = (samples.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        out = {k: torch.full((len(images),), float("nan")) for k in self.components}
        for i, (image, record) in enumerate(zip(images, metadata)):
            if not record.get("image") or "edit" not in record:
                continue
            h, w = image.shape[:2]
            source = np.asarray(Image.open(record["image"]).convert("RGB").resize((w, h), Image.NEAREST))
            instruction, preserved = judge_edit(detect_objects(image, self.min_area),
                                                detect_objects(source, self.min_area), record["edit"], min(h, w))
            out["instruction"][i], out["preserved"][i] = float(instruction), float(preserved)
            out["edit_accuracy"][i] = float(instruction and preserved)
        return out
