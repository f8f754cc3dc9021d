"""The LAION "improved aesthetic predictor" as ddpo-pytorch uses it.

score = MLP(e / ‖e‖) where e is the CLIP ViT-L/14 image embedding (transformers ``CLIPModel``,
real weights ``openai/clip-vit-large-patch14``) and the MLP is the predictor's checkpoint
``sac+logos+ava1-l14-linearMSE.pth``: an ``nn.Sequential`` named ``layers`` of
Linear(768, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout,
Linear(64, 16), Linear(16, 1), so its keys are ``layers.{0,2,4,6,7}.{weight,bias}``. The layer
sizes are read from the weights, so any CLIP width loads.
"""

from __future__ import annotations

import torch
from torch import nn

from reward_models.base import Reward, register_reward
from reward_models.clip_utils import (load_state_dict_file, load_transformers, normalize, pick_device, projected,
                                      to_uint8)

LINEAR_INDICES = (0, 2, 4, 6, 7)  # positions of the Linear layers in the checkpoint's nn.Sequential
DROPOUTS = {1: 0.2, 3: 0.2, 5: 0.1}  # inactive at inference; kept so the indices match


def aesthetic_mlp(state_dict: dict[str, torch.Tensor]) -> nn.Sequential:
    """The predictor's MLP, sized from and loaded with ``state_dict`` (keys ``layers.i.*`` or ``i.*``).

    Maps L2-normalised embeddings [B, D] → scores [B, 1].
    """
    state = {k.removeprefix("layers."): v for k, v in state_dict.items()}
    expected = {f"{i}.{p}" for i in LINEAR_INDICES for p in ("weight", "bias")}
    if set(state) != expected:
        raise ValueError(f"not an aesthetic-predictor MLP: expected keys layers.{{0,2,4,6,7}}.{{weight,bias}}, "
                         f"got {sorted(state_dict)}")
    layers: list[nn.Module] = []
    for i in range(max(LINEAR_INDICES) + 1):
        if i in DROPOUTS:
            layers.append(nn.Dropout(DROPOUTS[i]))
        else:
            out_dim, in_dim = state[f"{i}.weight"].shape
            layers.append(nn.Linear(in_dim, out_dim))
    mlp = nn.Sequential(*layers)
    mlp.load_state_dict(state)
    return mlp.eval()


@register_reward("aesthetic")
class Aesthetic(Reward):
    """Predicted LAION aesthetic rating (higher is better).

    ``clip_path``: hub id or local ``CLIPModel`` folder (its ``preprocessor_config.json`` sets the
    resize and normalisation); ``mlp_path``: the predictor's ``.pth`` or ``.safetensors`` file.
    Example (real weights, download once)::

        reward = Aesthetic(mlp_path="sac+logos+ava1-l14-linearMSE.pth")
        reward(images, prompts, metadata)["aesthetic"]  # float [B]
    """

    components = ("aesthetic",)
    modality = "image"

    def __init__(self, mlp_path: str, clip_path: str = "openai/clip-vit-large-patch14", device: str | None = None):
        from transformers import CLIPImageProcessor, CLIPModel

        self.device = pick_device(device)
        self.mlp = aesthetic_mlp(load_state_dict_file(mlp_path, "aesthetic MLP weights")).to(self.device)
        self.processor = load_transformers(CLIPImageProcessor, clip_path, "CLIP image processor")
        self.clip = load_transformers(CLIPModel, clip_path, "CLIP model").to(self.device).eval()
        if self.mlp[0].in_features != self.clip.config.projection_dim:
            raise ValueError(f"aesthetic MLP takes {self.mlp[0].in_features}-d embeddings but {clip_path!r} "
                             f"gives {self.clip.config.projection_dim}-d ones")

    @torch.no_grad()
    def embed(self, samples: torch.Tensor) -> torch.Tensor:
        """samples float [B, 3, H, W] in [0, 1] → L2-normalised CLIP image embeddings [B, D]."""
        pixels = self.processor(images=to_uint8(samples), return_tensors="pt")["pixel_values"]
        return normalize(projected(self.clip.get_image_features(pixel_values=pixels.to(self.device))))

    @torch.no_grad()
    def __call__(self, samples, prompts, metadata):
        return {"aesthetic": self.mlp(self.embed(samples)).squeeze(1).float().cpu()}
