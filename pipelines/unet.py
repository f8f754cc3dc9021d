"""The ε-prediction UNet families (SD1.x/2.x: ``sd.py``, SDXL: ``sdxl.py``), sampled by DDIM.

Latents x: [B, C, h, w] with h = H / vae_scale_factor; ``UNet2DConditionModel`` predicts, at an
integer timestep t ∈ [0, num_train_timesteps), what the scheduler config's ``prediction_type``
says: ε (SD1.x, SD2-base, SDXL) or v (SD2 768-v). The schedule is DDIM's, built from the
pipeline's scheduler config whatever scheduler the checkpoint ships (PNDM for SD1.5, Euler for
SDXL), as DDPO does; the step itself is ``flowalign.samplers.ddim``. Classifier-free guidance
batches [unconditional, conditional] exactly as the pipelines do, so an η = 0 DDIM rollout
reproduces the pipeline's output with a ``DDIMScheduler``.

Not supported: guidance-distilled UNets (``time_cond_proj_dim``, LCM), dynamic thresholding,
``guidance_rescale`` (the pipelines' default 0 is what ``predict`` does).
"""

from __future__ import annotations

import torch
from diffusers import DDIMScheduler
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import DenoiserAdapter


class UNetAdapter(DenoiserAdapter):
    """A Stable Diffusion UNet pipeline as the RL core sees it. A family names its pipeline class,
    writes ``encode_pair`` and lists the conditioning tensors the UNet takes as
    ``added_cond_kwargs`` (``added_conditions``: conditioning name → UNet name).

    ``prediction = "epsilon"`` says the DDIM sampler applies (an ᾱ-schedule model); what the
    network outputs exactly is ``prediction_type`` ("epsilon", "v_prediction" or "sample"), and
    ``clip_sample_range`` is the x̂0 clipping of the scheduler config (None: off, as in SD).
    """

    prediction = "epsilon"
    model_folder = "unet"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # the attention projections, as diffusers' SD LoRA
    added_conditions: dict[str, str] = {}

    def __init__(self, pipe, *, device: str | torch.device = "cpu", height: int | None = None,
                 width: int | None = None):
        super().__init__(pipe, device=device, height=height, width=width)
        if self.model.config.time_cond_proj_dim is not None:
            raise ValueError("this UNet takes a guidance embedding (time_cond_proj_dim: a guidance-distilled / LCM "
                             "model); its DDIM transition is not the one implemented here")
        self.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        config = self.scheduler.config
        if config.thresholding:
            raise ValueError("the scheduler config asks for dynamic thresholding, which the DDIM step does not "
                             "implement; set thresholding=False in its scheduler_config.json")
        self.prediction_type: str = config.prediction_type
        self.clip_sample_range: float | None = float(config.clip_sample_range) if config.clip_sample else None

    # -- conditioning --------------------------------------------------------------------
    def encode_pair(self, prompts: list[str], negative: bool) -> tuple[Conditioning, Conditioning | None]:
        """(the prompts' conditioning [B, ...], the pipeline's negative conditioning [B, ...] when
        ``negative``, else None)."""
        raise NotImplementedError

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        return self.encode_pair(prompts, negative=False)[0]

    @torch.no_grad()
    def negative(self) -> Conditioning:
        """The unconditional branch of CFG [1, ...] exactly as the pipeline makes it with no negative
        prompt (the empty prompt's encoding, or zeros where the pipeline's config says so; cached)."""
        if self._negative is None:
            self._negative = self.encode_pair([""], negative=True)[1]
        return self._negative

    # -- sampling ------------------------------------------------------------------------
    def schedule(self, num_steps: int) -> Schedule:
        """The timesteps ``DDIMScheduler`` uses for ``num_steps`` and the ᾱ's its step reads.

        The previous timestep of t is t − num_train_timesteps // S, as ``DDIMScheduler.step``
        computes it (with "trailing" or "linspace" spacing not always the next timestep in the
        list); below 0 its ᾱ is ``final_alpha_cumprod`` (1 with ``set_alpha_to_one``, else ᾱ_0).
        sigmas [S + 1] = sqrt(1 − ᾱ) before each step and after the last.
        """
        scheduler = self.scheduler
        scheduler.set_timesteps(num_steps, device=self.device)
        timesteps = scheduler.timesteps.clone()
        alphas = scheduler.alphas_cumprod.float().cpu()
        t = timesteps.cpu()
        prev = t - scheduler.config.num_train_timesteps // num_steps
        final = torch.full((num_steps,), float(scheduler.final_alpha_cumprod))
        alpha, alpha_prev = alphas[t], torch.where(prev >= 0, alphas[prev.clamp(min=0)], final)
        sigmas = (1 - torch.cat([alpha, alpha_prev[-1:]])).sqrt()
        return Schedule(sigmas=sigmas.to(self.device), timesteps=timesteps, alphas_cumprod=alpha.to(self.device),
                        alphas_cumprod_prev=alpha_prev.to(self.device))

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """The UNet's output [B, C, h, w] (ε, or v: ``prediction_type``) at timestep t (scalar or
        [B]); CFG when guidance_scale > 1."""
        model = self.denoiser if model is None else model
        dtype = self.model.dtype

        def forward(x, tensors):
            added = {name: tensors[key].to(dtype) for key, name in self.added_conditions.items()}
            return model(x.to(dtype), self.batch_timesteps(t, len(x)),
                         encoder_hidden_states=tensors["embeds"].to(dtype), added_cond_kwargs=added or None,
                         return_dict=False)[0]

        return self.guided(forward, x, cond, guidance_scale)
