"""A run's model card, ``final/README.md``, built with huggingface_hub's ``ModelCard`` /
``ModelCardData``: the hub's front matter (license carried from the base model, ``base_model``,
``pipeline_tag``, ``lora`` and ``base_model:adapter:`` tags, a widget from the evaluation grid),
then the before/after table, the settings, and a "Use" snippet that runs as printed (its base
model loads with a plain ``DiffusionPipeline.from_pretrained``, passing visibly the components a
built-in demo model leaves out). ``final/flowalign_config.yaml`` holds the whole run config, so
``flowalign train final/flowalign_config.yaml`` repeats the run.

The license: ``model.license`` when set (a recipe or the command line), else a known base's
(``KNOWN_BASES``: its hub license, or its own non-commercial one), else the base folder's own
card, else ``other`` with a line asking for ``model.license``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from flowalign.config import RunConfig, to_dict

CONFIG_FILE = "flowalign_config.yaml"
LORA_FILE = "pytorch_lora_weights.safetensors"
DEMO_LICENSE = "apache-2.0"  # the built-in demo models ship in this repository, under its license

# hub id → (license, license_name, license_link, gated): the bases the recipes name. A base whose
# license is not one of the hub's standard ids has license "other" and its own name and link.
_FLUX_NC = ("other", "flux-1-dev-non-commercial-license",
            "https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/LICENSE.md", True)
KNOWN_BASES = {
    "black-forest-labs/FLUX.1-dev": _FLUX_NC,
    "black-forest-labs/FLUX.1-Kontext-dev": (
        "other", "flux-1-dev-non-commercial-license",
        "https://huggingface.co/black-forest-labs/FLUX.1-Kontext-dev/blob/main/LICENSE.md", True),
    "black-forest-labs/FLUX.1-schnell": ("apache-2.0", None, None, False),
    "stabilityai/stable-diffusion-3.5-medium": (
        "other", "stabilityai-ai-community",
        "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium/blob/main/LICENSE.md", True),
    "stable-diffusion-v1-5/stable-diffusion-v1-5": ("creativeml-openrail-m", None, None, False),
    "Qwen/Qwen-Image": ("apache-2.0", None, None, False),
    "Qwen/Qwen-Image-Edit": ("apache-2.0", None, None, False),
    "Qwen/Qwen-Image-Edit-2509": ("apache-2.0", None, None, False),
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ("apache-2.0", None, None, False),
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": ("apache-2.0", None, None, False),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": ("apache-2.0", None, None, False),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": ("apache-2.0", None, None, False),
    "Tongyi-MAI/Z-Image-Turbo": ("apache-2.0", None, None, False),
}

PIPELINE_TAGS = {"wan": "text-to-video", "ltx2": "text-to-video", "flux_kontext": "image-to-image",
                 "qwen_image_edit": "image-to-image", "qwen_image_edit_plus": "image-to-image",
                 "wan_i2v": "image-to-video", "ltx2_i2av": "image-to-video", "chess": None, "av_demo": None}
RESULT_SKIP = ("epoch", "samples", "train_seconds", "train_samples")


def demo_model(name: str) -> str:
    """The folder of a built-in demo model (``"shapes-sd3"``), for ``from_pretrained``."""
    from pipelines.base import DEMO_MODELS_DIR

    folder = DEMO_MODELS_DIR / name
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"{name!r} is not a built-in demo model; built-in: "
                                f"{', '.join(sorted(p.name for p in DEMO_MODELS_DIR.iterdir() if p.is_dir()))}")
    return str(folder)


def hub_id(path: str) -> bool:
    """``owner/name`` and not a folder here: a hub id the card's ``base_model`` may name."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", path)) and not Path(path).exists()


def base_kind(path: str) -> str:
    """"demo" (a built-in demo model's name), "hub" (a hub id) or "folder" (a local folder)."""
    from pipelines.base import DEMO_MODELS_DIR

    if "/" not in path and (DEMO_MODELS_DIR / path).is_dir():
        return "demo"
    return "hub" if hub_id(path) else "folder"


def base_license(config: RunConfig) -> tuple[dict, str | None]:
    """The card's license fields and, when the license is not known, a line saying so."""
    m = config.model
    if m.license:
        return {"license": m.license}, None
    kind = base_kind(m.path)
    if kind == "demo":
        return {"license": DEMO_LICENSE}, None
    if m.path in KNOWN_BASES:
        license, name, link, _ = KNOWN_BASES[m.path]
        return {k: v for k, v in (("license", license), ("license_name", name), ("license_link", link)) if v}, None
    if kind == "folder" and (Path(m.path) / "README.md").is_file():
        from huggingface_hub import ModelCard

        data = ModelCard.load(Path(m.path) / "README.md").data
        if data.license:
            return {k: getattr(data, k, None) for k in ("license", "license_name", "license_link")
                    if getattr(data, k, None)}, None
    return {"license": "other"}, (f"The base model's license is not known to flowalign: set `model.license` "
                                  f"(a hub license id) and check `{m.path}`'s own terms before sharing.")


def _pipeline_loading(config: RunConfig) -> tuple[str, list[str]]:
    """The ``from_pretrained`` source expression and the keyword arguments a plain load needs: the
    components a local model_index.json sets to null that the pipeline class requires (the built-in
    SD3 demo has no T5 encoder: ``text_encoder_3=None, tokenizer_3=None``)."""
    m = config.model
    kind = base_kind(m.path)
    source = f'flowalign.demo_model("{m.path}")' if kind == "demo" else json.dumps(m.path)
    extra = []
    index = Path(demo_model(m.path) if kind == "demo" else m.path) / "model_index.json"
    if kind != "hub" and index.is_file():
        import diffusers

        spec = json.loads(index.read_text())
        pipeline_cls = getattr(diffusers, spec.get("_class_name", ""), None)  # a diffusers pipeline class
        optional = set(getattr(pipeline_cls, "_optional_components", []))
        extra = [f"{name}=None" for name, value in spec.items() if isinstance(value, list) and value[0] is None
                 and name not in optional]
    return source, extra


def use_snippet(config: RunConfig, weights: str, prompt: str) -> str:
    """Python that loads the base, the trained weights at ``weights`` (a folder or a hub repo) and
    makes one image (one video for video families) with the run's sampling settings."""
    m, s = config.model, config.sampling
    source, extra = _pipeline_loading(config)
    lines = ["import torch", "from diffusers import DiffusionPipeline"]
    if source.startswith("flowalign."):
        lines += ["", "import flowalign  # the base is flowalign's built-in demo model (it ships in the package)"]
    load_args = [source, *extra, f"dtype=torch.{m.dtype}"]
    if extra:
        lines += [f"# {', '.join(extra)}: components this base leaves out (null in its model_index.json)"]
    lines += ["", f"pipe = DiffusionPipeline.from_pretrained({', '.join(load_args)})"]
    if m.lora_rank > 0:
        lines += [f"pipe.load_lora_weights({json.dumps(weights)})"]
    else:
        folder = "unet" if m.family in ("sd", "sdxl") else "transformer"
        lines += [f"pipe.{folder} = type(pipe.{folder}).from_pretrained({json.dumps(weights)}, subfolder={folder!r}, "
                  f"dtype=torch.{m.dtype})"]
    call = [json.dumps(prompt), f"num_inference_steps={config.eval.num_steps or s.num_steps}",
            f"guidance_scale={s.guidance_scale}"]
    call += [f"{k}={v}" for k, v in (("height", m.height), ("width", m.width)) if v]
    lines += ['pipe.to("cuda" if torch.cuda.is_available() else "cpu")',
              f"image = pipe({', '.join(call)}, generator=torch.Generator().manual_seed(0)).images[0]",
              'image.save("sample.png")']
    return "\n".join(lines)


def card_data(config: RunConfig, prompt: str | None, with_grid: bool):
    """The front matter: a ``huggingface_hub.ModelCardData``."""
    from huggingface_hub import ModelCardData

    m = config.model
    kind = base_kind(m.path)
    lora = m.lora_rank > 0
    tags = ["flowalign", config.method, "reinforcement-learning", m.family, "diffusers",
            "lora" if lora else "full-fine-tune"]
    if kind == "hub":
        tags.append(f"base_model:{'adapter' if lora else 'finetune'}:{m.path}")
    pipeline_tag = PIPELINE_TAGS.get(m.family, "text-to-image")
    widget = [{"text": prompt, "output": {"url": "before_after.png"}}] if with_grid and prompt else None
    license, _ = base_license(config)
    return ModelCardData(library_name="diffusers", base_model=m.path if kind != "folder" else None,
                         pipeline_tag=pipeline_tag, tags=tags, widget=widget, **license)


def first_grid_prompt(out: Path) -> str | None:
    """The first row's prompt of the run's evaluation grid (``grids/after.txt``, ``row 0: ...``)."""
    path = Path(out) / "grids" / "after.txt"
    if not path.is_file():
        return None
    first = path.read_text().splitlines()[0]
    return first.split(": ", 1)[1] if ": " in first else first


def write_card(out, config: RunConfig, summary: dict, with_grid: bool, weights: str | None = None) -> Path:
    """``final/README.md`` and ``final/flowalign_config.yaml``; ``weights``: where the snippet
    loads the trained weights from (default: the run's ``final/`` folder as the run named it)."""
    from huggingface_hub import ModelCard

    final = Path(out) / "final"
    (final / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    prompt = first_grid_prompt(Path(out)) or "a photo of a cat"
    data = card_data(config, prompt, with_grid)
    text = card_text(config, summary, with_grid, weights or str(Path(config.output_dir) / "final"), prompt)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}")
    card.save(final / "README.md")
    return final / "README.md"


def card_text(config: RunConfig, summary: dict, with_grid: bool, weights: str, prompt: str) -> str:
    """The card's Markdown below the front matter."""
    from flowalign import __version__

    m, t, s, r = config.model, config.train, config.sampling, config.reward
    lora = m.lora_rank > 0
    name = Path(config.output_dir).name or "flowalign run"
    what = f"A LoRA (rank {m.lora_rank})" if lora else "Fully fine-tuned weights"
    lines = [f"# {name}", "",
             f"{what} of `{m.path}` (model family `{m.family}`), trained with **{config.method}** by flowalign "
             f"{__version__} on the reward `{r.name}` (weights {dict(r.weights)}).", ""]
    kind = base_kind(m.path)
    if kind == "demo":
        lines += [f"`{m.path}` is flowalign's built-in demo model: it ships in the flowalign package "
                  f"(`flowalign.demo_model(\"{m.path}\")` is its folder), not on the hub.", ""]
    elif kind == "folder":
        lines += [f"`{m.path}` is a local folder, not a hub repository.", ""]
    license, unknown = base_license(config)
    if license.get("license_name"):
        lines += [f"License: the base model's, **{license['license_name']}** ({license['license_link']}); "
                  f"it applies to these weights too.", ""]
    if unknown:
        lines += [unknown, ""]
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
                ("KL β", t.kl_beta), ("EMA decay", t.ema_decay), ("mixed precision", t.mixed_precision),
                ("seed", t.seed), ("train prompts", config.data.train_prompts),
                ("eval prompts", config.data.eval_prompts),
                ("training minutes", f"{summary.get('train_minutes', float('nan')):.1f}")]
    lines += ["## Settings", "", "| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in settings), "",
              f"The whole run config: [`{CONFIG_FILE}`]({CONFIG_FILE}) (`flowalign train {CONFIG_FILE}` repeats "
              "the run).", ""]
    if with_grid:
        lines += ["## Samples", "", "![before (left) and after (right): held-out prompts × seeds](before_after.png)",
                  ""]
    if m.family in PIPELINE_TAGS and PIPELINE_TAGS[m.family] is None:  # no diffusers pipeline: flowalign's own
        lines += ["## Use", "", "```bash", f"flowalign sample --model {m.path} --weights {weights}", "```", ""]
    else:
        lines += ["## Use", "", "```python", use_snippet(config, weights, prompt), "```", ""]
    return "\n".join(lines)


def retarget(card_path: Path, old: str, new: str, keep_base_model: bool) -> str:
    """The card's text with the snippet's weights location ``old`` replaced by ``new`` (a hub repo
    at push time); ``base_model`` dropped from the front matter when it is no hub id (the hub
    refuses a card whose ``base_model`` names no repository)."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(card_path)
    if not keep_base_model:
        card.data.base_model = None
    text = card.content.replace(json.dumps(old), json.dumps(new))
    body = text.split("---", 2)[2] if text.startswith("---") else text
    return f"---\n{card.data.to_yaml()}\n---{body}"
