"""The shapes world: procedurally drawn scenes of coloured shapes with GenEval-style metadata.

This is the built-in analogue of GenEval on which every image objective is proven on a CPU.
A *spec* is a plain dict, shaped like a GenEval metadata record::

    {"tag": "color_attr", "prompt": "a photo of a red circle and a blue square",
     "include": [{"class": "circle", "count": 1, "color": "red"},
                 {"class": "square", "count": 1, "color": "blue"}]}

Position specs put the relation on the second item, as GenEval does:
``{"class": "circle", "count": 1, "position": ["left of", 0]}`` means "the circle is left of
include[0]". ``render_scene`` draws an image that satisfies a spec; the verifier in
``reward_models/shapes.py`` reads an image back and checks it against the spec.

Prompt splits are fixed (seeded by the category name, not by the run): categories with at least
``MIN_PROMPTS_TO_SPLIT`` prompts hold out a quarter of them for testing; the two smallest
categories (single object, two objects) have too few prompts to split and use the same prompts
for training and testing (evaluated on other seeds).
"""

from __future__ import annotations

import copy
import itertools
import random
import zlib

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 32
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 230), "yellow": (230, 200, 30)}
BACKGROUND = (245, 245, 245)
RELATIONS = ("left of", "right of", "above", "below")
NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}
CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
MIN_PROMPTS_TO_SPLIT = 8
TEST_FRACTION = 0.25


def _item(shape: str, count: int = 1, color: str | None = None, position=None) -> dict:
    item = {"class": shape, "count": count}
    if color is not None:
        item["color"] = color
    if position is not None:
        item["position"] = list(position)
    return item


def all_specs(category: str) -> list[dict]:
    """Every prompt of one category, in a fixed order. Returns a list of spec dicts."""
    specs = []
    if category == "single_object":
        for s in SHAPES:
            specs.append({"prompt": f"a photo of a {s}", "include": [_item(s)]})
    elif category == "two_object":
        for a, b in itertools.permutations(SHAPES, 2):
            specs.append({"prompt": f"a photo of a {a} and a {b}", "include": [_item(a), _item(b)]})
    elif category == "counting":
        for s, n in itertools.product(SHAPES, NUMBER_WORDS):
            specs.append({"prompt": f"a photo of {NUMBER_WORDS[n]} {s}s", "include": [_item(s, n)]})
    elif category == "colors":
        for c, s in itertools.product(COLORS, SHAPES):
            specs.append({"prompt": f"a photo of a {c} {s}", "include": [_item(s, color=c)]})
    elif category == "position":
        for (a, b), rel in itertools.product(itertools.permutations(SHAPES, 2), RELATIONS):
            # "a photo of an A left of a B": A carries the relation to include[0] = B.
            specs.append({"prompt": f"a photo of a {a} {rel} a {b}",
                          "include": [_item(b), _item(a, position=(rel, 0))]})
    elif category == "color_attr":
        for (a, b), ca, cb in itertools.product(itertools.permutations(SHAPES, 2), COLORS, COLORS):
            specs.append({"prompt": f"a photo of a {ca} {a} and a {cb} {b}",
                          "include": [_item(a, color=ca), _item(b, color=cb)]})
    else:
        raise ValueError(f"unknown shapes category {category!r}; expected one of {CATEGORIES}")
    for spec in specs:
        spec["tag"] = category
    return specs


def prompt_split(split: str, categories=CATEGORIES) -> list[dict]:
    """The fixed ``"train"`` / ``"test"`` prompt split (see the module docstring)."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    out = []
    for category in categories:
        specs = all_specs(category)
        if split == "all" or len(specs) < MIN_PROMPTS_TO_SPLIT:
            out.extend(specs)
            continue
        order = list(range(len(specs)))
        random.Random(zlib.crc32(category.encode())).shuffle(order)
        n_test = max(1, round(TEST_FRACTION * len(specs)))
        chosen = order[:n_test] if split == "test" else order[n_test:]
        out.extend(specs[i] for i in sorted(chosen))
    return out


def vocabulary() -> list[str]:
    """Every word that appears in a shapes caption (for building the demo tokenizer)."""
    words = set()
    for spec in prompt_split("all"):
        words.update(spec["prompt"].split())
    return sorted(words)


# --------------------------------------------------------------------------- rendering


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], rgb) -> None:
    x0, y0, x1, y1 = box  # inclusive pixel box
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=rgb)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def relation_offset(rel: str, a: tuple[float, float], b: tuple[float, float]) -> float:
    """How far (pixels) centre ``a`` lies in direction ``rel`` ("left of", …) of centre ``b``."""
    (ax, ay), (bx, by) = a, b
    return {"left of": bx - ax, "right of": ax - bx, "above": by - ay, "below": ay - by}[rel]


def _relation_holds(rel: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
    return relation_offset(rel, a, b) > margin


def render_scene(spec: dict, rng: random.Random, size: int = IMAGE_SIZE, max_tries: int = 200) -> Image.Image:
    """Draw one scene that satisfies ``spec``. Returns a ``size``×``size`` RGB PIL image.

    Objects never overlap (1 px gap); unspecified colours are random; for a position relation
    the centres are at least ``size / 8`` pixels apart along the relation's axis, so that the
    verifier's margin (``size / 16``) is met with room to spare.
    """
    objects = []  # (shape, color) in drawing order, and which include index each came from
    for idx, item in enumerate(spec["include"]):
        for _ in range(item["count"]):
            objects.append((item["class"], item.get("color") or rng.choice(list(COLORS)), idx))
    n = len(objects)
    lo, hi = (10, 16) if n == 1 else (8, 12) if n <= 2 else (7, 10)
    lo, hi = lo * size // 32, hi * size // 32
    for _ in range(max_tries):
        boxes = []
        for _shape, _color, _idx in objects:
            s = rng.randint(lo, hi)
            x0, y0 = rng.randint(0, size - s), rng.randint(0, size - s)
            boxes.append((x0, y0, x0 + s - 1, y0 + s - 1))
        if any(_overlap(p, q) for p, q in itertools.combinations(boxes, 2)):
            continue
        if not _positions_ok(spec, objects, boxes, margin=size / 8):
            continue
        image = Image.new("RGB", (size, size), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for (shape, color, _), box in zip(objects, boxes):
            _draw(draw, shape, box, COLORS[color])
        return image
    raise RuntimeError(f"could not lay out {spec['prompt']!r} in {max_tries} tries")


def _overlap(p, q, gap: int = 1) -> bool:
    return not (p[2] + gap < q[0] or q[2] + gap < p[0] or p[3] + gap < q[1] or q[3] + gap < p[1])


def _positions_ok(spec, objects, boxes, margin) -> bool:
    centres = [((b[0] + b[2]) / 2, (b[1] + b[3]) / 2) for b in boxes]
    for idx, item in enumerate(spec["include"]):
        if "position" not in item:
            continue
        rel, ref = item["position"]
        mine = [c for c, o in zip(centres, objects) if o[2] == idx]
        theirs = [c for c, o in zip(centres, objects) if o[2] == ref]
        if not all(_relation_holds(rel, a, b, margin) for a in mine for b in theirs):
            return False
    return True


def sample_specs(n: int, rng: random.Random, split: str = "all", categories=CATEGORIES) -> list[dict]:
    """``n`` specs: a uniformly drawn category, then a uniformly drawn prompt within it."""
    by_category = {c: prompt_split(split, (c,)) for c in categories}
    return [copy.deepcopy(rng.choice(by_category[rng.choice(categories)])) for _ in range(n)]


def to_array(image: Image.Image) -> np.ndarray:
    """PIL image → uint8 array [H, W, 3]."""
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def render_batch(specs: list[dict], rng: random.Random):
    """The specs' scenes as a VAE input: float tensor [n, 3, H, W] in [-1, 1]."""
    import torch

    images = np.stack([to_array(render_scene(s, rng)) for s in specs])
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
