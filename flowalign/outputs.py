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
        raise ConfigError(f"{source_of(config, 'tracker')}: tracker: {config.tracker} is not installed; install it "
                          f"with `{INSTALL[config.tracker]}`, or set tracker=none (or tracker=tensorboard)")


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


# -- hub-ready final/: model card, LoRA metadata, push -------------------------------------------
RESULT_SKIP = ("epoch", "samples", "train_seconds", "train_samples")


def write_hub_files(out, config: RunConfig, summary: dict) -> Path:
    """``final/README.md``, a Hugging Face model card (base model, method, reward, key settings,
    before/after numbers, the before/after grid copied beside it), and the base model id, method and
    flowalign version in every LoRA file's safetensors metadata. Returns the card's path."""
    import shutil

    final = Path(out) / "final"
    grid = Path(out) / "grids" / "before_after.png"
    if grid.is_file():
        shutil.copyfile(grid, final / "before_after.png")
    stamp_lora_metadata(final, {"base_model": config.model.path, "flowalign_method": config.method,
                                "flowalign_version": _version()})
    card = final / "README.md"
    card.write_text(model_card(config, summary, grid.is_file()))
    return card


def _version() -> str:
    from flowalign import __version__

    return __version__


def _hub_id(path: str) -> bool:
    """``owner/name`` and not a folder here: a hub id the card's ``base_model`` may name."""
    import re

    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", path)) and not Path(path).exists()


def model_card(config: RunConfig, summary: dict, with_grid: bool) -> str:
    """The card's text (YAML front matter for the hub, then Markdown)."""
    m, t, s, r = config.model, config.train, config.sampling, config.reward
    lora = m.lora_rank > 0
    tags = ["flowalign", config.method, "lora" if lora else "full-fine-tune", "reinforcement-learning"]
    front = ["---", "library_name: diffusers", *([f"base_model: {m.path}"] if _hub_id(m.path) else []),
             "tags:", *(f"- {tag}" for tag in tags), "---", ""]
    name = Path(config.output_dir).name or "flowalign run"
    what = f"a LoRA (rank {m.lora_rank})" if lora else "fully fine-tuned weights"
    lines = [f"# {name}", "",
             f"{what[0].upper()}{what[1:]} of `{m.path}` (model family `{m.family}`), trained with **{config.method}** "
             f"by flowalign {_version()} on the reward `{r.name}` "
             f"(weights {dict(r.weights)}).", ""]
    before, after = summary.get("before") or {}, summary.get("after") or {}
    rows = [(k, before[k], after[k]) for k in after if isinstance(after[k], float) and isinstance(before.get(k), float)
            and k not in RESULT_SKIP and not k.endswith(("_change", "_change_se"))]
    if rows:
        lines += [f"## Held-out evaluation ({after.get('samples', '?')} samples, the same noise before and after)", "",
                  "| metric | before | after | change |", "|---|---|---|---|",
                  *(f"| {k} | {b:.4f} | {a:.4f} | {a - b:+.4f} |" for k, b, a in rows), ""]
    settings = [("epochs", summary.get("epochs", t.epochs)), ("prompts × samples per epoch",
                f"{t.groups_per_epoch} × {t.group_size}"), ("learning rate", t.learning_rate),
                ("sampling steps", s.num_steps), ("η (SDE noise)", s.eta), ("guidance scale", s.guidance_scale),
                ("KL β", t.kl_beta), ("mixed precision", t.mixed_precision), ("seed", t.seed),
                ("train prompts", config.data.train_prompts), ("eval prompts", config.data.eval_prompts),
                ("training minutes", f"{summary.get('train_minutes', float('nan')):.1f}")]
    lines += ["## Settings", "", "| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in settings), "",
              "The whole config is the run folder's `config.json`.", ""]
    if with_grid:
        lines += ["## Samples", "", "![before (left) and after (right): held-out prompts × seeds](before_after.png)",
                  ""]
    load = (f'pipe = DiffusionPipeline.from_pretrained("{m.path}")\npipe.load_lora_weights("THIS_REPO_OR_FOLDER")'
            if lora else f'pipe = DiffusionPipeline.from_pretrained("{m.path}")  # then swap in the trained folder')
    lines += ["## Use", "", "```python", "from diffusers import DiffusionPipeline", "", load, "```", ""]
    return "\n".join(front + lines)


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


def push_run(run, repo_id: str, *, private: bool = False, endpoint: str | None = None, token: str | None = None,
             message: str | None = None):
    """Upload a finished run's ``final/`` (weights, model card, grid) to the hub repository
    ``repo_id`` with huggingface_hub's ``upload_folder``, creating the repository if needed.
    ``endpoint``: another hub (default: huggingface_hub's, HF_ENDPOINT). Returns the CommitInfo."""
    from huggingface_hub import HfApi

    folder = Path(run) / "final"
    if not (folder / "README.md").is_file():
        raise FileNotFoundError(f"{folder}: no final/README.md; push a finished run's folder (one that "
                                "`flowalign train` ran to the end)")
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(folder_path=str(folder), repo_id=repo_id,
                             commit_message=message or f"flowalign: {Path(run).resolve().name}")
