"""The shapes edit world and its verifier: fixed splits, inputs that leave room for their edit, and
a verdict that holds for the intended result and fails for each way an edit can go wrong (checked
on drawn images through the real detector and the reward registry)."""

import random

import numpy as np
import pytest
import torch

from flowalign.prompts import load_prompts
from reward_models.base import build_reward
from reward_models.worlds.shapes import COLORS
from reward_models.worlds.shapes_edit import (all_edits, draw_objects, edit_split, edit_vocabulary, edited_objects,
                                              layout_scene, moved_box, render_edit, write_edit_prompts)


def _tensor(images) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(i) for i in images])).permute(0, 3, 1, 2).float() / 255


def test_splits_are_fixed_disjoint_and_cover_every_edit():
    assert len(all_edits("recolor")) == 3 * 12 * 9 and len(all_edits("move")) == 3 * 4 * 4 * 9
    train, test = edit_split("train"), edit_split("test")
    key = lambda e: (e["prompt"], str(e["other"]), str(e["edit"]))  # noqa: E731
    assert {key(e) for e in train}.isdisjoint({key(e) for e in test})
    assert len(train) + len(test) == len(edit_split("all")) and len(test) == round(0.25 * 324) + round(0.25 * 432)
    assert [key(e) for e in edit_split("test")] == [key(e) for e in test]  # not seeded by the run
    assert {"make", "blue", "move", "left", "up"} <= set(edit_vocabulary())
    with pytest.raises(ValueError, match="split"):
        edit_split("dev")


def test_a_moves_input_leaves_room_and_the_intended_result_is_drawn():
    edit = next(e for e in all_edits("move") if e["edit"]["direction"] == "left" and e["other"])
    objects = layout_scene(edit, random.Random(0))
    box = objects[0][2]
    assert box[0] >= 8 and moved_box(box, "left", 32) == [box[0] - 8, box[1], box[2] - 8, box[3]]
    record = {**edit, "objects": objects}
    before, after = render_edit(record)
    assert edited_objects(record)[1:] == objects[1:]  # only the named object changes
    assert np.array_equal(np.asarray(before), np.asarray(draw_objects(objects)))
    assert not np.array_equal(np.asarray(before), np.asarray(after))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edits")
    records = load_prompts(str(write_edit_prompts(folder, "test")))  # a prompt file: images resolved
    assert len(records) == len(edit_split("test")) and all(r["image"].endswith(".png") for r in records)
    return records


def _one(records, kind, with_other=True):
    return next(r for r in records if r["edit"]["kind"] == kind and (len(r["objects"]) == 2) == with_other)


@pytest.mark.parametrize("kind", ["recolor", "move"])
def test_the_intended_result_passes_and_each_mistake_fails(records, kind):
    reward = build_reward("shapes_edit")
    record = _one(records, kind)
    (shape, color, box), (other, other_color, other_box) = record["objects"]
    intended = edited_objects(record)
    e = record["edit"]
    wrong = next(c for c in COLORS if c not in (color, e.get("to")))  # neither the input's nor the asked colour
    outputs = {
        "intended": intended,
        "unchanged": record["objects"],  # the edit not done
        "other changed": [intended[0], [other, next(c for c in COLORS if c != other_color), other_box]],
        "object removed": intended[:1],
        "wrong edit": ([[shape, wrong, box], intended[1]] if kind == "recolor"
                       else [[shape, wrong, intended[0][2]], intended[1]]),  # recoloured wrongly / moved but recoloured
    }
    out = reward(_tensor([draw_objects(o) for o in outputs.values()]), [record["prompt"]] * len(outputs),
                 [record] * len(outputs))
    verdict = dict(zip(outputs, out["edit_accuracy"].tolist()))
    assert verdict == {"intended": 1.0, "unchanged": 0.0, "other changed": 0.0, "object removed": 0.0,
                       "wrong edit": 0.0}, verdict
    assert out["instruction"][1] == 0.0 and out["preserved"][1] == 1.0  # unchanged: the rest is preserved
    assert out["instruction"][2] == 1.0 and out["preserved"][2] == 0.0  # the edit done, another object changed


def test_a_move_the_wrong_way_or_too_short_fails_and_larger_outputs_are_judged(records):
    reward = build_reward("shapes_edit")
    record = _one(records, "move", with_other=False)
    (shape, color, box), = record["objects"]
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}[record["edit"]["direction"]]
    target = edited_objects(record)[0][2]
    # the world asks for size / 4 = 8 px; the verifier's margin is size / 8 = 4 px
    short = [(3 * a + b) // 4 for a, b in zip(box, target)]  # 2 px of the 8
    margin = [(a + b) // 2 for a, b in zip(box, target)]  # 4 px: just enough
    outputs = {"intended": 1.0, "wrong way": 0.0, "too little": 0.0, "at the margin": 1.0}
    boxes = {"intended": target, "wrong way": moved_box(box, opposite, 32), "too little": short,
             "at the margin": margin}
    drawn = {k: draw_objects([[shape, color, b]]) for k, b in boxes.items() if all(0 <= v < 32 for v in b)}
    out = reward(_tensor(list(drawn.values())), [record["prompt"]] * len(drawn), [record] * len(drawn))
    assert dict(zip(drawn, out["edit_accuracy"].tolist())) == {k: outputs[k] for k in drawn}
    big = draw_objects(edited_objects(record)).resize((64, 64), 0)  # a 64-pixel output: the input is resized to it
    assert reward(_tensor([big]), [record["prompt"]], [record])["edit_accuracy"].item() == 1.0
    assert torch.isnan(reward(_tensor([big]), ["x"], [{"prompt": "x"}])["edit_accuracy"]).all()
