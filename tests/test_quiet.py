"""Library noise is off by default and back with --verbose: diffusers' loading bars and its
known-harmless "No LoRA keys associated to <text encoder>" warnings; other warnings stay."""

import logging
import os
import subprocess
import sys

from flowalign.quiet import LORA_LOGGERS, HarmlessLoraWarning, quiet


def test_only_the_harmless_lora_warning_is_dropped(monkeypatch):
    import diffusers.utils.logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    quiet()
    assert not diffusers.utils.logging.is_progress_bar_enabled()
    diffusers.utils.logging.enable_progress_bar()
    logger = logging.getLogger(LORA_LOGGERS[0])
    assert any(isinstance(f, HarmlessLoraWarning) for f in logger.filters)

    def record(message):
        return logging.LogRecord(LORA_LOGGERS[0], logging.WARNING, __file__, 1, message, None, None)

    assert not logger.filter(record("No LoRA keys associated to CLIPTextModelWithProjection found with the prefix"))
    assert logger.filter(record("Some other LoRA problem that matters"))


def _sample(tmp_path, *flags):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    return subprocess.run([sys.executable, "-m", "flowalign.cli", *flags, "sample", "a photo of a red circle",
                           "--seeds", "0", "--out", str(tmp_path / "s-{seed}.png")],
                          capture_output=True, text=True, env=env)


def test_loading_bars_only_with_verbose(tmp_path):
    quiet_run, verbose_run = _sample(tmp_path), _sample(tmp_path, "--verbose")
    assert quiet_run.returncode == verbose_run.returncode == 0, quiet_run.stderr[-2000:]
    assert "Loading pipeline components" not in quiet_run.stderr and "Loading weights" not in quiet_run.stderr
    assert "Loading pipeline components" in verbose_run.stderr
