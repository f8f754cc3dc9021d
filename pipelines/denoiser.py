"""What every adapter whose denoiser is one diffusers model (SD3's transformer, SD's UNet) does
the same way: loading, initial noise, classifier-free-guidance batching, LoRA, full
fine-tuning, the reference policy and saving.

A family subclasses ``DenoiserAdapter``, names its pipeline class and the pipeline attribute of
its denoiser (``model_folder``: "transformer", "unet"; also the folder a fully fine-tuned model
is saved to), and writes ``encode``, ``negative``, ``schedule`` and ``predict``; where its
pipeline differs from the image default it overrides ``default_size``, ``latent_shape``,
``vae_latents`` or ``decode``.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipelines.base import Conditioning, ModelNotFoundError, Schedule, disabled_lora, load_with_hub_fallback, merged_lora

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # what save_lora_weights writes
# the attention projections of joint (MMDiT) attention, image and text streams: SD3's and FLUX's
JOINT_ATTENTION_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                                "to_add_out")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def pad_tokens(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Text hidden states [B, L, D] and their mask [B, L] (None: all tokens real) → both zero-padded
    (or cut) to ``length`` tokens: what a ``Conditioning`` holds for a family whose pipeline feeds
    its transformer a variable number of text tokens, so that prompts encoded one by one concatenate."""
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    embeds, mask = embeds[:, :length], mask[:, :length].long()
    pad = length - embeds.shape[1]
    return torch.nn.functional.pad(embeds, (0, 0, 0, pad)), torch.nn.functional.pad(mask, (0, pad))


def trim_tokens(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``pad_tokens``' output [B, length, D], [B, length] → cut to the batch's longest prompt, as the
    pipeline pads a batch; the mask is None when every token is real (the pipeline then passes none)."""
    longest = int(mask.sum(dim=1).max())
    embeds, mask = embeds[:, :longest], mask[:, :longest]
    return embeds, (None if bool(mask.all()) else mask)


def mean_std_latents(x0: torch.Tensor, config) -> torch.Tensor:
    """x0 [B, C, F, h, w] · latents_std + latents_mean per channel, written as the Wan and Qwen-Image
    pipelines write it (x / (1 / std) + mean): what their VAE decodes."""
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(x0)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(x0)
    return x0 / inverse_std + mean


def load_trained_weights(pipe, trained: str | Path, model_folder: str, dtype: torch.dtype,
                         extra_folders: tuple[str, ...] = ()) -> None:
    """Put a ``save_trained`` folder's weights into ``pipe`` as plain diffusers would: LoRA weights
    fused in, or the fully fine-tuned ``<model_folder>/`` replacing the denoiser. A pipeline without
    diffusers' LoRA loader (the chess and av_demo ones) loads the LoRA into its model directly.
    ``extra_folders``: further denoisers (Wan 2.2's ``transformer_2``), whose LoRA is in
    ``<name>_lora/`` and loads with the pipeline's ``load_lora_weights(..., load_into_<name>=True)``."""
    trained = Path(trained)
    model = getattr(pipe, model_folder)
    if (trained / model_folder).is_dir():
        for name in (model_folder, *extra_folders):
            module = getattr(pipe, name)
            pipe.register_modules(**{name: type(module).from_pretrained(trained / name, torch_dtype=dtype)})
    elif (trained / LORA_WEIGHTS_NAME).is_file() and hasattr(pipe, "load_lora_weights"):
        pipe.load_lora_weights(trained)
        for name in extra_folders:
            pipe.load_lora_weights(trained / f"{name}_lora", **{f"load_into_{name}": True})
        pipe.fuse_lora(**({"components": [model_folder, *extra_folders]} if extra_folders else {}))
        pipe.unload_lora_weights()
    elif (trained / LORA_WEIGHTS_NAME).is_file():
        model.load_lora_adapter(trained, prefix=None, weight_name=LORA_WEIGHTS_NAME)
        model.fuse_lora()
        model.unload_lora()
    else:
        raise ModelNotFoundError(f"no trained weights in {trained.resolve()}: expected {LORA_WEIGHTS_NAME} "
                                 f"or a {model_folder}/ folder (a run's final/ or a checkpoint's policy/)")


class DenoiserAdapter:
    """The family-independent half of an adapter (see the module docstring).

    Attributes: ``pipe`` the diffusers pipeline; ``model`` its denoiser, unwrapped (peft and
    saving act on it); ``denoiser`` what forward passes call by default (the reference context
    may swap it); ``height``/``width`` of the images, by default ``default_size()``.
    """

    pipeline_class: type
    model_folder: str
    lora_targets: tuple[str, ...]
    # what a family declares (read by the core as they are, never probed): its output ("image", "video",
    # "audio_video"; pipelines.base.Adapter), whether xformers / gradient checkpointing work on its denoiser,
    # the values of sampling.move_schedule it has (a best-move head: chess), whether prompt records carry
    # a conditioning "image" and whether decode needs the conditioning (image-to-video families), and the
    # pipeline classes of other families whose folders it also loads (a folder that pipelines.detect_family
    # reads as one of those is not refused: Wan 2.2 TI2V-5B's WanPipeline folder loads as wan_i2v)
    modality: str = "image"
    supports_xformers: bool = True
    supports_gradient_checkpointing: bool = True
    move_schedules: tuple[str, ...] = ()
    conditioning_image: bool = False
    decodes_with_condition: bool = False
    also_loads: tuple[str, ...] = ()
    negative_prompt: str = ""  # CFG's negative branch (families with a ``negative_prompt`` option set their own)
    # train.detach_uncond (set by the trainer): CFG's unconditional branch carries no gradient. The
    # values are the same either way (up to float rounding where it runs on its own: splits_uncond);
    # only the training gradient differs (uncond_branch)
    detach_uncond: bool = False
    detach_uncond_supported: bool = True  # False where the family's CFG does not go through uncond_branch
    # False where CFG does not go through ``guided`` (which records and reuses the rollout's unconditional
    # prediction: ``recording_uncond`` / ``given_uncond``, Flow-GRPO's ``train.reuse_rollout_uncond``)
    rollout_uncond_supported: bool = True
    _uncond_record: list | None = None
    _uncond_given: torch.Tensor | None = None

    def __init__(self, pipe, *, device: str | torch.device = "cpu", height: int | None = None,
                 width: int | None = None):
        self.pipe = pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.device = torch.device(device)
        self.model: nn.Module = getattr(pipe, self.model_folder)
        self.denoiser: nn.Module = self.model  # the trainer may pass its wrapped module as ``model=``
        default_height, default_width = self.default_size()
        self.height = height or default_height
        self.width = width or default_width
        self.lora = False
        self._frozen_reference: nn.Module | None = None
        self._negative: Conditioning | None = None
        for part in pipe.components.values():
            if isinstance(part, nn.Module):
                part.requires_grad_(False).eval()

    @classmethod
    def pipeline_kwargs(cls, path: str) -> dict:
        """Extra ``from_pretrained`` arguments for the folder or hub id ``path`` (e.g. parts to skip)."""
        return {}

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
                        trained: str | Path | None = None, **kwargs):
        """Load from a built-in demo name, a local diffusers folder or a hub id. ``trained``: a
        folder written by ``save_trained`` (a run's ``final/`` or a checkpoint's ``policy/``),
        loaded as plain diffusers would: LoRA weights fused in, or its ``<model_folder>/``."""
        dtype_ = torch_dtype(dtype)

        def load(path, **kw):
            return cls.pipeline_class.from_pretrained(path, dtype=dtype_, **cls.pipeline_kwargs(path), **kw)

        pipe = load_with_hub_fallback(load, name_or_path)
        if trained is not None:
            load_trained_weights(pipe, trained, cls.model_folder, dtype_, cls.extra_folders(pipe))
        return cls(pipe, device=device, **kwargs)

    @classmethod
    def possible_extra_folders(cls) -> dict[str, str]:
        """Further denoisers a checkpoint of this family may have, by pipeline attribute, with their
        role (what the dry run says it would train, before any weight is read): none by default."""
        return {}

    @classmethod
    def extra_folders(cls, pipe) -> tuple[str, ...]:
        """The pipeline attributes of denoisers besides ``model_folder`` (Wan 2.2's ``transformer_2``)."""
        return ()

    def denoisers(self) -> dict[str, nn.Module]:
        """Every denoiser by its pipeline attribute, ``model_folder``'s first: what LoRA, the reference
        policy, gradient checkpointing and saving act on (one, unless ``extra_folders`` names more)."""
        return {self.model_folder: self.model}

    # -- sampling ------------------------------------------------------------------------
    def default_size(self) -> tuple[int, int]:
        """(height, width) in pixels when none is given, as the pipeline's default: its
        ``default_sample_size`` (FLUX, Qwen-Image, FLUX.2, SD3, SDXL) or else the denoiser's sample
        size, times the VAE's compression."""
        size = getattr(self.pipe, "default_sample_size", None) or self.model.config.sample_size
        size_h, size_w = (size, size) if isinstance(size, int) else size
        return size_h * self.pipe.vae_scale_factor, size_w * self.pipe.vae_scale_factor

    def check_size(self, multiple: int, why: str) -> None:
        """Refuse a height or width that is not a multiple of ``multiple`` (``why``: the pipeline's reason)."""
        if self.height % multiple or self.width % multiple:
            raise ValueError(f"{why}: height and width must be multiples of {multiple}, got {self.height}×{self.width}")

    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one sample's latent x, without the batch: (C, h, w) by default."""
        f = self.pipe.vae_scale_factor
        return (self.model.config.in_channels, self.height // f, self.width // f)

    def initial_noise(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Standard normal [B, *latent_shape()], drawn as the pipeline draws it from the same generator."""
        return torch.randn((batch, *self.latent_shape()), generator=generator, device=generator.device,
                           dtype=torch.float32).to(self.device)

    def flow_schedule(self, num_steps: int, **set_timesteps_kwargs) -> Schedule:
        """The σ's [S + 1] and timesteps [S] that ``self.scheduler`` (a ``FlowMatchEulerDiscreteScheduler``)
        sets for ``num_steps`` with the pipeline's ``set_timesteps`` arguments (``mu``, ``sigmas``)."""
        self.scheduler.set_timesteps(num_steps, device=self.device, **set_timesteps_kwargs)
        return Schedule(sigmas=self.scheduler.sigmas.float().clone(), timesteps=self.scheduler.timesteps.clone())

    def shifted_flow_schedule(self, num_steps: int, image_seq_len: int | None = None) -> Schedule:
        """What FLUX.1, Qwen-Image and Z-Image set: σ's linspace(1, 1/S, S), shifted with mu =
        calculate_shift(image_seq_len) (the scheduler config's base/max sequence lengths and shifts,
        FLUX's defaults where it has none) when the scheduler shifts dynamically, else by its fixed shift.
        ``image_seq_len`` None: the number of 2×2 patches of the (C, h, w) latent, as those pipelines pack it."""
        if image_seq_len is None:
            _, h, w = self.latent_shape()
            image_seq_len = (h // 2) * (w // 2)
        config = self.scheduler.config
        base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
        base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
        slope = (max_shift - base_shift) / (max_len - base_len)
        mu = image_seq_len * slope + (base_shift - slope * base_len)  # calculate_shift's arithmetic, to the bit
        return self.flow_schedule(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def negative(self) -> Conditioning:
        """The negative branch of CFG [1, ...]: ``negative_prompt``'s conditioning ("" unless the
        family takes one), as the pipeline makes it (cached)."""
        if self._negative is None:
            self._negative = self.encode([self.negative_prompt])
        return self._negative

    def negative_tensors(self, cond: Conditioning) -> dict[str, torch.Tensor]:
        """The unconditional branch's conditioning tensors for the B samples of ``cond`` [B, ...]:
        ``negative()``'s, expanded; a tensor it lacks (a conditioning image) is the sample's own."""
        negative = self.negative().tensors
        return {k: negative[k].expand(len(v), *v.shape[1:]) if k in negative else v for k, v in cond.tensors.items()}

    def guidance_inputs(self, x: torch.Tensor, cond: Conditioning, guidance_scale: float):
        """(x, conditioning tensors) for the denoiser: with CFG (guidance_scale > 1) both doubled to
        [2B, ...] as [unconditional, conditional], the pipelines' order; a conditioning image's tensors
        (absent from ``negative()``) are the same in both halves."""
        if guidance_scale <= 1.0:
            return x, cond.tensors
        negative = self.negative_tensors(cond)
        return torch.cat([x, x]), {k: torch.cat([negative[k], v]) for k, v in cond.tensors.items()}

    def splits_uncond(self) -> bool:
        """True when CFG's unconditional branch runs as its own forward pass without a graph: under
        ``detach_uncond`` while gradients are recorded (a training forward). It carries no gradient
        then, so recording it would only cost its activations and its share of the backward pass."""
        return self.detach_uncond and torch.is_grad_enabled()

    def guided(self, forward, x: torch.Tensor, cond: Conditioning, guidance_scale: float, combine=None):
        """CFG around one denoiser call ``forward(x, tensors) → output [n, ...]`` (x [n, ...], tensors
        the conditioning tensors of its n rows): the guided output [B, ...], or ``forward(x, cond)``
        without CFG. ``combine(uncond, text)``: the guidance rule, by default uncond + g·(text − uncond).
        The two branches run as one batch of 2B rows, as the pipelines run them; under
        ``splits_uncond()`` the unconditional one runs on its own under ``torch.no_grad()`` (the same
        values up to float rounding, the same gradient as detaching it from the batched call)."""
        if guidance_scale <= 1.0:
            return forward(x, cond.tensors)
        if combine is None:
            def combine(uncond, text):
                return uncond + guidance_scale * (text - uncond)
        if self.splits_uncond():
            if self._uncond_given is not None:  # the rollout's, for these rows (given_uncond)
                return combine(self._uncond_given.to(x.device), forward(x, cond.tensors))
            with torch.no_grad():
                uncond = forward(x, self.negative_tensors(cond))
            return combine(uncond, forward(x, cond.tensors))
        x, tensors = self.guidance_inputs(x, cond, guidance_scale)
        uncond, text = forward(x, tensors).chunk(2)
        if self._uncond_record is not None:
            self._uncond_record.append(uncond.detach())
        return combine(self.uncond_branch(uncond), text)

    @contextlib.contextmanager
    def recording_uncond(self):
        """Inside: every CFG call of ``guided`` that runs the two branches as one batch appends its
        unconditional prediction [B, ...] to the yielded list (a rollout keeps them per step)."""
        self._uncond_record = record = []
        try:
            yield record
        finally:
            self._uncond_record = None

    @contextlib.contextmanager
    def given_uncond(self, uncond: torch.Tensor):
        """Inside: a training forward (``splits_uncond``) takes ``uncond`` [B, ...] as CFG's
        unconditional prediction instead of running that branch (it carries no gradient there)."""
        self._uncond_given = uncond
        try:
            yield
        finally:
            self._uncond_given = None

    def batch_timesteps(self, t, batch: int) -> torch.Tensor:
        """t (scalar, or [B] per sample) as [batch] on the adapter's device; a per-sample t is
        repeated for the two halves of a CFG batch (batch = 2B)."""
        t = torch.as_tensor(t, device=self.device)
        if t.ndim == 1 and 0 < len(t) < batch:
            t = t.repeat(batch // len(t))
        return t.expand(batch)

    def uncond_branch(self, uncond: torch.Tensor) -> torch.Tensor:
        """CFG's unconditional prediction as the guided output uses it: detached under
        ``detach_uncond`` (Flow-GRPO's original train_sd3.py), so that with g the guided gradient is
        g·∇cond instead of (1 − g)·∇uncond + g·∇cond."""
        return uncond.detach() if self.detach_uncond else uncond

    # -- decoding ------------------------------------------------------------------------
    def vae_latents(self, x0: torch.Tensor) -> torch.Tensor:
        """What the pipeline hands its VAE decoder: x0 / scaling_factor, + shift_factor where the VAE
        config has one (SD3, FLUX)."""
        config = self.pipe.vae.config
        latents = x0 / config.scaling_factor
        shift = getattr(config, "shift_factor", None)
        return latents if shift is None else latents + shift

    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] → images float [B, 3, H, W] in [0, 1] (the pipeline's "pt" output,
        without any safety checker)."""
        vae = self.pipe.vae
        images = vae.decode(self.vae_latents(x0).to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def enable_vae_tiling(self, **tile_sizes) -> None:
        """Decode in overlapping spatial tiles: less memory for large samples; pixels near tile seams
        differ slightly from an untiled decode. ``tile_sizes``: the VAE's ``enable_tiling`` arguments
        (``AutoencoderKLWan``: tile_sample_min_height, …; ``AutoencoderKL`` takes none)."""
        self._vae_switch("enable_tiling", **tile_sizes)

    def enable_vae_slicing(self) -> None:
        """Decode one sample of a batch at a time: less memory, the same output."""
        self._vae_switch("enable_slicing")

    def _vae_switch(self, name: str, **kwargs) -> None:
        vae = self.pipe.vae
        if not hasattr(vae, name):
            raise ValueError(f"{type(vae).__name__} has no {name}(): this VAE cannot decode that way")
        getattr(vae, name)(**kwargs)

    # -- training ------------------------------------------------------------------------
    def add_lora(self, rank: int, alpha: float | None = None, targets: tuple[str, ...] | list[str] | None = None,
                 init: str | bool = "gaussian") -> None:
        """Attach a peft LoRA to each denoiser; only its weights train (kept in float32)."""
        from peft import LoraConfig

        for model in self.denoisers().values():
            model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights=init,
                                         target_modules=list(targets or self.lora_targets)))
        for p in self.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        self.lora = True

    def enable_full_finetune(self, keep_reference: bool) -> None:
        """Train every denoiser weight; ``keep_reference`` keeps a frozen copy for the KL."""
        if keep_reference:
            self._frozen_reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.model.requires_grad_(True)

    def trainable(self) -> nn.Module:
        return self.model

    @contextlib.contextmanager
    def reference(self):
        """Inside this context ``predict`` is the reference policy (LoRA off, or the frozen copy)."""
        if self.lora:
            with contextlib.ExitStack() as stack:
                for model in self.denoisers().values():
                    stack.enter_context(disabled_lora(model))
                yield
        elif self._frozen_reference is not None:
            current, self.denoiser = self.denoiser, self._frozen_reference
            try:
                yield
            finally:
                self.denoiser = current
        else:
            raise RuntimeError("no reference policy: full fine-tuning was set up without keep_reference")

    @contextlib.contextmanager
    def merged_lora(self):
        """Inside this context a LoRA's forward passes run on merged weights (``pipelines.base.merged_lora``;
        no gradient); nothing changes for full fine-tuning."""
        with contextlib.ExitStack() as stack:
            if self.lora:
                for model in self.denoisers().values():
                    stack.enter_context(merged_lora(model))
            yield

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights: the LoRA layers in peft/diffusers naming, or the whole denoiser; with
        several denoisers each one's keys are prefixed with its name and a dot."""
        parts = {name: self._trained_state_dict(model) for name, model in self.denoisers().items()}
        if len(parts) == 1:
            return next(iter(parts.values()))
        return {f"{name}.{k}": v for name, part in parts.items() for k, v in part.items()}

    def _trained_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self.lora:
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(model)
        return model.state_dict()

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        denoisers = self.denoisers()
        for name, model in denoisers.items():
            part = state if len(denoisers) == 1 else {k[len(name) + 1:]: v for k, v in state.items()
                                                       if k.startswith(f"{name}.")}
            if self.lora:
                from peft import set_peft_model_state_dict

                result = set_peft_model_state_dict(model, part)
                if getattr(result, "unexpected_keys", None):
                    raise KeyError(f"unexpected LoRA keys: {result.unexpected_keys[:5]}")
            else:
                model.load_state_dict(part)

    def save_trained(self, directory: str | Path) -> None:
        """LoRA → ``pytorch_lora_weights.safetensors`` with its peft config (rank, alpha, targets) as
        metadata, so ``pipe.load_lora_weights(directory)`` loads it at the trained scale; full
        fine-tuning → a diffusers ``<model_folder>/`` folder. A pipeline without diffusers' LoRA
        loader saves with its model's ``save_lora_adapter`` (same file, same metadata). A further
        denoiser (``extra_folders``) goes to ``<name>_lora/`` (LoRA, in the first one's format, for
        ``load_lora_weights(..., load_into_<name>=True)``) or ``<name>/``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for i, (name, model) in enumerate(self.denoisers().items()):
            if self.lora and not hasattr(self.pipeline_class, "save_lora_weights"):
                model.save_lora_adapter(directory, safe_serialization=True)
            elif self.lora:
                first = self.model_folder
                self.pipeline_class.save_lora_weights(
                    directory if i == 0 else directory / f"{name}_lora", safe_serialization=True,
                    **{f"{first}_lora_layers": self._trained_state_dict(model),
                       f"{first}_lora_adapter_metadata": model.peft_config["default"].to_dict()})
            else:
                model.save_pretrained(directory / name, safe_serialization=True)

    def lora_metadata(self) -> dict:
        return next(iter(self.denoisers().values())).peft_config["default"].to_dict()

    def enable_gradient_checkpointing(self) -> None:
        for model in self.denoisers().values():
            model.enable_gradient_checkpointing()

    def enable_xformers(self) -> None:
        self.pipe.enable_xformers_memory_efficient_attention()
