"""A plug-in reward: how red an image is (mean red minus mean of green and blue).

It does not import flowalign's registry or subclass its base class: the protocol is only a
callable with ``components`` that returns ``{component: Tensor [B]}``.
"""

import torch


class Redness:
    components = ("redness",)

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, samples: torch.Tensor, prompts, metadata):
        """samples: float [B, 3, H, W] in [0, 1] → {"redness": [B]}."""
        return {"redness": self.scale * (samples[:, 0].mean((1, 2)) - samples[:, 1:].mean((1, 2, 3)))}
