"""Training samples in the trackers: every tracker_samples_every epochs a grid of the epoch's
rollouts, each captioned with its prompt and reward, is an image in TensorBoard's event file and in
an offline W&B run (read back from both)."""

import io

import pytest
import torch
from PIL import Image

from flowalign.sample_log import TAG, captioned_grid
from flowalign.trainer import Trainer
from test_trackers import read_offline_wandb_history, tiny_config

SAMPLES = ["tracker_samples_every=1", "tracker_samples=4", "eval.every=0"]


def _ink(image: Image.Image, box) -> int:
    """Dark pixels in ``box`` of ``image`` (the caption text)."""
    return sum(1 for p in image.crop(box).convert("L").getdata() if p < 128)


def test_a_caption_is_the_prompt_and_reward_under_each_cell():
    cells = torch.full((2, 3, 32, 32), 0.5)
    grid = captioned_grid(cells, ["0.750 a photo of a red circle", "0.125 two squares"], columns=2)
    assert grid.size == (2 * 132, 128 + 3 * 11 + 4 + 4)  # cells scaled to 128 px, three caption lines
    blank = captioned_grid(cells, ["", ""], columns=2)
    caption = (0, 130, grid.size[0], grid.size[1])
    assert _ink(grid, caption) > 50 and _ink(blank, caption) == 0
    assert list(grid.crop((2, 2, 130, 130)).getdata()) == list(blank.crop((2, 2, 130, 130)).getdata())


def test_tensorboard_has_the_captioned_training_samples(tiny_sd3_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(tiny_config(tiny_sd3_dir, tmp_path, "tracker=tensorboard", *SAMPLES)).train()
    events = list(tmp_path.rglob("events.out.tfevents*"))
    reader = EventAccumulator(str(min(events, key=lambda p: len(p.parts))), size_guidance={"images": 0})
    reader.Reload()
    images = reader.Images(TAG)
    assert [i.step for i in images] == [1, 2]  # every epoch
    logged = Image.open(io.BytesIO(images[0].encoded_image_string))
    assert logged.size == (4 * 132, 128 + 3 * 11 + 8)  # 4 samples in a row, each captioned
    assert _ink(logged, (0, 130, logged.size[0], logged.size[1])) > 100  # the captions' text


def test_an_offline_wandb_run_has_them_too(tiny_sd3_dir, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # an optional extra: pip install "flowalign[wandb]"
    wandb.teardown()  # wandb keeps an earlier run's settings (its folder) for the process; start afresh
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    try:
        Trainer(tiny_config(tiny_sd3_dir, tmp_path / "run", "tracker=wandb", *SAMPLES)).train()
    finally:
        wandb.teardown()  # and leave none of this run's settings to a later test
    (run_dir,) = (tmp_path / "wandb-dir" / "wandb").glob("offline-run-*")
    rows = read_offline_wandb_history(run_dir)  # waits for wandb's writer to finish the log
    logged = [(row["_step"], row[TAG]) for row in rows if TAG in row]
    assert [step for step, _ in logged] == [1, 2]
    for _, entry in logged:
        (name,) = entry["filenames"]
        image = Image.open(run_dir / "files" / name)
        assert image.size == (entry["width"], entry["height"]) == (4 * 132, 128 + 3 * 11 + 8)
        assert _ink(image, (0, 130, image.size[0], image.size[1])) > 100  # the captions
