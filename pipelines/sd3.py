"""Adapter for the Stable Diffusion 3 / 3.5 family (``StableDiffusion3Pipeline``).

Latents x: [B, C, h, w] with h = H / vae_scale_factor; the transformer predicts the velocity
v ≈ ε − x0 at timestep t = 1000·σ. Classifier-free guidance batches [unconditional, conditional]
exactly as the pipeline does, so at η = 0 a rollout reproduces the pipeline's output.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from torch import nn

from pipelines.base import Conditioning, Schedule
from pipelines.denoiser import DTYPES, LORA_WEIGHTS_NAME  # noqa: F401 (re-exported)
from pipelines.denoiser import JOINT_ATTENTION_LORA_TARGETS, DenoiserAdapter

# the joint attention's 8 projections, as Flow-GRPO's train_sd3.py and diffusers' SD3 LoRA scripts name them:
# "attn.to_q" matches transformer_blocks.N.attn.to_q but not the second, image-only attention attn2 of
# SD3.5's dual-attention blocks (bare "to_q" would adapt both)
LORA_TARGETS = tuple(f"attn.{name}" for name in JOINT_ATTENTION_LORA_TARGETS)


def _without_t5(path: str) -> bool:
    """True when a local SD3 folder was saved without the T5 encoder (its model_index slot is null)."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return False
    slot = json.loads(index.read_text()).get("text_encoder_3")
    return slot is None or slot == [None, None]


class SD3Adapter(DenoiserAdapter):
    """A ``StableDiffusion3Pipeline`` as the RL core sees it (loading, noise, LoRA, reference,
    decoding and saving: ``DenoiserAdapter``).

    ``max_sequence_length``: T5 tokens; when the pipeline has no T5 encoder its slot is zeros and
    one token is enough (the built-in demo model was trained that way), else 256 as in SD3.
    """

    prediction = "velocity"
    family = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    model_folder = "transformer"
    lora_targets = LORA_TARGETS

    def __init__(self, pipe: StableDiffusion3Pipeline, *, device: str | torch.device = "cpu",
                 max_sequence_length: int | None = None, height: int | None = None, width: int | None = None):
        super().__init__(pipe, device=device, height=height, width=width)
        self.max_sequence_length = max_sequence_length or (1 if pipe.text_encoder_3 is None else 256)
        self.scheduler = copy.deepcopy(pipe.scheduler)

    @classmethod
    def pipeline_kwargs(cls, path: str) -> dict:
        return {"text_encoder_3": None, "tokenizer_3": None} if _without_t5(path) else {}

    # -- conditioning --------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        """prompts: B strings → {"embeds": [B, L, D], "pooled": [B, P]}."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return Conditioning({"embeds": embeds, "pooled": pooled})


    # -- sampling ------------------------------------------------------------------------
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
        return self.flow_schedule(num_steps, **kwargs)

    def predict(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float = 1.0,
                model: nn.Module | None = None) -> torch.Tensor:
        """Velocity [B, C, h, w] at timestep t (scalar or [B]); CFG when guidance_scale > 1."""
        model = self.denoiser if model is None else model
        dtype = self.model.dtype

        def forward(x, tensors):
            return model(hidden_states=x.to(dtype), timestep=self.batch_timesteps(t, len(x)),
                         encoder_hidden_states=tensors["embeds"].to(dtype),
                         pooled_projections=tensors["pooled"].to(dtype), return_dict=False)[0]

        return self.guided(forward, x, cond, guidance_scale)
