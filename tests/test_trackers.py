"""Trackers: evaluation grids as TensorBoard images (read back from the event file), W&B settings,
a missing tracker package and a disagreeing launch precision refused before any model loads."""

import io
import sys

import pytest
from PIL import Image

from flowalign.config import ConfigError, load_config
from flowalign.outputs import check_launch_precision, init_trackers, log_grid
from flowalign.trainer import Trainer


def tiny_config(tiny_sd3_dir, out, *overrides):
    return load_config(None, [
        f"output_dir={out}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "sampling.num_steps=4",
        "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4", "train.sample_batch_size=8",
        "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=2", "eval.grid_seeds=1",
        "checkpoint_every=0", *overrides])


def test_every_evaluation_grid_is_an_image_in_the_tensorboard_event_file(tiny_sd3_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(tiny_config(tiny_sd3_dir, tmp_path, "tracker=tensorboard", "eval.every=1")).train()
    events = list(tmp_path.rglob("events.out.tfevents*"))  # the run's, and the hparams' in a sub-folder
    assert events, list(tmp_path.rglob("*"))
    reader = EventAccumulator(str(min(events, key=lambda p: len(p.parts))), size_guidance={"images": 0})
    reader.Reload()
    assert "eval/grid" in reader.Tags()["images"]
    images = reader.Images("eval/grid")
    assert [i.step for i in images] == [0, 1, 2]  # before, epoch 1, after (epoch 2)
    saved = Image.open(tmp_path / "grids" / "after.png")
    logged = Image.open(io.BytesIO(images[-1].encoded_image_string))
    assert logged.size == saved.size == (images[-1].width, images[-1].height)
    assert "eval/score" in reader.Tags()["scalars"]


def test_wandb_missing_fails_before_any_model_loads_with_the_install_command(tiny_sd3_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib.util.find_spec → None: not installed
    monkeypatch.setattr("flowalign.model_setup.load_adapter", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match=r"tracker: wandb is not installed; install it with `pip install wandb"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, "tracker=wandb"))


def test_launch_precision_is_the_configs_or_refused(tiny_sd3_dir, tmp_path):
    config = tiny_config(tiny_sd3_dir, tmp_path, "tracker=none")
    check_launch_precision(config, {})  # plain python: the config decides
    check_launch_precision(config, {"ACCELERATE_MIXED_PRECISION": "no"})  # accelerate launch's default
    with pytest.raises(ConfigError, match=r"train.mixed_precision is 'no', but accelerate launch asks for 'bf16'"):
        check_launch_precision(config, {"ACCELERATE_MIXED_PRECISION": "bf16"})
    config = tiny_config(tiny_sd3_dir, tmp_path, "tracker=none", "train.mixed_precision=bf16")
    check_launch_precision(config, {"ACCELERATE_MIXED_PRECISION": "bf16"})
    with pytest.raises(ConfigError, match="set train.mixed_precision=fp16 or launch with --mixed_precision no"):
        check_launch_precision(config, {"ACCELERATE_MIXED_PRECISION": "fp16"})


def test_launch_precision_is_checked_before_any_model_loads(tiny_sd3_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setattr("flowalign.model_setup.load_adapter", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match="accelerate launch asks for 'fp16'"):
        Trainer(tiny_config(tiny_sd3_dir, tmp_path, "tracker=none"))


class FakeAccelerator:
    is_main_process = True

    def __init__(self, trackers=()):
        self.trackers, self.calls = list(trackers), []

    def init_trackers(self, project, config=None, init_kwargs=None):
        self.calls.append((project, init_kwargs))


class FakeTracker:
    name = "wandb"

    def __init__(self):
        self.logged = []

    def log_images(self, values, step=None, **kwargs):
        self.logged.append((values, step, kwargs))


def test_wandb_entity_run_name_and_tags_come_from_the_config(tmp_path):
    config = load_config(None, [f"output_dir={tmp_path}/my-run", "tracker=wandb", "wandb.entity=lab",
                                "wandb.name=nft-try-3", "wandb.tags=[shapes, nft]"])
    acc = FakeAccelerator()
    init_trackers(acc, config, {})
    assert acc.calls == [("my-run", {"wandb": {"entity": "lab", "name": "nft-try-3", "tags": ["shapes", "nft"]}})]
    config.wandb.project = "flowalign-sweeps"
    init_trackers(acc, config, {})
    assert acc.calls[-1][0] == "flowalign-sweeps"


def test_a_grid_goes_to_wandb_as_an_image():
    tracker = FakeTracker()
    log_grid(FakeAccelerator([tracker]), Image.new("RGB", (6, 4), "red"), step=3)
    (values, step, _), = tracker.logged
    assert step == 3 and values["eval/grid"].shape == (1, 4, 6, 3)


def wandb_records(path) -> list[bytes]:
    """The records of a ``run-*.wandb`` file: a 7-byte W&B header, then LevelDB's log format (32 KiB
    blocks; each chunk a 7-byte header: CRC-32C, length (2 bytes, little-endian), type 1 full /
    2 first / 3 middle / 4 last). Read here by hand: wandb ≥ 0.31 has no Python reader."""
    import struct

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break  # zero padding: the end of what was written
        pending += chunk
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def read_offline_wandb_history(run_dir) -> list[dict]:
    """The history rows (``wandb.log`` calls) of an offline run: [{key: value decoded from JSON}, ...];
    a media value arrives as one item per field (nested keys), nested back here into one dict."""
    import json

    from wandb.proto import wandb_internal_pb2

    import time

    (log_file,) = run_dir.glob("run-*.wandb")
    for _ in range(60):  # wandb's core process may still be writing after run.finish() returned
        records = [wandb_internal_pb2.Record.FromString(data) for data in wandb_records(log_file)]
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            break  # the exit record closes a complete log
        time.sleep(0.5)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                *path, last = [item.key] if item.key else list(item.nested_key)
                node = row
                for key in path:
                    node = node.setdefault(key, {})
                node[last] = json.loads(item.value_json)
            rows.append(row)
    return rows


def test_an_offline_wandb_run_holds_every_evaluation_grid_as_an_image(tiny_sd3_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account: the run is written under WANDB_DIR
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    Trainer(tiny_config(tiny_sd3_dir, tmp_path / "run", "tracker=wandb", "eval.every=1", "wandb.name=offline-try",
                        "wandb.tags=[test]")).train()
    (run_dir,) = (tmp_path / "wandb-dir" / "wandb").glob("offline-run-*")
    rows = read_offline_wandb_history(run_dir)
    grids = [(row["_step"], row["eval/grid"]) for row in rows if "eval/grid" in row]
    assert [step for step, _ in grids] == [0, 1, 2]  # before, epoch 1, after (epoch 2)
    saved = Image.open(tmp_path / "run" / "grids" / "after.png")
    for _, grid in grids:
        assert grid["_type"] == "images/separated" and grid["count"] == 1  # what wandb.Image logs
        assert (grid["width"], grid["height"]) == saved.size
        (name,) = grid["filenames"]
        assert (run_dir / "files" / name).is_file()
    logged = Image.open(run_dir / "files" / grids[-1][1]["filenames"][0]).convert("RGB")
    assert logged.tobytes() == saved.convert("RGB").tobytes()  # the very grid the run saved, lossless
    assert any("eval/score" in row for row in rows) and any("reward/mean" in row for row in rows)


def test_every_accelerate_tracker_is_accepted_by_name():
    from accelerate.utils import LoggerType

    from flowalign.config import CHOICES

    assert set(CHOICES["tracker"]) == {t.value for t in LoggerType} - {"all"} | {"none"}
    config = load_config(None, ["tracker=mlflow"])
    assert config.tracker == "mlflow"
    with pytest.raises(ConfigError, match="tracker must be one of"):
        load_config(None, ["tracker=neptune"])


def test_a_missing_tracker_package_names_its_pip_line(monkeypatch):
    from flowalign.outputs import check_tracker

    monkeypatch.setitem(sys.modules, "comet_ml", None)
    with pytest.raises(ConfigError, match="tracker: comet_ml is not installed; install it with `pip install comet-ml`"):
        check_tracker(load_config(None, ["tracker=comet_ml"]))
