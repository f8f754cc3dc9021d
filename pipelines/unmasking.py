"""Masked discrete diffusion (MD4-style) sampling with exact per-step log-probabilities.

State x: long [B, L] token ids, ``mask_id`` (the tokenizer's ``MASK_ID`` by default) where a
position is still masked (METHODS §1). The positions that are not masked in the *initial* state
(a partial board: inpainting) are fixed: they are never masked, sampled or scored. The other
positions are *free*.

Schedule (policy-independent). With S steps, the fraction of a sample's free positions still
masked after step s (s = 0 … S) is m(s/S) with

    linear: m(u) = 1 − u                    (the same number of tokens every step)
    cosine: m(u) = cos(π/2 · u)             (MD4's cosine schedule: few tokens early, when the
                                             model knows least, many late)

so a sample with n free positions has k_s = n − round(n·m(s/S)) of them unmasked after step s
(k_0 = 0, k_S = n; a step may unmask none). *Which* positions: a uniform random order of the
free positions, drawn once from the generator, unmasked in that order.

Step log-prob. Given the state x_s, the model's categorical at temperature τ,
π_θ(· | x_s, ℓ) = softmax(logits_ℓ / τ), picks the token of every newly unmasked position ℓ
independently, so

    log p_θ(x_{s+1} | x_s) = Σ_{ℓ newly unmasked at s} log π_θ(x_{s+1,ℓ} | x_s, ℓ) + log q(plan)

and the plan's term q does not depend on θ: it cancels in every ratio, and the log-probs here
leave it out. They are of the tempered distribution actually sampled from; rescoring a step
must use the same τ. Reduction: **sum** over newly unmasked positions (the exact joint log-prob).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from pipelines.chess_tokenizer import MASK_ID
from pipelines.base import Conditioning

SCHEDULES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "linear": lambda u: 1.0 - u,
    "cosine": lambda u: torch.cos(math.pi / 2 * u),
}


def _schedule_fn(schedule: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if schedule not in SCHEDULES:
        raise ValueError(f"unmasking schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    return SCHEDULES[schedule]


def unmask_counts(free_counts: torch.Tensor, num_steps: int, schedule: str = "cosine") -> torch.Tensor:
    """free_counts long [B] → k long [B, S + 1]: free positions unmasked after each step s = 0 … S
    (k[:, 0] = 0, k[:, S] = free_counts, non-decreasing)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be ≥ 1, got {num_steps}")
    u = torch.arange(num_steps + 1, dtype=torch.float64) / num_steps
    still_masked = _schedule_fn(schedule)(u).clamp(0.0, 1.0)
    n = free_counts.to(torch.float64)[:, None].cpu()
    return (n - torch.round(n * still_masked[None])).long().to(free_counts.device)


def unmasking_plan(free: torch.Tensor, num_steps: int, *, schedule: str = "cosine",
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Which positions each step unmasks. free: bool [B, L] (True = masked in the initial state).
    Returns bool [B, S, L]: plan[b, s] = the positions newly unmasked at step s; every free
    position exactly once over the S steps, a fixed one never. Draws one uniform [B, L] from
    ``generator`` (on its device)."""
    scores = torch.rand(free.shape, generator=generator, device=generator.device if generator else "cpu")
    scores = scores.to(free.device).masked_fill(~free, float("inf"))  # fixed positions sort last
    rank = scores.argsort(dim=1).argsort(dim=1)  # rank[b, ℓ] = place of ℓ in b's unmasking order
    k = unmask_counts(free.sum(1), num_steps, schedule)  # [B, S + 1]
    return (rank[:, None, :] >= k[:, :-1, None]) & (rank[:, None, :] < k[:, 1:, None])


@dataclass
class UnmaskStep:
    """One step x_s → x_{s+1}: tokens long [B, L] (x_{s+1}); log_prob [B] (sum over the newly
    unmasked positions); token_log_probs [B, L] (log π of each position's token, 0 elsewhere)."""

    tokens: torch.Tensor
    log_prob: torch.Tensor
    token_log_probs: torch.Tensor


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the log-probs are of softmax(logits / τ)), got {temperature}")


def score_step(logits: torch.Tensor, next_tokens: torch.Tensor, unmask: torch.Tensor, *,
               temperature: float = 1.0) -> UnmaskStep:
    """Log-prob of a recorded step under ``logits``. logits: [B, L, V] computed from x_s (−inf =
    disallowed); next_tokens: long [B, L] = x_{s+1}; unmask: bool [B, L], the step's newly
    unmasked positions. Differentiable in ``logits``."""
    _check_temperature(temperature)
    log_pi = torch.log_softmax(logits.float() / temperature, dim=-1)
    gathered = log_pi.gather(-1, next_tokens[..., None]).squeeze(-1)
    # where, not multiply: positions outside the step may gather −inf (a MASK token) and 0·(−inf) is NaN
    per_token = torch.where(unmask, gathered, torch.zeros_like(gathered))
    return UnmaskStep(next_tokens, per_token.sum(-1), per_token)


def unmask_step(logits: torch.Tensor, x: torch.Tensor, unmask: torch.Tensor, *, temperature: float = 1.0,
                generator: torch.Generator | None = None, mask_id: int = MASK_ID) -> UnmaskStep:
    """Sample the tokens of the newly unmasked positions. logits: [B, L, V] from x; x: long [B, L];
    unmask: bool [B, L] (every such position must be masked in x). Other positions keep x's token.
    Draws one categorical sample per position of [B, L] from ``generator``."""
    _check_temperature(temperature)
    if bool((unmask & (x != mask_id)).any()):
        raise ValueError("unmask names a position that is not masked (fixed or already unmasked)")
    probs = torch.softmax(logits.float() / temperature, dim=-1).flatten(0, 1)
    device = generator.device if generator is not None else probs.device
    drawn = torch.multinomial(probs.to(device), 1, generator=generator).view(x.shape).to(x.device)
    return score_step(logits, torch.where(unmask, drawn, x), unmask, temperature=temperature)


@dataclass
class MaskedTrajectory:
    """A rollout: states long [B, S + 1, L] (states[:, 0] the initial state, states[:, -1] the
    sample); unmask bool [B, S, L] (step s turns states[:, s] into states[:, s + 1] at these
    positions); log_probs [B, S] (sum over each step's newly unmasked positions); cond: the
    conditioning the rollout was sampled with (optional; a trainer keeps it to rescore the steps).
    Indexing selects samples and ``cat`` joins rollouts, as for the continuous ``Trajectory``."""

    states: torch.Tensor
    unmask: torch.Tensor
    log_probs: torch.Tensor
    cond: Conditioning | None = None

    @property
    def samples(self) -> torch.Tensor:
        return self.states[:, -1]

    @property
    def num_steps(self) -> int:
        return self.unmask.shape[1]

    @property
    def trained(self) -> torch.Tensor:
        """bool [B, S]: the steps that unmask at least one position of the sample (a step that
        unmasks nothing has no log-prob and no gradient)."""
        return self.unmask.any(-1)

    def __getitem__(self, index) -> "MaskedTrajectory":
        return MaskedTrajectory(self.states[index], self.unmask[index], self.log_probs[index],
                                None if self.cond is None else self.cond[index])

    @staticmethod
    def cat(parts: list["MaskedTrajectory"]) -> "MaskedTrajectory":
        conds = [p.cond for p in parts]
        if any(c is None for c in conds) and not all(c is None for c in conds):
            raise ValueError("MaskedTrajectory.cat: either every part carries its conditioning or none does")
        return MaskedTrajectory(*(torch.cat([getattr(p, f) for p in parts]) for f in ("states", "unmask", "log_probs")),
                                None if conds[0] is None else Conditioning.cat(conds))


@torch.no_grad()
def rollout(logits_fn: Callable[[torch.Tensor], torch.Tensor], initial: torch.Tensor, num_steps: int, *,
            schedule: str = "cosine", temperature: float = 1.0,
            generator: torch.Generator | None = None, mask_id: int = MASK_ID,
            cond: Conditioning | None = None) -> MaskedTrajectory:
    """Unmask ``initial`` long [B, L] (``mask_id`` at the free positions; other tokens are kept)
    in ``num_steps`` steps. ``logits_fn(x)`` maps a state [B, L] to logits [B, L, V] (close over
    the conditioning; ``cond``, when given, is only stored in the trajectory). Draws the plan,
    then one categorical sample per step, from ``generator``."""
    plan = unmasking_plan(initial == mask_id, num_steps, schedule=schedule, generator=generator)
    x, states, log_probs = initial, [initial], []
    for s in range(num_steps):
        step = unmask_step(logits_fn(x), x, plan[:, s], temperature=temperature, generator=generator, mask_id=mask_id)
        x = step.tokens
        states.append(x)
        log_probs.append(step.log_prob)
    return MaskedTrajectory(torch.stack(states, 1), plan, torch.stack(log_probs, 1), cond)
