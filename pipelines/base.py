"""The adapter protocol: what the RL core needs from a model family, and nothing more.

An adapter wraps one diffusers pipeline. The samplers and objectives see only tensors and these
methods, so a new family is one new file here (``../shared/DESIGN.md``). Shapes: B samples,
latents ``x`` [B, ...] in the family's layout; ``Conditioning`` holds per-sample tensors [B, ...].
"""

from __future__ import annotations

import collections
import contextlib
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import ContextManager, Protocol, runtime_checkable

import torch
from torch import nn

DEMO_MODELS_DIR = Path(__file__).parent / "demo_models"


@dataclass
class Conditioning:
    """Per-sample model inputs by name; every tensor has the batch as its first dimension."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, index) -> "Conditioning":
        """Select samples: ``cond[idx]`` with an int tensor, slice or bool mask over the batch."""
        return Conditioning({k: v[index] for k, v in self.tensors.items()})

    def repeat_interleave(self, repeats: int) -> "Conditioning":
        return Conditioning({k: v.repeat_interleave(repeats, dim=0) for k, v in self.tensors.items()})

    def to(self, device) -> "Conditioning":
        return Conditioning({k: v.to(device) for k, v in self.tensors.items()})

    @staticmethod
    def cat(parts: list["Conditioning"]) -> "Conditioning":
        return Conditioning({k: torch.cat([p.tensors[k] for p in parts]) for k in parts[0].tensors})

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))


@dataclass
class Schedule:
    """What the pipeline's scheduler would use for S steps: the model's timestep inputs [S] and

    * sigmas float32 [S + 1]: the noise level of the latent before each step and after the last:
      the flow σ (σ_S = 0) for velocity models; sqrt(1 − ᾱ) for ε-prediction models (σ_S > 0
      when the scheduler does not set ᾱ to 1 after the last step, as SD's does not);
    * alphas_cumprod, alphas_cumprod_prev float32 [S] (ε-prediction models only, else None):
      ᾱ at each step's timestep and at the timestep it steps to, what the DDIM step reads.
    """

    sigmas: torch.Tensor
    timesteps: torch.Tensor
    alphas_cumprod: torch.Tensor | None = None
    alphas_cumprod_prev: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


def load_image(image):
    """A conditioning image (a path, or a PIL image) as an RGB PIL image."""
    from PIL import Image

    return (Image.open(image) if isinstance(image, (str, Path)) else image).convert("RGB")


def load_condition_image(image, height: int, width: int):
    """A conditioning image (a path, or a PIL image) as an RGB PIL image of height × width (resized
    when its size differs, bicubic): what an image-conditioned adapter encodes."""
    from PIL import Image

    image = load_image(image)
    return image if image.size == (width, height) else image.resize((width, height), Image.BICUBIC)


def encode_records(encode, records: list[dict]) -> Conditioning:
    """The conditioning of prompt records: ``encode(prompts)``, or ``encode(prompts, images=paths)``
    when the records carry a conditioning image ("image"; ``flowalign.prompts``). ``encode`` is an
    adapter's ``encode`` or a ``PromptEmbeddingCache``."""
    prompts = [r["prompt"] for r in records]
    images = [r.get("image") for r in records]
    if all(i is None for i in images):
        return encode(prompts)
    if any(i is None for i in images):
        raise ValueError("some prompt records carry a conditioning image and some do not: "
                         f"{prompts[images.index(None)]!r} has none")
    adapter = getattr(encode, "adapter", getattr(encode, "__self__", None))
    if not getattr(adapter, "conditioning_image", False):
        raise ValueError(f"the prompt records carry conditioning images, but model family "
                         f"{getattr(adapter, 'family', '?')!r} takes none (image-conditioned families: "
                         "flux_kontext, ...)")
    return encode(prompts, images=images)


def decode_samples(adapter, x0: torch.Tensor, cond=None):
    """``adapter.decode(x0)``; for a family whose samples leave out a part its conditioning fixes
    (``decodes_with_condition``: image-to-video / image-to-audio-video families whose first latent
    frame is the input image, kept out of x so that the sampler and the objectives see only what is
    generated) ``adapter.decode(x0, cond)``. ``cond``: the samples' ``Conditioning``, or a function
    returning it (called only for such a family, e.g. ``encode_records`` of the samples' records)."""
    if not getattr(adapter, "decodes_with_condition", False):
        return adapter.decode(x0)
    if cond is None:
        raise ValueError(f"model family {getattr(adapter, 'family', '?')!r} decodes its samples with their "
                         "conditioning (the input image's latent frame), and none was given")
    return adapter.decode(x0, cond() if callable(cond) else cond)


class Adapter(Protocol):
    """One model family, as the training loop uses it (``flowalign/trainer.py`` and the
    components it calls). ``prediction`` is "velocity" (flow matching), "epsilon" or "logits".
    ``modality`` (class attribute, "image" when absent): "video" for a family whose ``decode``
    returns frames float [B, F, 3, H, W] and whose constructor takes ``num_frames``;
    "audio_video" for a joint family (ltx2, av_demo): x is the joint latent [B, D] of
    ``pipelines/joint.py`` (video tokens then audio tokens, flattened; see ``JointAudioVideo``),
    and ``decode`` returns ``pipelines.joint.AudioVideoSamples`` (video float [B, F, 3, H, W] in
    [0, 1], audio float [B, A, T] in [-1, 1] with A channels, ``.mono`` [B, T], sample_rate, fps):
    what its rewards receive. Its constructor takes ``num_frames`` too.

    ε-prediction adapters also carry ``prediction_type`` and ``clip_sample_range`` (what the DDIM
    step reads); logits adapters ``initial_state(cond)`` (the masked start, ``Unmasking``).

    **Conditioning keys** (``encode``'s ``Conditioning.tensors``; every tensor [B, ...]): the
    adapter owns its keys, and only it reads them, with one convention the core relies on: a
    family with a pooled prompt vector names it ``"pooled"`` [B, P], and a family with token
    embeddings names them ``"embeds"`` [B, L, D] (sd, sdxl, sd3, flux, wan; sdxl adds
    ``"time_ids"``); a per-prompt vector for a learned helper (EXPLORENET) is ``"pooled"``, else
    the mean of ``"embeds"`` over tokens. Other families use keys of their own (av_demo:
    ``"text"``, ``"pooled"``; ltx2: ``"video_embeds"``, ``"audio_embeds"``, ``"mask"``; chess:
    ``"themes"``, ``"fixed"``)."""

    prediction: str
    model: nn.Module  # the denoiser (put in eval mode while sampling)

    def encode(self, prompts: list[str]) -> Conditioning: ...  # image-conditioned families: (prompts, images=)

    def initial_noise(self, batch: int, generator: torch.Generator) -> torch.Tensor: ...

    def schedule(self, num_steps: int) -> Schedule: ...

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float,
                model: nn.Module | None = None) -> torch.Tensor:
        """The model's output at x; ``model``: the module to run (the training wrapper), default its own."""

    def decode(self, x0: torch.Tensor) -> torch.Tensor: ...

    def trainable(self) -> nn.Module: ...

    def reference(self) -> ContextManager: ...

    def merged_lora(self) -> ContextManager: ...

    def add_lora(self, rank: int, alpha: float | None, targets: list[str] | None) -> None: ...

    def enable_full_finetune(self, keep_reference: bool) -> None: ...

    def enable_gradient_checkpointing(self) -> None: ...

    def trained_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def save_trained(self, directory: str | Path) -> None: ...


# -- optional capabilities: checked once (flowalign/preflight.py), never probed in the loop --------
@runtime_checkable
class JointAudioVideo(Protocol):
    """A joint audio-video latent: ``joint_layout`` (``pipelines.joint.JointLayout``) and
    ``branch_masks()`` bool [2, D] (video, audio)."""

    joint_layout: object

    def branch_masks(self) -> torch.Tensor: ...


@runtime_checkable
class CrossModalAttention(Protocol):
    """Cross-modal attention modules that can be named and recorded during a forward pass."""

    def cross_modal_attention(self) -> dict[str, tuple[str, nn.Module]]: ...

    def record_cross_modal(self, maps: bool = True, model: nn.Module | None = None): ...


@runtime_checkable
class NoisesForward(Protocol):
    """Forward noising of the adapter's own (per-stream noise levels: av_demo's video-first order):
    ``forward_noised(x0, noise, sigma) → (x0 as the loss compares it, x_t, sigma)``."""

    def forward_noised(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor): ...


@runtime_checkable
class SamplingOrder(Protocol):
    """``ode_only``: True when the model samples in an order only ODE rollouts can follow (video-first)."""

    ode_only: bool


@runtime_checkable
class Unmasking(Protocol):
    """Masked discrete diffusion (``prediction == "logits"``): ``sequence_length`` (the positions a
    fully masked rollout unmasks), the masked start of a rollout, and the family's own work around
    the unmasking steps: ``begin_unmasking(cond, sampling)`` → the conditioning the steps sample
    (and rescoring reads) with, ``finish_unmasking(final, cond, sampling)`` → the final states long
    [B, L] (not a step: no log-prob). Chess uses the two for its best-move schedule."""

    sequence_length: int

    def initial_state(self, cond: Conditioning) -> torch.Tensor: ...

    def begin_unmasking(self, cond: Conditioning, sampling) -> Conditioning: ...

    def finish_unmasking(self, final: torch.Tensor, cond: Conditioning, sampling) -> torch.Tensor: ...


def ode_only(adapter) -> bool:
    return isinstance(adapter, SamplingOrder) and bool(adapter.ode_only)


class ModelNotFoundError(FileNotFoundError):
    """A model name resolved to nothing loadable; the message lists what was tried."""


def resolve_model_path(name_or_path: str) -> str:
    """A built-in demo name (``"shapes-sd3"``), a local folder, or else a hub id, unchanged.

    Anything that looks like a path (starts with ``.``, ``/`` or ``~``, or names an existing
    file) must be an existing folder; the error then says which absolute path was tried.
    """
    demo = DEMO_MODELS_DIR / name_or_path
    if "/" not in name_or_path and demo.is_dir():
        return str(demo)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    demos = sorted(p.name for p in DEMO_MODELS_DIR.iterdir() if p.is_dir()) if DEMO_MODELS_DIR.is_dir() else []
    if "/" not in name_or_path and not path.exists():  # a hub id is owner/name: a misspelled demo name, not the hub
        close = difflib.get_close_matches(name_or_path, demos, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelNotFoundError(
            f"{name_or_path!r} is not a built-in demo model ({hint}built-in: {', '.join(demos) or 'none'}) nor a "
            f"local folder (tried {path.resolve()}); a hub id has the form owner/name")
    if name_or_path.startswith((".", "/", "~")) or path.exists() or name_or_path.count("/") > 1:
        raise ModelNotFoundError(
            f"model folder not found: tried {path.resolve()} (built-in demo models: {', '.join(demos) or 'none'})")
    return name_or_path


def _root_cause(error: BaseException) -> BaseException:
    """The first exception of ``error``'s chain (what went wrong, under the layers that re-raised it)."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    return error


def load_with_hub_fallback(loader, name_or_path: str, **kwargs):
    """Call ``loader(resolved, **kwargs)``; when a hub id cannot be fetched, say what was tried."""
    resolved = resolve_model_path(name_or_path)
    try:
        return loader(resolved, **kwargs)
    except OSError as error:
        if Path(resolved).is_dir():
            raise
        # diffusers' own message points to "the stacktrace above", which the command line does not print
        root = _root_cause(error)
        reason = (str(root).splitlines() or [""])[0]
        raise ModelNotFoundError(
            f"could not load {name_or_path!r}: no local folder {Path(name_or_path).resolve()} and the hub id "
            f"failed ({type(root).__name__}: {reason}). If the id is right and the model is not in the local "
            "Hugging Face cache, this machine needs the network (or HF_ENDPOINT / a proxy); elsewhere, "
            f"`huggingface-cli download {name_or_path}` fills the cache, or pass a local diffusers folder or a "
            "built-in demo name.") from error


@contextlib.contextmanager
def disabled_lora(model: nn.Module):
    """Run ``model`` with its peft adapters switched off (the reference policy of a LoRA run)."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


@contextlib.contextmanager
def merged_lora(model: nn.Module):
    """Run ``model`` with each active peft LoRA of its linear and conv layers folded into the base
    weight, W + ΔW (diffusers' ``fuse_lora``): one product per layer instead of three, the same
    function up to float rounding. For forward passes without gradient (the LoRA weights are
    bypassed). The base weights come back exactly: the original tensors are put back, not
    W + ΔW − ΔW."""
    from peft.tuners.lora import Conv2d, Linear

    saved = []
    try:
        with torch.no_grad():
            for layer in model.modules():
                if not isinstance(layer, (Linear, Conv2d)) or layer.merged or layer.disable_adapters:
                    continue
                names = [name for name in layer.active_adapters
                         if name in layer.lora_A and not layer.use_dora.get(name, False)]
                if not names:
                    continue
                base = layer.get_base_layer()
                saved.append((layer, base.weight.data))
                base.weight.data = base.weight.data + sum(layer.get_delta_weight(n) for n in names).to(base.weight.dtype)
                layer.merged_adapters = names
        yield
    finally:
        for layer, weight in saved:
            layer.get_base_layer().weight.data = weight
            layer.merged_adapters = []


class PromptEmbeddingCache:
    """``adapter.encode`` memoised per prompt (least recently used first out, ``size`` entries).

    Text encoders are frozen (only the denoiser trains), so a prompt's conditioning never changes;
    ``cache(prompts)`` encodes the prompts it does not hold and returns the ``Conditioning`` of
    all of them in order. New prompts are encoded one by one: batched encoders differ in the last
    bits with the batch's composition, and a cached value must not depend on which batch first
    met its prompt (a resumed run rebuilds the cache and must see the same numbers). A prompt set
    of at most ``size`` prompts is thus encoded once per run. Memory is ``size`` × one prompt's
    conditioning (the tiny demo models: a few kB; SD3 with 256 T5 tokens in bf16: ≈ 2.5 MB).
    ``offload=True`` keeps the text encoders (the pipeline's ``text_encoder*`` components) on the
    CPU between calls and moves them to the adapter's device only to encode new prompts: once a
    fixed prompt set is cached they hold no accelerator memory. Cached tensors stay where the
    adapter's ``encode`` put them.
    """

    def __init__(self, adapter, size: int, *, offload: bool = False):
        if size < 1:
            raise ValueError(f"a prompt cache needs size ≥ 1, got {size}")
        self.adapter, self.size, self.offload = adapter, size, offload
        self.entries: collections.OrderedDict[str | tuple[str, str], Conditioning] = collections.OrderedDict()
        pipe = getattr(adapter, "pipe", None)
        self.encoders = [m for name, m in (pipe.components.items() if pipe is not None else ())
                         if name.startswith("text_encoder") and isinstance(m, nn.Module)]
        if offload:
            for m in self.encoders:
                m.to("cpu")

    def __call__(self, prompts: list[str], images: list | None = None) -> Conditioning:
        """``images``: the conditioning images (paths) of an image-conditioned adapter; an entry is
        then one (prompt, image) pair."""
        # several input images per prompt (a list) key the cache as a tuple
        keys = list(prompts) if images is None else [(p, tuple(i) if isinstance(i, list) else i)
                                                    for p, i in zip(prompts, images)]
        new = list(dict.fromkeys(k for k in keys if k not in self.entries))
        fresh = {}
        if new:
            with self._encoders_on_device():  # one at a time: a prompt's entry does not depend on its batch
                fresh = {k: self.adapter.encode([k]) if images is None else self.adapter.encode([k[0]], images=[k[1]])
                         for k in new}
        out = Conditioning.cat([fresh[k] if k in fresh else self.entries[k] for k in keys])
        for key in dict.fromkeys(keys):  # most recently used last
            if key in fresh:
                self.entries[key] = fresh[key]
            self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return out

    @contextlib.contextmanager
    def _encoders_on_device(self):
        if not self.offload:
            yield
            return
        device = getattr(self.adapter, "device", "cpu")
        for m in self.encoders:
            m.to(device)
        try:
            yield
        finally:
            for m in self.encoders:
                m.to("cpu")
