"""Adapter for Wan 2.1 text-to-video (``WanPipeline``).

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

Not supported (an error says so): Wan 2.2's two-expert pipelines (``transformer_2`` with
``boundary_ratio``) and per-token timesteps (``expand_timesteps``, Wan 2.2 TI2V).
"""

from __future__ import annotations

import math

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import DenoiserAdapter, mean_std_latents


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
    480×832); ``max_sequence_length``: UMT5 tokens (the pipeline's 512).
    """

    prediction = "velocity"
    family = "wan"
    modality = "video"  # decode gives frames [B, F, 3, H, W]; the trainer passes model.num_frames
    pipeline_class = WanPipeline
    model_folder = "transformer"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention projections

    def __init__(self, pipe: WanPipeline, *, device: str | torch.device = "cpu", num_frames: int = 81,
                 max_sequence_length: int = 512, negative_prompt: str = "", height: int | None = None,
                 width: int | None = None):
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.boundary_ratio is not None:
            raise ValueError("WanAdapter supports one denoiser (Wan 2.1); this pipeline has Wan 2.2's two experts "
                             "(transformer_2 / boundary_ratio)")
        if pipe.config.expand_timesteps:
            raise ValueError("WanAdapter does not support per-token timesteps (expand_timesteps, Wan 2.2 TI2V)")
        super().__init__(pipe, device=device, height=height, width=width)
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

    def negative(self) -> Conditioning:
        """``negative_prompt``'s conditioning [1, ...], the unconditional branch of CFG (cached)."""
        if self._negative is None:
            self._negative = self.encode([self.negative_prompt])
        return self._negative

    # -- sampling ------------------------------------------------------------------------
    def schedule(self, num_steps: int) -> Schedule:
        """The σ's and timesteps ``WanPipeline`` sets with the Euler scheduler (see the module docstring)."""
        return self.flow_schedule(num_steps)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, C, F, h, w] at timestep t (scalar or [B]); CFG when guidance_scale > 1."""
        model = self.denoiser if model is None else model
        dtype = self.model.dtype
        x, tensors = self.guidance_inputs(x, cond, guidance_scale)
        v = model(hidden_states=x.to(dtype), timestep=self.batch_timesteps(t, x.shape[0]),
                  encoder_hidden_states=tensors["embeds"].to(dtype), return_dict=False)[0]
        return self.guide(v, guidance_scale)

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
