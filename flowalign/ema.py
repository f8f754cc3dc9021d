"""Moving averages of the trained weights: the evaluation EMA (``train.ema_decay``) and an
objective's old policy (DiffusionNFT's, decay ramped per epoch). One job: keep a shadow copy of
a list of parameters and swap it in on request. Checkpointed as ``{name}.safetensors``."""

from __future__ import annotations

import contextlib

import torch


class EMA:
    """Exponential moving average of parameters; ``swapped_in`` evaluates with the average."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for v, p in zip(saved, self.params):
                    p.copy_(v)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"shadow.{i}": s for i, s in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, s in enumerate(self.shadow):
            s.copy_(state[f"shadow.{i}"])

    def finite(self) -> bool:
        return all(bool(torch.isfinite(s).all()) for s in self.shadow)


def maybe_swapped_in(ema: EMA | None):
    """``ema.swapped_in()``, or nothing when there is no average."""
    return ema.swapped_in() if ema is not None else contextlib.nullcontext()
