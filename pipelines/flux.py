"""Adapter for FLUX.1 (``FluxPipeline``): dev (guidance-distilled) and schnell (timestep-distilled).

Latents x: [B, C, h, w] with C the VAE's channels (16) and h = H / vae_scale_factor: the layout
before FLUX packs 2×2 patches into its token sequence [B, (h/2)·(w/2), 4C]. The adapter keeps x
unpacked (the layout of the other image families, and the one the pipeline draws its noise in)
and packs inside ``predict``. The Euler and SDE steps are elementwise, so stepping unpacked
latents gives the pipeline's numbers: its ``output_type="latent"`` result is
``FluxPipeline._pack_latents`` of our samples.

Conditioning: {"embeds": [B, L, D] (T5's last hidden states, L = max_sequence_length), "pooled":
[B, P] (CLIP's pooled output)}. The text ids (zeros [L, 3]) and image ids ((0, row, column) of
each patch [(h/2)·(w/2), 3]) are made in ``predict``, as the pipeline makes them.

Guidance. ``guidance_scale`` means what ``FluxPipeline``'s does: the value fed to the guidance
embedding of a guidance-distilled transformer (``guidance_embeds``: FLUX.1-dev; one forward pass,
no unconditional branch; so 1.0 there is "embedded guidance 1", not "no guidance"). A
transformer without one (FLUX.1-schnell) takes no guidance and ``guidance_scale`` must be 1.
True classifier-free guidance (the pipeline's ``true_cfg_scale`` with a negative prompt) is a
constructor option, off by default; with it ``predict`` batches [negative, prompt].

Timesteps: the schedule's are the scheduler's 1000·σ; the transformer takes t / 1000 = σ (it
multiplies by 1000 inside), as the pipeline calls it.
"""

from __future__ import annotations

import copy

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import JOINT_ATTENTION_LORA_TARGETS, DenoiserAdapter


class FluxAdapter(DenoiserAdapter):
    """A ``FluxPipeline`` as the RL core sees it (loading, noise, LoRA, reference, decoding and
    saving: ``DenoiserAdapter``).

    ``max_sequence_length``: T5 tokens (the pipeline's default 512; FLUX.1-schnell was trained
    with 256). ``true_cfg_scale`` > 1: true CFG against ``negative_prompt``, as
    ``pipe(..., true_cfg_scale=, negative_prompt=)``, whatever ``guidance_scale`` is.
    """

    prediction = "velocity"
    family = "flux"
    pipeline_class = FluxPipeline
    model_folder = "transformer"
    lora_targets = JOINT_ATTENTION_LORA_TARGETS  # double-stream blocks: both; single-stream: to_q/k/v

    def __init__(self, pipe: FluxPipeline, *, device: str | torch.device = "cpu", max_sequence_length: int = 512,
                 true_cfg_scale: float = 1.0, negative_prompt: str = "", height: int | None = None,
                 width: int | None = None):
        super().__init__(pipe, device=device, height=height, width=width)
        self.check_size(2 * pipe.vae_scale_factor, "FLUX packs 2×2 latent patches")
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"FluxAdapter steps with FLUX's FlowMatchEulerDiscreteScheduler schedule; this pipeline "
                             f"has a {type(pipe.scheduler).__name__}")
        self.scheduler = copy.deepcopy(pipe.scheduler)
        self.max_sequence_length = max_sequence_length
        self.true_cfg_scale = true_cfg_scale
        self.negative_prompt = negative_prompt
        self.guidance_embeds = bool(self.model.config.guidance_embeds)

    def latent_shape(self) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor
        return (self.model.config.in_channels // 4, self.height // f, self.width // f)

    # -- conditioning --------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """prompts: B strings → {"embeds": [B, L, D], "pooled": [B, P]}."""
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return Conditioning({"embeds": embeds, "pooled": pooled})


    # -- sampling ------------------------------------------------------------------------
    def schedule(self, num_steps: int) -> Schedule:
        """What ``FluxPipeline`` sets (``DenoiserAdapter.shifted_flow_schedule`` over its packed
        sequence length): FLUX.1-dev shifts with the resolution, schnell by its fixed shift."""
        return self.shifted_flow_schedule(num_steps)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, C, h, w] for unpacked latents x [B, C, h, w] at timestep t = 1000·σ (scalar
        or [B]); ``guidance_scale`` feeds the guidance embedding (see the module docstring)."""
        if not self.guidance_embeds and guidance_scale != 1.0:
            raise ValueError(f"this FLUX transformer has no guidance embedding (guidance_embeds=False, as FLUX.1-"
                             f"schnell): guidance_scale must be 1.0, got {guidance_scale}; for true classifier-free "
                             "guidance create the adapter with true_cfg_scale=")
        model = self.denoiser if model is None else model
        dtype = self.model.dtype

        def forward(x, tensors):
            n, c, h, w = x.shape
            guidance = (torch.full((n,), guidance_scale, device=self.device, dtype=torch.float32)
                        if self.guidance_embeds else None)
            tokens = self.pipe._pack_latents(x.to(dtype), n, c, h, w)
            ids = self.pipe._prepare_latent_image_ids(n, h // 2, w // 2, self.device, dtype)
            if "image_latents" in tensors:  # FLUX.1-Kontext: the packed conditioning image after the latent tokens
                tokens = torch.cat([tokens, tensors["image_latents"].to(dtype)], dim=1)
                ids = torch.cat([ids, ids.clone().index_fill_(1, torch.tensor([0], device=self.device), 1)])
            v = model(hidden_states=tokens, timestep=self.batch_timesteps(t, n).to(dtype) / 1000, guidance=guidance,
                      pooled_projections=tensors["pooled"].to(dtype), encoder_hidden_states=tensors["embeds"].to(dtype),
                      txt_ids=torch.zeros(tensors["embeds"].shape[1], 3, device=self.device, dtype=dtype),
                      img_ids=ids, return_dict=False)[0]
            return self.pipe._unpack_latents(v[:, :(h // 2) * (w // 2)], self.height, self.width,
                                             self.pipe.vae_scale_factor)

        return self.guided(forward, x, cond, self.true_cfg_scale)
