"""Which steps of a rollout are stochastic and which are trained.

Modes (``../shared/METHODS.md`` §1, "Windows and subsets"):

* ``"all"``: every step but the last is SDE and trained (Flow-GRPO);
* ``"fraction"``: every step but the last is SDE; each sample trains a random ``fraction`` of
  them, drawn independently per sample (DanceGRPO, 0.6);
* ``"window"``: only ``window_size`` consecutive steps are SDE and trained, the rest is ODE
  (Flow-GRPO-Fast / MixGRPO); the window starts at ``window_start`` or, when that is None, at a
  random step drawn once per rollout batch, so that the window lies inside ``window_range``
  [lo, hi) (Flow-GRPO's ``sde_window_range``, e.g. (0, num_steps // 2): the noisiest half; None:
  anywhere before the last step). ``sliding_window_start`` gives MixGRPO's schedule:
  the window begins at the first (noisiest) steps and moves ``stride`` steps later every
  ``shift_every`` epochs, then stays at the end.

The last step (σ' = 0) is always deterministic and never trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepPlan:
    """noise_levels: float [S] (η per step, 0 = ODE); trained: bool [B, S] (⊆ steps with η > 0)."""

    noise_levels: torch.Tensor
    trained: torch.Tensor


def plan_steps(
    num_steps: int,
    batch: int,
    eta: float,
    mode: str = "all",
    *,
    fraction: float = 0.6,
    window_size: int = 2,
    window_start: int | None = None,
    window_range: tuple[int, int] | None = None,
    generator: torch.Generator | None = None,
) -> StepPlan:
    """Noise level per step and the trained-step mask for one rollout batch of ``batch`` samples."""
    last = num_steps - 1  # number of steps that may be stochastic
    if last < 1:
        raise ValueError(f"need at least 2 sampling steps to train one, got {num_steps}")
    stochastic = torch.zeros(num_steps, dtype=torch.bool)
    if mode in ("all", "fraction"):
        stochastic[:last] = True
    elif mode == "window":
        if not 1 <= window_size <= last:
            raise ValueError(f"window_size must be in [1, {last}] for {num_steps} steps, got {window_size}")
        if window_start is None:
            lo, hi = (0, last) if window_range is None else window_range
            if not (0 <= lo and lo + window_size <= hi <= last):
                raise ValueError(f"window_range must satisfy 0 ≤ lo, lo + window_size ≤ hi ≤ {last}, "
                                 f"got {list(window_range)} with window_size {window_size}")
            window_start = int(torch.randint(lo, hi - window_size + 1, (1,), generator=generator))
        if not 0 <= window_start <= last - window_size:
            raise ValueError(f"window_start must be in [0, {last - window_size}], got {window_start}")
        stochastic[window_start : window_start + window_size] = True
    else:
        raise ValueError(f"step mode must be 'all', 'fraction' or 'window', got {mode!r}")
    trained = stochastic.expand(batch, num_steps).clone()
    if mode == "fraction":
        k = max(1, round(fraction * last))
        scores = torch.rand(batch, last, generator=generator)
        chosen = scores.argsort(dim=1)[:, :k]
        trained = torch.zeros(batch, num_steps, dtype=torch.bool)
        trained.scatter_(1, chosen, True)
    return StepPlan(noise_levels=stochastic.float() * eta, trained=trained)


def sliding_window_start(epoch: int, num_steps: int, window_size: int, shift_every: int, stride: int = 1,
                         start: int = 0) -> int:
    """MixGRPO's scheduled window: ``start + stride · ⌊epoch / shift_every⌋``, clamped to the last
    position a window of ``window_size`` stochastic steps fits in (``num_steps − 1 − window_size``)."""
    if shift_every < 1 or stride < 1:
        raise ValueError(f"shift_every and stride must be ≥ 1, got {shift_every} and {stride}")
    return min(start + stride * (epoch // shift_every), num_steps - 1 - window_size)


def step_counts(sampling) -> tuple[int, int]:
    """(stochastic steps, steps trained per sample) of the ``sampling`` section's plan: the loss
    terms of an objective on SDE log-probabilities, and what each sample trains of them (fewer
    under ``step_mode: fraction``). Neither depends on where a random window starts."""
    s = sampling
    plan = plan_steps(s.num_steps, 1, s.eta, s.step_mode, fraction=s.fraction, window_size=s.window_size,
                      window_start=s.window_start if s.window_start is not None else 0)
    return int((plan.noise_levels > 0).sum()), int(plan.trained.sum())
