"""A run's messages go through ``logging`` (logger ``flowalign``): redirectable and silenceable."""

import contextlib
import logging

import pytest

from flowalign.config import load_config
from flowalign.logs import ROOT
from flowalign.trainer import Trainer


def run(tiny_sd3_dir, out):
    Trainer(load_config(None, [
        f"output_dir={out}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.epochs=1", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=2",
        "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0"])).train()


@pytest.fixture
def flowalign_logger():
    logger = logging.getLogger(ROOT)
    saved = logger.handlers[:], logger.level
    logger.handlers = []
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.handlers = saved[0]
    logger.setLevel(saved[1])


@contextlib.contextmanager
def plain_script():
    """No handler on the root logger, as in a script that configures no logging (pytest's capture
    handlers, added for each test phase, are set aside meanwhile)."""
    root = logging.getLogger()
    saved, root.handlers = root.handlers[:], []
    try:
        yield
    finally:
        root.handlers = saved


def test_a_users_handler_gets_the_messages_instead_of_stdout(tiny_sd3_dir, tmp_path, capsys, flowalign_logger):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    flowalign_logger.addHandler(Keep())
    flowalign_logger.setLevel(logging.INFO)
    run(tiny_sd3_dir, tmp_path)
    messages = [r.getMessage() for r in records]
    assert any(m.startswith("determinism: threads 1") for m in messages), messages
    assert any(m.startswith("eval before: ") for m in messages) and any(m.startswith("eval after: ") for m in messages)
    assert {r.name for r in records} == {"flowalign.trainer", "flowalign.evaluator"}
    assert "eval before" not in capsys.readouterr().out  # redirected, not printed as well


def test_by_default_messages_print_and_a_level_silences_them(tiny_sd3_dir, tmp_path, capsys, flowalign_logger):
    with plain_script():
        run(tiny_sd3_dir, tmp_path / "a")
        assert "eval before: " in capsys.readouterr().out
        assert len(flowalign_logger.handlers) == 1
        flowalign_logger.setLevel(logging.WARNING)
        run(tiny_sd3_dir, tmp_path / "b")
        assert len(flowalign_logger.handlers) == 1  # added once, not again by the next run
    assert "eval before" not in capsys.readouterr().out
