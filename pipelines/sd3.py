"""Adapter for the Stable Diffusion 3 / 3.5 family (``StableDiffusion3Pipeline``).

Latents x: [B, C, h, w] with h = H / vae_scale_factor; the transformer predicts the velocity
v ≈ ε − x0 at timestep t = 1000·σ. Classifier-free guidance batches [unconditional, conditional]
exactly as the pipeline does, so at η = 0 a rollout reproduces the pipeline's output.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from torch import nn

from pipelines.base import Conditioning, ModelNotFoundError, Schedule, disabled_lora, load_with_hub_fallback

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # what save_lora_weights writes
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def _without_t5(path: str) -> bool:
    """True when a local SD3 folder was saved without the T5 encoder (its model_index slot is null)."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return False
    slot = json.loads(index.read_text()).get("text_encoder_3")
    return slot is None or slot == [None, None]


class SD3Adapter:
    """A ``StableDiffusion3Pipeline`` as the RL core sees it.

    ``max_sequence_length``: T5 tokens; when the pipeline has no T5 encoder its slot is zeros and
    one token is enough (the built-in demo model was trained that way), else 256 as in SD3.
    """

    prediction = "velocity"
    family = "sd3"

    def __init__(self, pipe: StableDiffusion3Pipeline, *, device: str | torch.device = "cpu",
                 max_sequence_length: int | None = None, height: int | None = None, width: int | None = None):
        self.pipe = pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.device = torch.device(device)
        self.model: nn.Module = pipe.transformer  # unwrapped; peft and saving act on it
        self.denoiser: nn.Module = pipe.transformer  # what forward passes call (the trainer may wrap it)
        self.max_sequence_length = max_sequence_length or (1 if pipe.text_encoder_3 is None else 256)
        self.height = height or pipe.default_sample_size * pipe.vae_scale_factor
        self.width = width or pipe.default_sample_size * pipe.vae_scale_factor
        self.scheduler = copy.deepcopy(pipe.scheduler)
        self.lora = False
        self._frozen_reference: nn.Module | None = None
        self._negative: Conditioning | None = None
        for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.transformer):
            if part is not None:
                part.requires_grad_(False).eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
                        trained: str | Path | None = None, **kwargs) -> "SD3Adapter":
        """Load from a built-in demo name, a local diffusers folder or a hub id. ``trained``: a
        folder written by ``save_trained`` (a run's ``final/`` or a checkpoint's ``policy/``),
        loaded as plain diffusers would: LoRA weights fused in, or its ``transformer/``."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")

        def load(path, **kw):
            extra = {"text_encoder_3": None, "tokenizer_3": None} if _without_t5(path) else {}
            return StableDiffusion3Pipeline.from_pretrained(path, dtype=DTYPES[dtype], **extra, **kw)

        pipe = load_with_hub_fallback(load, name_or_path)
        if trained is not None:
            trained = Path(trained)
            if (trained / "transformer").is_dir():
                pipe.transformer = SD3Transformer2DModel.from_pretrained(trained / "transformer",
                                                                         torch_dtype=DTYPES[dtype])
            elif (trained / LORA_WEIGHTS_NAME).is_file():
                pipe.load_lora_weights(trained)
                pipe.fuse_lora()
                pipe.unload_lora_weights()
            else:
                raise ModelNotFoundError(f"no trained weights in {trained.resolve()}: expected {LORA_WEIGHTS_NAME} "
                                         "or a transformer/ folder (a run's final/ or a checkpoint's policy/)")
        return cls(pipe, device=device, **kwargs)

    # -- conditioning --------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """prompts: B strings → {"embeds": [B, L, D], "pooled": [B, P]}."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return Conditioning({"embeds": embeds, "pooled": pooled})

    def negative(self) -> Conditioning:
        """The empty prompt's conditioning [1, ...], the unconditional branch of CFG (cached)."""
        if self._negative is None:
            self._negative = self.encode([""])
        return self._negative

    # -- sampling ------------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor
        return (self.model.config.in_channels, self.height // f, self.width // f)

    def initial_noise(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Standard normal [B, C, h, w], drawn as the pipeline draws it from the same generator."""
        return torch.randn((batch, *self.latent_shape()), generator=generator, device=generator.device,
                           dtype=torch.float32).to(self.device)

    def schedule(self, num_steps: int) -> Schedule:
        """The σ's and timesteps ``StableDiffusion3Pipeline`` would use for ``num_steps``."""
        kwargs = {}
        config = self.scheduler.config
        if config.get("use_dynamic_shifting", None):
            _, h, w = self.latent_shape()
            patch = self.model.config.patch_size
            kwargs["mu"] = calculate_shift((h // patch) * (w // patch), config.get("base_image_seq_len", 256),
                                           config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                           config.get("max_shift", 1.16))
        self.scheduler.set_timesteps(num_steps, device=self.device, **kwargs)
        return Schedule(sigmas=self.scheduler.sigmas.float().clone(), timesteps=self.scheduler.timesteps.clone())

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, C, h, w] at timestep t (scalar or [B]); CFG when guidance_scale > 1."""
        model = self.denoiser if model is None else model
        embeds, pooled = cond.tensors["embeds"], cond.tensors["pooled"]
        dtype = self.model.dtype
        if guidance_scale > 1.0:
            neg = self.negative()
            b = x.shape[0]
            x = torch.cat([x, x])
            embeds = torch.cat([neg.tensors["embeds"].expand(b, -1, -1), embeds])
            pooled = torch.cat([neg.tensors["pooled"].expand(b, -1), pooled])
        t = torch.as_tensor(t, device=self.device).expand(x.shape[0])
        v = model(hidden_states=x.to(dtype), timestep=t, encoder_hidden_states=embeds.to(dtype),
                  pooled_projections=pooled.to(dtype), return_dict=False)[0]
        if guidance_scale > 1.0:
            uncond, text = v.chunk(2)
            v = uncond + guidance_scale * (text - uncond)
        return v

    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] → images float [B, 3, H, W] in [0, 1] (the pipeline's "pt" output)."""
        vae = self.pipe.vae
        latents = x0 / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    # -- training ------------------------------------------------------------------------
    def add_lora(self, rank: int, alpha: float | None = None, targets: tuple[str, ...] | list[str] | None = None,
                 init: str | bool = "gaussian") -> None:
        """Attach a peft LoRA to the transformer; only its weights train (kept in float32)."""
        from peft import LoraConfig

        self.model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights=init,
                                          target_modules=list(targets or LORA_TARGETS)))
        for p in self.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        self.lora = True

    def enable_full_finetune(self, keep_reference: bool) -> None:
        """Train every transformer weight; ``keep_reference`` keeps a frozen copy for the KL."""
        if keep_reference:
            self._frozen_reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.model.requires_grad_(True)

    def trainable(self) -> nn.Module:
        return self.model

    @contextlib.contextmanager
    def reference(self):
        """Inside this context ``predict`` is the reference policy (LoRA off, or the frozen copy)."""
        if self.lora:
            with disabled_lora(self.model):
                yield
        elif self._frozen_reference is not None:
            current, self.denoiser = self.denoiser, self._frozen_reference
            try:
                yield
            finally:
                self.denoiser = current
        else:
            raise RuntimeError("no reference policy: full fine-tuning was set up without keep_reference")

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights: the LoRA layers in peft/diffusers naming, or the whole transformer."""
        if self.lora:
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(self.model)
        return self.model.state_dict()

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.model, state)
            if getattr(result, "unexpected_keys", None):
                raise KeyError(f"unexpected LoRA keys: {result.unexpected_keys[:5]}")
        else:
            self.model.load_state_dict(state)

    def save_trained(self, directory: str | Path) -> None:
        """LoRA → ``pytorch_lora_weights.safetensors`` (``pipe.load_lora_weights(directory)`` loads
        it); full fine-tuning → a diffusers ``transformer/`` folder."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora:
            StableDiffusion3Pipeline.save_lora_weights(
                directory, transformer_lora_layers=self.trained_state_dict(), safe_serialization=True)
        else:
            self.model.save_pretrained(directory / "transformer", safe_serialization=True)

    def enable_gradient_checkpointing(self) -> None:
        self.model.enable_gradient_checkpointing()

    def enable_xformers(self) -> None:
        self.pipe.enable_xformers_memory_efficient_attention()
