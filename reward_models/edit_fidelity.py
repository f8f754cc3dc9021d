"""Edit fidelity: how an edited image keeps its input and follows its instruction, with one CLIP.

For an image-conditioned task (FLUX.1-Kontext, Qwen-Image-Edit, image-to-video frames scored
per frame) every prompt record carries its conditioning image ("image", a path; the trainer
passes the records as ``metadata``). With unit CLIP embeddings of the output o, the input i and
the instruction text p:

    input_similarity = cos(o, i)          (the image–image similarity: the edit keeps the scene; several
                                           inputs, Qwen-Image-Edit-Plus: the mean over them)
    text_alignment   = cos(o, p)          (CLIP score: the output matches the instruction)
    edit_fidelity    = w · input_similarity + (1 − w) · text_alignment,  w = ``input_weight``

All three are components (log them all, weight ``edit_fidelity``). A record without an image
scores NaN (dropped and counted by the trainer). Any ``CLIPModel`` checkpoint works
(``openai/clip-vit-large-patch14`` by default; DINO-style image-only similarity is the
``input_weight=1`` case with a CLIP image tower).
"""

from __future__ import annotations

import torch
from PIL import Image

from reward_models.base import Reward, register_reward
from reward_models.clip_utils import load_transformers, normalize, pick_device, projected, to_uint8


@register_reward("edit_fidelity")
class EditFidelity(Reward):
    """``model``: hub id or local ``CLIPModel`` folder; ``processor``: its ``CLIPProcessor`` (default:
    the same folder); ``input_weight``: w above. Example::

        reward = EditFidelity(input_weight=0.5)
        reward(images, ["make the red circle blue"] * len(images),
               [{"image": "scene.png"}] * len(images))["edit_fidelity"]  # float [B]
    """

    components = ("edit_fidelity", "input_similarity", "text_alignment")
    modality = "image"

    def __init__(self, model: str = "openai/clip-vit-large-patch14", processor: str | None = None,
                 input_weight: float = 0.5, device: str | None = None):
        from transformers import CLIPModel, CLIPProcessor

        if not 0.0 <= input_weight <= 1.0:
            raise ValueError(f"input_weight must be in [0, 1], got {input_weight}")
        self.device = pick_device(device)
        self.processor = load_transformers(CLIPProcessor, processor or model, "CLIP processor")
        self.model = load_transformers(CLIPModel, model, "CLIP model").to(self.device).eval()
        self.input_weight = input_weight
        self.max_length = min(self.processor.tokenizer.model_max_length,
                              self.model.config.text_config.max_position_embeddings)

    def image_embeddings(self, images) -> torch.Tensor:
        """uint8 [B, 3, H, W] or PIL images → unit CLIP image embeddings [B, D]."""
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.device)
        return normalize(projected(self.model.get_image_features(pixel_values=pixels)))

    @torch.no_grad()
    def __call__(self, samples, prompts, metadata):
        output = self.image_embeddings(to_uint8(samples))
        text = self.processor(text=list(prompts), padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt").to(self.device)
        words = normalize(projected(self.model.get_text_features(input_ids=text["input_ids"],
                                                                 attention_mask=text["attention_mask"])))
        alignment = (output * words).sum(-1).float().cpu()
        # each sample's inputs (several for Qwen-Image-Edit-Plus: the mean of the similarities to each)
        paths = [m.get("image") or [] for m in metadata]
        paths = [p if isinstance(p, (list, tuple)) else [p] for p in paths]
        similarity = torch.full((len(prompts),), float("nan"))
        owners = torch.tensor([row for row, group in enumerate(paths) for _ in group], dtype=torch.long)
        if len(owners):
            inputs = self.image_embeddings([Image.open(p).convert("RGB") for group in paths for p in group])
            cosines = (output[owners.to(output.device)] * inputs).sum(-1).float().cpu()
            counts = torch.bincount(owners, minlength=len(prompts))
            sums = torch.zeros(len(prompts)).index_add_(0, owners, cosines)
            similarity = torch.where(counts > 0, sums / counts.clamp(min=1), similarity)
        w = self.input_weight
        return {"edit_fidelity": w * similarity + (1 - w) * alignment, "input_similarity": similarity,
                "text_alignment": alignment}
