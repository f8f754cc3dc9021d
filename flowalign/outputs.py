"""What a run shows beyond its own files: the trackers (TensorBoard, W&B) with every evaluation's
sample grid as an image, and the checks that a tracker and the launch's precision are what the
config says, made before any model loads (``check_tracker``, ``check_launch_precision``); a
hub-ready ``final/`` (model card, base model in the LoRA metadata) and ``flowalign push``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from flowalign.config import ConfigError, RunConfig, source_of

INSTALL = {"wandb": 'pip install wandb  (or: pip install "flowalign[wandb]")',
           "tensorboard": "pip install tensorboard"}


def check_tracker(config: RunConfig) -> None:
    """``tracker`` names a package that imports (Accelerate would otherwise drop it and log to nothing)."""
    if config.tracker != "none" and importlib.util.find_spec(config.tracker) is None:
        install = INSTALL.get(config.tracker, f"pip install {config.tracker.replace('_', '-')}")
        raise ConfigError(f"{source_of(config, 'tracker')}: tracker: {config.tracker} is not installed; install it "
                          f"with `{install}`, or set tracker=none (or tracker=tensorboard)")


def check_launch_precision(config: RunConfig, environ=os.environ) -> None:
    """The mixed precision of ``accelerate launch`` (``--mixed_precision`` or its config file's
    ``mixed_precision``, passed as ACCELERATE_MIXED_PRECISION) against ``train.mixed_precision``.
    The run's precision is the config's; a launch that asks for another one (fp16, bf16, fp8) is
    refused, never silently overridden. A launch with ``no`` (its default) leaves it to the config."""
    launched = environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    wanted = config.train.mixed_precision
    if launched != "no" and launched != wanted:
        raise ConfigError(f"{source_of(config, 'train.mixed_precision')}: train.mixed_precision is {wanted!r}, but "
                          f"accelerate launch asks for {launched!r} (--mixed_precision or its config file's "
                          f"mixed_precision); set train.mixed_precision={launched} or launch with --mixed_precision no "
                          f"(the run config decides the precision)")


def init_trackers(accelerator, config: RunConfig, project_config: dict) -> None:
    """Start the tracker: TensorBoard under ``output_dir``; W&B with the ``wandb:`` section."""
    if config.tracker == "none":
        return
    w = config.wandb
    project = (w.project if config.tracker == "wandb" else None) or Path(config.output_dir).name or "flowalign"
    if config.tracker == "tensorboard":
        project = ""  # TensorBoard writes to project_dir/<project>: "" puts the event files in output_dir itself
    init = {"wandb": {k: v for k, v in (("entity", w.entity), ("name", w.name), ("tags", w.tags)) if v}}
    accelerator.init_trackers(project, config=project_config, init_kwargs=init)


def log_grid(accelerator, grid, step: int, tag: str = "eval/grid") -> None:
    """An evaluation's sample grid (a PIL image) as an image in every tracker, at ``step`` (the
    epoch): TensorBoard's Images tab shows one slider from "before" to "after"; W&B a media panel."""
    if grid is None or not accelerator.is_main_process:
        return
    import numpy as np

    pixels = np.asarray(grid.convert("RGB"))[None]  # [1, H, W, 3] uint8
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({tag: pixels}, step=step, dataformats="NHWC")
        elif tracker.name == "wandb":
            tracker.log_images({tag: pixels}, step=step)


# -- hub-ready final/: model card (flowalign/model_card.py), LoRA metadata, push -------------------
def write_hub_files(out, config: RunConfig, summary: dict) -> Path:
    """``final/README.md``, a Hugging Face model card (flowalign/model_card.py; the before/after
    grid copied beside it), ``final/flowalign_config.yaml``, and the base model id, method and
    flowalign version in every LoRA file's safetensors metadata. Returns the card's path."""
    import shutil

    from flowalign import __version__
    from flowalign.model_card import write_card

    final = Path(out) / "final"
    grid = Path(out) / "grids" / "before_after.png"
    if grid.is_file():
        shutil.copyfile(grid, final / "before_after.png")
    stamp_lora_metadata(final, {"base_model": config.model.path, "flowalign_method": config.method,
                                "flowalign_version": __version__})
    return write_card(out, config, summary, grid.is_file())


def stamp_lora_metadata(folder, values: dict) -> list[Path]:
    """Add ``values`` to the safetensors metadata of every LoRA file under ``folder`` (diffusers reads
    only its own ``lora_adapter_metadata`` key, which is kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    stamped = []
    for path in sorted(Path(folder).rglob("*lora*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        save_file(load_file(str(path)), str(path), metadata={**metadata, **{k: str(v) for k, v in values.items()}})
        stamped.append(path)
    return stamped
