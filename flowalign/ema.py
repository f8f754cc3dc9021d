"""Moving averages of the trained weights: the evaluation EMA (``train.ema_decay``) and an
objective's old policy (DiffusionNFT's, decay ramped per epoch). One job: keep a shadow copy of
a list of parameters and swap it in on request. Checkpointed as ``{name}.safetensors``.

Warm-up (``train.ema_warmup``), diffusers' ``EMAModel.get_decay`` with its defaults
(update_after_step 0, min_decay 0, inv_gamma 1, power 2/3): the k-th update (k = 1, 2, ...) uses

    decay_k = 0                                        k = 1 (the average starts at the weights)
    decay_k = min(decay, (1 + n) / (10 + n))           "diffusers" (EMAModel's default), n = k − 1
    decay_k = min(decay, 1 − (1 + n)^(−2/3))           "power" (EMAModel(use_ema_warmup=True))
    decay_k = decay                                    "none": a constant decay from the first update

so a short run's average follows the trained weights instead of staying near the initial ones
(a constant decay d keeps a weight of d^k on the start after k updates: 0.98^4 = 0.92).
``horizon(decay)`` = 1 / (1 − decay) updates is the span a constant-decay average covers.
"""

from __future__ import annotations

import contextlib

import torch


WARMUPS = ("none", "diffusers", "power")


def decay_at(update: int, decay: float, warmup: str = "none") -> float:
    """The decay of the ``update``-th update (1-based) under ``warmup`` (module docstring)."""
    if warmup == "none":
        return decay
    n = update - 1
    if n <= 0:
        return 0.0
    ramp = 1 - (1 + n) ** (-2 / 3) if warmup == "power" else (1 + n) / (10 + n)
    return min(ramp, decay)


def horizon(decay: float) -> float:
    """Updates a constant-decay average spans: 1 / (1 − decay) (50 for 0.98)."""
    return 1 / (1 - decay) if decay < 1 else float("inf")


def short_run_warning(ema: "EMA") -> str | None:
    """One line when the run's optimizer steps (the EMA's updates) are fewer than its horizon."""
    span = horizon(ema.decay)
    if ema.steps >= span:
        return None
    held = ("warmed up, so it follows the trained weights" if ema.warmup != "none"
            else f"the initial weights still weigh {ema.decay ** ema.steps:.0%} in it")
    return (f"train.ema_decay {ema.decay} averages over ~{span:.0f} optimizer steps, but this run took {ema.steps}: "
            f"final/ and the evaluations hold the average ({held}; train.ema_warmup {ema.warmup}); train longer "
            f"or lower train.ema_decay for an average over the run")


class EMA:
    """Exponential moving average of parameters; ``swapped_in`` evaluates with the average.
    ``steps``: the updates so far (checkpointed; the warm-up reads it)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, warmup: str = "none"):
        self.params, self.decay, self.warmup = params, decay, warmup
        self.shadow = [p.detach().clone() for p in params]
        self.steps = 0

    @torch.no_grad()
    def update(self) -> None:
        self.steps += 1
        decay = decay_at(self.steps, self.decay, self.warmup)
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1 - decay)

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
        return {**{f"shadow.{i}": s for i, s in enumerate(self.shadow)}, "steps": torch.tensor(self.steps)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, s in enumerate(self.shadow):
            s.copy_(state[f"shadow.{i}"])
        # a checkpoint from before the count: its run had no warm-up; count it as past any warm-up
        self.steps = int(state["steps"]) if "steps" in state else 10**9

    def finite(self) -> bool:
        return all(bool(torch.isfinite(s).all()) for s in self.shadow)


def maybe_swapped_in(ema: EMA | None):
    """``ema.swapped_in()``, or nothing when there is no average."""
    return ema.swapped_in() if ema is not None else contextlib.nullcontext()
