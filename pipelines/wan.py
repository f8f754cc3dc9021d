"""Adapter for Wan 2.1 and Wan 2.2 text-to-video (``WanPipeline``): one transformer (2.1, 2.2
TI2V-5B) or 2.2 A14B's two experts.

Latents x: [B, C, F, h, w] with F = (num_frames − 1) / 4 + 1 latent frames and h = H / 8 (the
VAE's temporal and spatial compression); the transformer predicts the velocity v ≈ ε − x0 at
timestep t = 1000·σ. ``decode`` returns what the pipeline returns for ``output_type="pt"``:
frames float [B, num_frames, 3, H, W] in [0, 1] (the video layout of ``flowalign.grids``).

Schedule. Wan ships a ``UniPCMultistepScheduler`` (a multistep solver over flow sigmas with
``flow_shift``: 3 at 480p, 5 at 720p). A rollout takes one Euler (or SDE) step per σ, so the
adapter's schedule is that of ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)``: an η = 0
rollout reproduces ``WanPipeline`` with ``pipe.scheduler = FlowMatchEulerDiscreteScheduler(
shift=flow_shift)``, not with UniPC (whose σ grid also differs: linspace(1, 1/1000, S + 1)[:-1],
shifted). A pipeline that already carries a ``FlowMatchEulerDiscreteScheduler`` keeps it.

CFG is the pipeline's: uncond + g·(cond − uncond) against ``negative_prompt`` ("" unless given)
when guidance_scale > 1, batched here as [negative, prompt] in one forward pass.

Wan 2.2 A14B (``transformer_2`` and ``boundary_ratio`` set): ``transformer`` denoises the steps
with t ≥ boundary_ratio · 1000 (high noise) and ``transformer_2`` the rest, each with its own
guidance scale (``guidance_scale_2``: the low-noise one; unset, the same). The adapter's
``model`` is ``WanExperts``, both as one module (what the optimizer and Accelerate see), and
``predict`` picks the expert of each sample from its t, so a trained step's gradient reaches only
the expert that sampled it. LoRA goes on both; the reference policy is both with their adapters
off; a LoRA run saves the low-noise expert's LoRA in ``transformer_2_lora/``, which plain
diffusers loads with ``pipe.load_lora_weights(dir / "transformer_2_lora", load_into_transformer_2=True)``.

Wan 2.2 TI2V-5B (``expand_timesteps``): its text-to-video mode; the transformer takes the
timestep per latent token ([B, F·h/2·w/2], all t), as the pipeline gives it. Its 48-channel VAE
compresses 16× in space.
"""

from __future__ import annotations

import math

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import DenoiserAdapter, mean_std_latents


class WanExperts(nn.Module):
    """Wan 2.2 A14B's two experts as one module: ``forward(expert, **inputs)`` runs ``high`` (the
    pipeline's ``transformer``, expert 0) or ``low`` (``transformer_2``, expert 1) on the inputs."""

    def __init__(self, high: nn.Module, low: nn.Module):
        super().__init__()
        self.high, self.low = high, low

    def forward(self, expert: int, **inputs):
        return (self.high if expert == 0 else self.low)(**inputs)

    @property
    def config(self):
        return self.high.config

    @property
    def dtype(self) -> torch.dtype:
        return self.high.dtype


def euler_scheduler(scheduler) -> FlowMatchEulerDiscreteScheduler:
    """The Euler flow-matching scheduler a rollout steps with, for the pipeline's ``scheduler``: a
    copy when it is one; for a flow-sigma solver config (Wan's UniPC) one with its ``flow_shift``."""
    config = scheduler.config
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return FlowMatchEulerDiscreteScheduler.from_config(config)
    if config.get("use_flow_sigmas") and not config.get("use_dynamic_shifting"):
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.num_train_timesteps,
                                               shift=config.flow_shift)
    raise ValueError(f"cannot derive a flow-matching Euler schedule from a {type(scheduler).__name__} "
                     "without use_flow_sigmas (or with dynamic shifting); give the pipeline a "
                     "FlowMatchEulerDiscreteScheduler")


class WanAdapter(DenoiserAdapter):
    """A ``WanPipeline`` as the RL core sees it (loading, noise, CFG batching, LoRA, reference and
    saving: ``DenoiserAdapter``).

    ``num_frames``, ``height``, ``width``: the video size (default: the pipeline's 81 frames of
    480×832); ``max_sequence_length``: UMT5 tokens (the pipeline's 512); ``guidance_scale_2``: the
    low-noise expert's guidance scale (Wan 2.2 A14B; None: the sampling guidance scale).
    """

    prediction = "velocity"
    family = "wan"
    modality = "video"  # decode gives frames [B, F, 3, H, W]; the trainer passes model.num_frames
    pipeline_class = WanPipeline
    model_folder = "transformer"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention projections

    def __init__(self, pipe: WanPipeline, *, device: str | torch.device = "cpu", num_frames: int = 81,
                 max_sequence_length: int = 512, negative_prompt: str = "", guidance_scale_2: float | None = None,
                 height: int | None = None, width: int | None = None):
        two = getattr(pipe, "transformer_2", None) is not None
        if two != (pipe.config.boundary_ratio is not None):
            raise ValueError("a Wan 2.2 two-expert pipeline needs both transformer_2 and boundary_ratio; this one has "
                             f"transformer_2 {'set' if two else 'unset'}, boundary_ratio {pipe.config.boundary_ratio}")
        super().__init__(pipe, device=device, height=height, width=width)
        self.boundary = None  # the first low-noise timestep bound: t < boundary → transformer_2
        if two:
            self.model = self.denoiser = WanExperts(pipe.transformer, pipe.transformer_2)
            self.boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        self.guidance_scale_2 = guidance_scale_2
        temporal = pipe.vae_scale_factor_temporal
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ValueError(f"num_frames − 1 must be a multiple of {temporal} (the VAE's temporal compression), "
                             f"got {num_frames}")
        patch = self.model.config.patch_size
        multiple = math.lcm(16, pipe.vae_scale_factor_spatial * patch[1], pipe.vae_scale_factor_spatial * patch[2])
        if self.height % multiple or self.width % multiple:
            raise ValueError(f"Wan needs height and width divisible by {multiple} (the pipeline's 16, and the VAE's "
                             f"compression × the patch size), got {self.height}×{self.width}")
        self.num_frames = num_frames
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.scheduler = euler_scheduler(pipe.scheduler)

    @classmethod
    def possible_extra_folders(cls) -> dict[str, str]:
        """Further denoisers a checkpoint of this family may have, by pipeline attribute, with their role
        (what the dry run says it would train, before any weight is read)."""
        return {"transformer_2": "the low-noise expert of Wan 2.2 A14B, transformer the high-noise one"}

    @classmethod
    def extra_folders(cls, pipe) -> tuple[str, ...]:
        return ("transformer_2",) if getattr(pipe, "transformer_2", None) is not None else ()

    def denoisers(self) -> dict[str, nn.Module]:
        if self.boundary is None:
            return {"transformer": self.model}
        return {"transformer": self.model.high, "transformer_2": self.model.low}

    def default_size(self) -> tuple[int, int]:
        return 480, 832  # WanPipeline.__call__'s defaults

    def latent_shape(self) -> tuple[int, ...]:
        """(C, F, h, w): latent channels, latent frames, height and width."""
        s = self.pipe.vae_scale_factor_spatial
        frames = (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return (self.model.config.in_channels, frames, self.height // s, self.width // s)

    # -- conditioning --------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """prompts: B strings → {"embeds": [B, L, D]} (UMT5's hidden states, zero past each prompt's tokens)."""
        embeds, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        return Conditioning({"embeds": embeds})


    # -- sampling ------------------------------------------------------------------------
    def schedule(self, num_steps: int) -> Schedule:
        """The σ's and timesteps ``WanPipeline`` sets with the Euler scheduler (see the module docstring)."""
        return self.flow_schedule(num_steps)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, C, F, h, w] at timestep t (scalar or [B]); CFG when guidance_scale > 1 (with two
        experts: guidance_scale_2 on the low-noise samples)."""
        model = self.denoiser if model is None else model
        dtype = self.model.dtype

        def forward(x, tensors):
            tt = self.batch_timesteps(t, x.shape[0])
            inputs = self.model_inputs(x.to(dtype), {k: v.to(dtype) for k, v in tensors.items()})
            if self.boundary is None:
                return model(timestep=self.token_timesteps(tt, x), return_dict=False, **inputs)[0]
            high = tt >= self.boundary
            v = torch.empty_like(x, dtype=dtype)
            for expert, rows in ((0, high), (1, ~high)):
                if rows.all():  # the whole batch at once (a rollout step): the pipeline's numbers
                    v = model(expert=expert, timestep=self.token_timesteps(tt, x), return_dict=False, **inputs)[0]
                elif rows.any():
                    v[rows] = model(expert=expert, timestep=self.token_timesteps(tt[rows], x[rows]),
                                    return_dict=False, **{k: val[rows] for k, val in inputs.items()})[0]
            return v

        def combine(uncond, text):
            if self.boundary is None:
                return uncond + guidance_scale * (text - uncond)
            low_scale = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
            high = self.batch_timesteps(t, len(text)) >= self.boundary
            scale = torch.where(high, guidance_scale, low_scale).view(-1, 1, 1, 1, 1).to(text)
            return uncond + scale * (text - uncond)

        return self.guided(forward, x, cond, guidance_scale, combine)

    def model_inputs(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The transformer's tensor inputs for latents x [B, C, F, h, w] (every one batch-first)."""
        return {"hidden_states": x, "encoder_hidden_states": tensors["embeds"]}

    def token_timesteps(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """t [B] as the transformer takes it: per latent token [B, F·(h/p)·(w/p)] for Wan 2.2 TI2V
        (``expand_timesteps``), else [B]."""
        if not self.pipe.config.expand_timesteps:
            return t
        _, p_h, p_w = self.model.config.patch_size
        tokens = x.shape[2] * (x.shape[3] // p_h) * (x.shape[4] // p_w)
        return t[:, None].expand(len(t), tokens)

    # -- decoding ------------------------------------------------------------------------
    def vae_latents(self, x0: torch.Tensor) -> torch.Tensor:
        """x0·latents_std + latents_mean per channel, written as the pipeline writes it."""
        return mean_std_latents(x0, self.pipe.vae.config)

    @torch.no_grad()
    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, F, h, w] → frames float [B, num_frames, 3, H, W] in [0, 1]."""
        vae = self.pipe.vae
        video = vae.decode(self.vae_latents(x0.to(vae.dtype)), return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
