"""The shapes edit world: an input scene of one or two coloured shapes and an instruction that edits
it, "make the red circle blue" (recolour) or "move the square to the left" (move) — the
Kontext / Qwen-Image-Edit analogue of the shapes world (``reward_models/worlds/shapes.py``), whose
shapes, colours and renderer it shares. ``reward_models/shapes_edit.py`` checks an edited image
against its input.

An edit record is a prompt record with the instruction, the input image's path (once written,
``write_edit_prompts``; the prompt sources ``shapes_edit:train`` / ``shapes_edit:test`` write and
read one, ``edit_prompt_file``) and what the verifier reads::

    {"prompt": "make the red circle blue", "tag": "recolor", "image": ".../input.png",
     "edit": {"kind": "recolor", "class": "circle", "from": "red", "to": "blue"},
     "objects": [["circle", "red", [x0, y0, x1, y1]], ["square", "green", [...]]]}

"objects" is the input scene (class, colour, inclusive pixel box), so ``render_edit`` can draw the
intended result: the input with the edited object recoloured, or moved ``size / 4`` pixels in the
instruction's direction (a move's input leaves room for that). Instructions name an object by
class, and by colour for a recolour; the classes of one scene differ, so the name is unambiguous.
Splits are fixed, as the shapes world's: a quarter of the (instruction, other object) combinations
is held out for testing, seeded by the edit kind.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import tempfile
import zlib
from pathlib import Path

from PIL import Image, ImageDraw

from reward_models.worlds.shapes import BACKGROUND, COLORS, IMAGE_SIZE, SHAPES, TEST_FRACTION, _draw, _overlap

EDIT_KINDS = ("recolor", "move")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
DIRECTION_WORDS = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}


def all_edits(kind: str) -> list[dict]:
    """Every edit of one kind, in a fixed order: records without "image" and "objects" (the scene's
    other object, when there is one, is "other": [class, colour])."""
    edits = []
    if kind == "recolor":
        for shape, (old, new) in itertools.product(SHAPES, itertools.permutations(COLORS, 2)):
            for other in [None, *[(s, c) for s in SHAPES if s != shape for c in COLORS]]:
                edits.append({"prompt": f"make the {old} {shape} {new}", "tag": kind, "other": other,
                              "edit": {"kind": kind, "class": shape, "from": old, "to": new}})
    elif kind == "move":
        for shape, direction, color in itertools.product(SHAPES, DIRECTIONS, COLORS):
            for other in [None, *[(s, c) for s in SHAPES if s != shape for c in COLORS]]:
                edits.append({"prompt": f"move the {shape} {DIRECTION_WORDS[direction]}", "tag": kind,
                              "other": other, "edit": {"kind": kind, "class": shape, "direction": direction,
                                                       "color": color}})
    else:
        raise ValueError(f"unknown edit kind {kind!r}; expected one of {EDIT_KINDS}")
    return edits


def edit_split(split: str, kinds=EDIT_KINDS) -> list[dict]:
    """The fixed "train" / "test" / "all" split of the edits (module docstring)."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    out = []
    for kind in kinds:
        edits = all_edits(kind)
        if split == "all":
            out.extend(edits)
            continue
        order = list(range(len(edits)))
        random.Random(zlib.crc32(kind.encode())).shuffle(order)
        n_test = round(TEST_FRACTION * len(edits))
        chosen = order[:n_test] if split == "test" else order[n_test:]
        out.extend(edits[i] for i in sorted(chosen))
    return out


def edit_vocabulary() -> list[str]:
    """Every word of an edit instruction (for a tokenizer)."""
    return sorted({w for e in edit_split("all") for w in e["prompt"].split()})


def layout_scene(edit: dict, rng: random.Random, size: int = IMAGE_SIZE, max_tries: int = 500) -> list[list]:
    """The input scene of ``edit``: [[class, colour, [x0, y0, x1, y1]], …], the edited object first.
    Objects keep a 1-pixel gap; a move's object has room to move ``size / 4`` pixels its way, and the
    moved object stays clear of the other one."""
    e = edit["edit"]
    color = e["from"] if e["kind"] == "recolor" else e["color"]
    shapes = [(e["class"], color)] + ([tuple(edit["other"])] if edit.get("other") else [])
    lo, hi = (9 * size // 32, 12 * size // 32) if len(shapes) == 1 else (7 * size // 32, 10 * size // 32)
    for _ in range(max_tries):
        boxes = []
        for _shape in shapes:
            s = rng.randint(lo, hi)
            x0, y0 = rng.randint(0, size - s), rng.randint(0, size - s)
            boxes.append([x0, y0, x0 + s - 1, y0 + s - 1])
        candidates = [boxes]
        if e["kind"] == "move":
            candidates.append([moved_box(boxes[0], e["direction"], size)] + boxes[1:])
        if all(_inside(b, size) for bs in candidates for b in bs) and not any(
                _overlap(p, q) for bs in candidates for p, q in itertools.combinations(bs, 2)):
            return [[shape, c, box] for (shape, c), box in zip(shapes, boxes)]
    raise RuntimeError(f"could not lay out {edit['prompt']!r} in {max_tries} tries")


def moved_box(box, direction: str, size: int) -> list[int]:
    """``box`` shifted ``size / 4`` pixels in ``direction`` (what a move instruction asks for)."""
    dx, dy = DIRECTIONS[direction]
    step = size // 4
    return [box[0] + dx * step, box[1] + dy * step, box[2] + dx * step, box[3] + dy * step]


def _inside(box, size: int) -> bool:
    return box[0] >= 0 and box[1] >= 0 and box[2] < size and box[3] < size


def draw_objects(objects: list[list], size: int = IMAGE_SIZE) -> Image.Image:
    """[[class, colour, box], …] → a ``size``×``size`` RGB scene on the world's background."""
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape, color, box in objects:
        _draw(draw, shape, tuple(box), COLORS[color])
    return image


def edited_objects(record: dict, size: int = IMAGE_SIZE) -> list[list]:
    """The intended result's objects: the edited object (the first) recoloured or moved."""
    (shape, color, box), *rest = record["objects"]
    e = record["edit"]
    first = [shape, e["to"], box] if e["kind"] == "recolor" else [shape, color, moved_box(box, e["direction"], size)]
    return [first, *rest]


def render_edit(record: dict, size: int = IMAGE_SIZE) -> tuple[Image.Image, Image.Image]:
    """(input image, intended result) of an edit record with "objects"."""
    return draw_objects(record["objects"], size), draw_objects(edited_objects(record, size), size)


def edit_records(split: str, seed: int = 0, size: int = IMAGE_SIZE) -> list[dict]:
    """Every edit of ``split`` laid out (seeded): records with "objects" and no "image" yet."""
    rng = random.Random(zlib.crc32(f"{split}:{seed}".encode()))
    records = []
    for edit in edit_split(split):
        record = {k: v for k, v in edit.items() if k != "other"}
        record["objects"] = layout_scene(edit, rng, size)
        records.append(record)
    return records


def write_edit_prompts(folder: str | Path, split: str, seed: int = 0, size: int = IMAGE_SIZE) -> Path:
    """Lay out and draw every edit of ``split`` (seeded), save each input as ``inputs/<i>.png`` and the
    records as ``<split>.jsonl`` in ``folder`` (a prompt file: ``data.train_prompts`` / ``--prompts``)."""
    folder = Path(folder)
    (folder / "inputs").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, record in enumerate(edit_records(split, seed, size)):
        record["image"] = f"inputs/{split}-{i}.png"
        draw_objects(record["objects"], size).save(folder / record["image"])
        lines.append(json.dumps(record))
    path = folder / f"{split}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def edit_prompt_file(split: str, seed: int = 0, size: int = IMAGE_SIZE, cache: str | Path | None = None) -> Path:
    """The prompt file of the ``shapes_edit:<split>`` source (``flowalign.prompts``): ``write_edit_prompts``'
    file in a folder of ``cache`` (default: the system's temporary folder) named by a checksum of the
    records, written once. The records are laid out afresh on every call (they are what is checked), so
    a folder written by an older layout is never read; the folder is written elsewhere and renamed into
    place, so processes starting together (one per GPU) never read a half-written one."""
    digest = zlib.crc32(json.dumps(edit_records(split, seed, size)).encode())
    folder = Path(cache or tempfile.gettempdir()) / f"flowalign-shapes-edit-{split}-{seed}-{size}-{digest:08x}"
    path = folder / f"{split}.jsonl"
    if not path.is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        write_edit_prompts(scratch, split, seed, size)
        try:
            os.replace(scratch, folder)
        except OSError:  # another process renamed its copy first
            shutil.rmtree(scratch, ignore_errors=True)
    return path
