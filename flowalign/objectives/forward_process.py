"""What the forward-process objectives (DiffusionNFT, GDRO, AWM, DGPO) share: noising draws of the
final samples from each shard's noise stream, and the noised copies x_t they train on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowalign.objectives.base import BaseObjective, Minibatch, Rule
from pipelines.base import NoisesForward
from flowalign.domains import Annotated, at_least


@dataclass
class NoisingOptions:
    noise_draws: Annotated[int, at_least(1)] = 4  # noising draws (distinct schedule σ's) per sample per minibatch (train.noise_draws)


def forward_draws(dist, n: int, levels: int, shape: tuple[int, ...], k: int,
                  share: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Noising draws for one inner epoch of ``n`` samples of ``shape``, from each shard's noise
    stream: schedule indices long [n, k] (k distinct steps per sample among the first ``levels``)
    and noise [n, k, *shape]; ``share`` consecutive samples (a GDRO / DGPO group, an NFT group under
    train.nft_shared_noising) get the same draws."""
    per_shard = n // len(dist.streams) // share
    indices, noise = [], []
    for streams in dist.streams:
        g = streams["noise"]
        indices.append(torch.rand(per_shard, levels, generator=g).argsort(dim=1)[:, :k])
        noise.append(torch.randn(per_shard, k, *shape, generator=g))
    return (torch.cat(indices).repeat_interleave(share, dim=0).to(dist.device),
            torch.cat(noise).repeat_interleave(share, dim=0).to(dist.device))


def noised(adapter, sub, step: torch.Tensor, eps: torch.Tensor, own_noising: bool = False):
    """x_t = (1 − σ)·x0 + σ·ε of each sample's final latent: (x0, x_t, σ [b], timestep [b]). An
    adapter with forward noising of its own (``own_noising``: a ``pipelines.base.NoisesForward``,
    per-stream levels, av_demo's video-first order) gives (x0 as the loss compares it, x_t, σ)."""
    device = sub.samples.device
    sigma, timestep = sub.sigmas.to(device)[step], sub.timesteps.to(device)[step]
    x0 = sub.samples
    if own_noising:
        return (*adapter.forward_noised(x0, eps, sigma), timestep)
    s = sigma.view(-1, *([1] * (x0.ndim - 1)))
    return x0, (1 - s) * x0 + s * eps, sigma, timestep


class ForwardProcessObjective(BaseObjective):
    """The loop members of an objective on the forward process: ``train.noise_draws`` loss terms
    per minibatch, one per noising draw, drawn once per update for every sample (``unit``
    consecutive samples share theirs) among the first ``levels(config)`` schedule levels."""

    options = (NoisingOptions,)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.draws = None  # (schedule indices long [B, K], noise [B, K, ...]) of this update
        self.own_noising = isinstance(ctx.adapter, NoisesForward)  # the capability, checked once

    @classmethod
    def validate(cls, config) -> list[Rule]:
        return [("train.noise_draws", 1 <= config.train.noise_draws <= config.sampling.num_steps,
                 "must be between 1 and sampling.num_steps")]

    @classmethod
    def num_terms(cls, config) -> int:
        return config.train.noise_draws

    def levels(self, batch) -> int:
        """How many schedule levels (from the noisiest) the draws choose among: all of them."""
        return len(batch.traj.timesteps)

    def terms(self, batch) -> list[int]:
        return list(range(self.config.train.noise_draws))

    def begin_update(self, batch) -> None:
        traj = batch.traj
        self.draws = forward_draws(self.ctx.dist, len(traj.latents), self.levels(batch), tuple(traj.samples.shape[1:]),
                                   self.config.train.noise_draws, self.unit)

    def noised(self, mb: Minibatch, j: int):
        """Draw j of minibatch ``mb``: (x0, x_t, σ [b], timestep [b], ε)."""
        eps = self.draws[1][mb.idx, j]
        return (*noised(self.ctx.adapter, mb.traj, self.draws[0][mb.idx, j], eps, self.own_noising), eps)
