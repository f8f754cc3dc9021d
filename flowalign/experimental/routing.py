"""Audio-video reward routing as a wrapper of the DiffusionNFT objective (``routing.reweight``,
``routing.influence``; the kernels and the router: ``av_routing.py``).

A subclass of the DiffusionNFT objective: its loss split by the joint latent's branches (DiffusionNFT's
own loss with the branch masks), measures the reward-gradient Gram on each epoch's first
minibatch, folds the epoch's rewards and influences into the router at the end of the epoch, and
checkpoints the router under ``routing``. Everything else is DiffusionNFT's.
"""

from __future__ import annotations

import torch

from flowalign.errors import ConfigError
from flowalign.experimental.av_routing import (RewardRouter, branch_advantages, branch_contrasts, interaction_gram,
                                               layer_gradient_scales, token_weights)
from flowalign.objectives.diffusion_nft import DiffusionNFT, optimality_probability
from pipelines.base import CrossModalAttention, JointAudioVideo
from pipelines.joint import BRANCHES


def rules(config) -> list[tuple[str, bool, str]]:
    r, t = config.routing, config.train
    return [
        ("routing", not (r.reweight or r.influence) or config.method == DiffusionNFT.name,
         "reweight / influence need method diffusion_nft"),
        ("routing.reweight", not r.reweight or t.per_reward_advantages,
         "needs train.per_reward_advantages=true (one advantage per reward, routed per branch)"),
        ("routing.floor_gate", r.floor_gate in ("none", "all", "conflicts"), "must be none, all or conflicts"),
        ("routing.floor_gate", r.floor_gate == "none" or (r.reweight and r.floor_strength > 0),
         "needs routing.reweight=true and routing.floor_strength > 0 (it acts while a reward is below its floor)"),
        ("routing.concerns", set(r.concerns) <= set(config.reward.weights),
         f"names components that reward.weights does not weight: {sorted(set(r.concerns) - set(config.reward.weights))}"),
        ("routing.concerns", all(b and set(b) <= {"video", "audio"} for b in r.concerns.values()),
         "each component's branches must be a non-empty subset of [video, audio]"),
    ]


class RoutedNFT(DiffusionNFT):
    """DiffusionNFT with adaptive reward routing: the loss split by the joint latent's branches
    (``parts``), v_θ's forward recorded for the influence weights (``predict_theta``), the router
    folded at each epoch's end and checkpointed under ``routing``. Not registered: selected by
    ``routing.reweight`` / ``routing.influence`` (``flowalign.experimental.attach``)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        adapter, r = ctx.adapter, self.config.routing
        if not isinstance(adapter, JointAudioVideo) or adapter.modality != "audio_video":
            raise ConfigError(f"config: routing is for audio-video families (their branch masks); "
                              f"{self.config.model.family!r} is not one")
        names = list(self.config.reward.weights)
        concerns = torch.zeros(len(BRANCHES), len(names), dtype=torch.bool)
        for k, name in enumerate(names):
            for branch in r.concerns.get(name, BRANCHES):
                concerns[BRANCHES.index(branch), k] = True
        self.router = RewardRouter(ctx.reward_weights, concerns, warmup=r.warmup, strength=r.strength,
                                   threshold=r.threshold, max_residual=r.max_residual, gram_decay=r.gram_decay,
                                   floor_strength=r.floor_strength if r.reweight else 0.0, floor_max=r.floor_max,
                                   floor_gates_residual=r.floor_gates_residual, floor_gate=r.floor_gate)
        self._layer_scales: dict[str, float] = {}
        self._layer_sums: dict[str, list[float]] = {}
        self._probe_due = True  # the reward-gradient Gram is measured on each epoch's first minibatch
        self._recorder = None  # the cross-modal attention of the last v_θ forward (routing.influence)
        if r.influence:  # each cross-modal module's gradients scaled by its influence (constant within an epoch)
            if not isinstance(adapter, CrossModalAttention):
                raise ConfigError(f"config: routing.influence reads the cross-modal attention during the forward "
                                  f"pass; the {self.config.model.family!r} adapter cannot record it")
            self._writes = {name: branch for name, (branch, _) in adapter.cross_modal_attention().items()}
            for name, (_, module) in adapter.cross_modal_attention().items():
                for p in module.parameters():
                    if p.requires_grad:
                        p.register_hook(lambda g, name=name: g * self._layer_scales.get(name, 1.0))

    def predict_theta(self, x_t, timestep, cond):
        """v_θ, recording the cross-modal attention of its forward pass under ``routing.influence``."""
        if not self.config.routing.influence:
            return super().predict_theta(x_t, timestep, cond)
        with self.ctx.adapter.record_cross_modal(maps=False, model=self.ctx.model) as recorder:
            v_theta = super().predict_theta(x_t, timestep, cond)
        self._recorder = recorder
        return v_theta

    def parts(self, mb, x0, x_t, sigma, v_theta, v_old):
        """(r [b, M], branch masks [M, D], token weights [b, D] or None): per-branch r (reweight)
        and/or influence token weights; on each epoch's first minibatch, the reward-gradient Gram."""
        ctx, r, t = self.ctx, self.config.routing, self.config.train
        adv, layout = mb.advantages, ctx.adapter.joint_layout
        elem_weight = None
        if r.influence:
            video, audio = [], []
            for name, calls in self._recorder.records.items():
                u = calls[-1].response_ratio  # [b, tokens of the branch this module writes into]
                (video if self._writes[name] == "video" else audio).append(u)
                self._layer_sums.setdefault(name, [0.0, 0.0])
                self._layer_sums[name][0] += float(u.mean())
                self._layer_sums[name][1] += 1
            elem_weight = layout.expand_tokens(token_weights(torch.stack(video).mean(0), r.token_alpha),
                                               token_weights(torch.stack(audio).mean(0), r.token_alpha))
        per_reward = adv if adv.ndim == 2 else adv[:, None]
        if r.reweight:
            masks = ctx.adapter.branch_masks().to(x0.device)
            prob = optimality_probability(branch_advantages(per_reward, self.router.weights.to(adv)), t.advantage_clip)
        else:
            masks = torch.ones(1, layout.numel, dtype=torch.bool, device=x0.device)
            prob = optimality_probability(ctx.scalarise(adv), t.advantage_clip)[:, None]
        if r.reweight and self._probe_due and self.router.needs_gram:
            self._probe_due = False
            self.router.observe(self._interaction_gram(v_theta, v_old, x_t, x0, sigma, masks, elem_weight,
                                                       optimality_probability(per_reward, t.advantage_clip) - 0.5,
                                                       mb.valid.bool()))
        return prob, masks, elem_weight

    def loss(self, mb, j):
        loss, stats = super().loss(mb, j)
        self._recorder = None
        return loss, stats

    def _interaction_gram(self, v_theta, v_old, x_t, x0, sigma, masks, elem_weight, centred, keep) -> torch.Tensor:
        """The reward-gradient Gram [M, K, K] of one minibatch (``interaction_gram``): one batched backward
        pass (a vector-Jacobian product per branch, routed reward and half of the kept samples) through
        the graph the loss then reuses."""
        params = self.ctx.params
        contrast = branch_contrasts(v_theta, v_old, x_t, x0, sigma, masks, beta=self.config.train.nft_beta,
                                    elem_weight=elem_weight)  # [b, M]
        kept = keep.nonzero().flatten()
        halves = (kept[0::2], kept[1::2])
        n_branch, n_reward = self.router.priors.shape
        gram = torch.zeros(n_branch, n_reward, n_reward)
        if len(halves[1]) == 0:
            return gram
        pairs = [(b, k) for b in range(n_branch) for k in range(n_reward) if self.router.priors[b, k] > 0]
        # one vector-Jacobian product per (half, branch, reward): mean over the half of a_ik·C_i^b
        seeds = torch.zeros(2 * len(pairs), *contrast.shape, device=contrast.device)
        for h, half in enumerate(halves):
            for j, (b, k) in enumerate(pairs):
                seeds[h * len(pairs) + j, half, b] = centred[half, k].to(seeds) / len(half)
        grads = torch.autograd.grad(contrast, params, grad_outputs=seeds, retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        flat = torch.cat([(g if g is not None else torch.zeros(len(seeds), *p.shape, device=p.device)).flatten(1)
                          for g, p in zip(grads, params)], 1).float().view(2, len(pairs), -1)
        for b in range(n_branch):
            rows = [j for j, (bb, _) in enumerate(pairs) if bb == b]
            idx = torch.tensor([pairs[j][1] for j in rows])
            gram[b, idx[:, None], idx[None, :]] = interaction_gram(flat[0, rows], flat[1, rows]).cpu()
        return gram

    def end_epoch(self, batch, epoch: int) -> dict[str, float]:
        """Fold this epoch's interactions, rewards and influences (over all processes) into the
        router, then the wrapped objective's end of epoch."""
        router, stats, across = self.router, {}, self.ctx.dist.across_processes
        pending = router.pending_gram
        router.pending_gram = across(pending.flatten().tolist()).sum(0).float().view_as(pending)
        names = list(self.config.reward.weights)
        values = torch.stack([batch.components[name].float() for name in names], 1)  # [B, K], NaN = failed
        valid = torch.isfinite(values)
        v = torch.where(valid, values, torch.zeros_like(values)).double()
        sums = across([*valid.sum(0).tolist(), *v.sum(0).tolist(), *(v**2).sum(0).tolist()])
        n, total, squares = sums.sum(0).view(3, len(names)).float()
        mean = torch.where(n > 0, total / n.clamp(min=1), torch.full_like(n, float("nan")))
        router.observe_rewards(mean, (squares / n.clamp(min=1) - mean**2).clamp(min=0).sqrt(), n)
        router.end_epoch(epoch + 1)
        self._probe_due = True
        if self.config.routing.reweight:
            for b, branch in enumerate(BRANCHES):
                for k, name in enumerate(names):
                    if router.priors[b, k] > 0:
                        stats[f"routing/weight_{branch}_{name}"] = float(router.weights[b, k])
                        stats[f"routing/cos_{branch}_{name}"] = float(router.cos[b, k])
            for k, name in enumerate(names):
                stats[f"routing/floor_multiplier_{name}"] = float(router.floor_multiplier[k])
        if self.config.routing.influence and self._layer_sums:
            layers = sorted(self._layer_sums)
            means = across([self._layer_sums[n][0] / max(self._layer_sums[n][1], 1) for n in layers]).mean(0)
            router.observe_layers(dict(zip(layers, means.tolist())))
            self._set_layer_scales()
            self._layer_sums = {}
            stats.update({f"routing/grad_scale_{n}": v for n, v in self._layer_scales.items()})
        stats.update(super().end_epoch(batch, epoch))
        return stats

    def _set_layer_scales(self) -> None:
        """Gradient scale of each cross-modal module from the router's influence EMA (1 before any)."""
        r, names = self.config.routing, sorted(self.router.layer_influence)
        scales = layer_gradient_scales(torch.tensor([self.router.layer_influence[n] for n in names]),
                                       r.layer_scale_min, r.layer_scale_max) if names else torch.zeros(0)
        self._layer_scales = dict(zip(names, scales.tolist()))

    def components(self) -> dict:
        """Checkpointed state: the wrapped objective's, and the router under ``routing``."""
        return {**super().components(), "routing": _RouterState(self)}


class _RouterState:
    checkpoint_format = "pt"

    def __init__(self, wrapper: RoutedNFT):
        self.wrapper = wrapper

    def state_dict(self) -> dict:
        return self.wrapper.router.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.wrapper.router.load_state_dict(state)
        self.wrapper._set_layer_scales()
