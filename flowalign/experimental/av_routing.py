"""DiffusionNFT for joint audio-video models with adaptive reward routing (``../shared/METHODS.md`` §3).

A joint sample is one latent tensor whose elements belong to *branches* (video, audio: the
adapter's boolean masks). Rewards come as K components (per-modality quality, text–video and
text–audio alignment, sync); the user's ``reward.weights`` are *preference priors* p [K].

**Fixed routing** (the baseline): one advantage A = Σ_k p_k·A_k per sample, one DiffusionNFT
loss over all elements: exactly ``diffusion_nft_loss``.

**Branch routing.** Each reward is routed to the branches it concerns (a video reward to video,
an audio reward to audio, sync and cross-modal rewards to both): a matrix W [M, K] with
W[b, k] = p_k if reward k concerns branch b, else 0. Branch b trains with its own advantage
A_b = Σ_k W[b, k]·A_k, so the video elements are not pushed around by audio-only rewards.

**(ii) Preference-preserving modality-aware reweighting.** The NFT loss is affine in the
optimality probability: per sample and branch, L_i^b(r) = N_i^b + r·C_i^b with the contrast
C_i^b = P_i^b − N_i^b. Reward k's own push on branch b is therefore the parameter gradient

    g_k^b = ∇_θ mean_i a_ik·C_i^b,    a_ik = r_ik − ½,

and the branch's reward-gradient interactions are the Gram matrix G^b_kj = ⟨g_k^b, g_j^b⟩. It is
measured once per epoch on one minibatch, with one backward pass per (branch, reward, half): the
minibatch is split in two halves A and B and G = (g^A·g^Bᵀ + g^B·g^Aᵀ) / 2, whose expectation is
the Gram of the expected gradients (a half's sampling noise never multiplies itself, so the
diagonal is not inflated by it). Under the combined direction g = Σ_k W[b, k]·g_k, reward k
improves at the normalised rate cos_k = (G w)_k / √(G_kk · wᵀGw) (G made PSD first). After
``warmup`` epochs each routed reward carries a residual ρ_k ≥ 0, W[b, k] = p_k·(1 + ρ_k) with each
row rescaled to keep its total prior mass, updated once per epoch by a dual-ascent step on the
constraint cos_k ≥ ``threshold``: ρ_k ← clip(ρ_k + strength·(threshold − cos_k), 0, ρ_max), cos
measured under the current W. A reward that conflicts with, or is drowned by, the others gains
weight epoch after epoch until it improves again; a residual no longer needed decays back to the
prior. Priors stay the anchor: a reward the user weighted 0 stays 0, rewards that keep agreeing
keep their priors exactly, and during warm-up W is the routed priors unchanged. G is averaged
over epochs (an EMA) because one minibatch's estimate is noisy. **Reward floors** (``floor_strength``
> 0) close the loop on the rewards themselves: the gradient cosines say whether a reward *can*
improve under W, not whether it does, and on the audio-video world sync fell under every cosine-
driven W. Each reward's mean over the warm-up epochs is its floor f_k; afterwards a Lagrange
multiplier λ_k ≥ 0 of the constraint r̄_k ≥ f_k (r̄_k the epoch's training-rollout mean) is updated
by λ_k ← clip(λ_k + floor_strength·(f_k − r̄_k)/s_k, 0, floor_max), s_k the reward's warm-up std, and
adds to the residual: W[b, k] ∝ p_k·(1 + ρ_bk + λ_k). A reward held above its floor keeps λ = 0.
With ``floor_gates_residual`` such a reward's cosine residual may only decay: a low cosine does not
boost a reward that is not falling, which otherwise competes with the boost of one that is (on the
audio-video world text–video's cosine went negative while text–video rose, and its residual took
weight from the falling sync). **Floor gating** (``floor_gate``) makes a floor a hard priority, as
CRPO (Xu et al., 2021) does for constrained RL: while λ_k > 0 (reward k below its floor on balance:
the multiplier integrates shortfall minus surplus, which gives the switch hysteresis), the other
rewards of each branch that carries k get weight 0 there and the rest their priors: with
``"all"`` every one of them, with ``"conflicts"`` those whose gradient opposes the violated rewards'
on that branch, (G^b w_V)_j < 0 with w_V the weights of the rewards in violation. The soft
weights return once λ_k is paid back to 0. While ``"all"`` gates every branch, W does not
depend on the Gram, so the trainer does not measure it (``RewardRouter.needs_gram``) and the
residuals wait for the next measurement. On the audio-video world sync fell under every soft
weighting, while training on sync alone raised every component. (An output-space proxy,
Σ_i ‖∂C_i/∂v_θ‖²·a_ik·a_ij, costs no backward pass but treats the samples' outputs as independent
parameters: on the audio-video world it put every cosine at 0.6–0.9 while sync fell under fixed
weights, because the conflict lives in the shared weights.)

**(i) Cross-modal influence-guided routing.** Each block's ``audio_to_video_attn`` (video tokens
query audio) and ``video_to_audio_attn`` respond to the other modality; the response ratio
u = ‖attention output‖ / ‖residual input‖ per query token, read during the training forward pass,
is a free proxy of how much the other modality drives that token. It is used twice:

* token weights: per sample and branch, w_tok = (u / mean u)^α renormalised to mean 1, multiply
  the branch's per-element errors (tokens that carry cross-modal influence, where sync is decided,
  weigh more; α = 0 gives the plain loss);
* layer gradient scales: the gradients of each cross-modal module are multiplied by
  clip(ū_l / mean_l ū_l, s_min, s_max), the module's mean response relative to all such modules
  (layers through which little cross-modal influence flows are updated less; the published LTX-2
  relative stops gradients in shallow audio→video layers, the limit s → 0).

The routed loss is ``diffusion_nft_loss`` with the branch masks and r [B, M]. With uniform token
weights and unit gradient scales, one branch, or the same r on every branch, gives the unsplit loss (tested; each branch's errors are
normalised by the whole sample's, so a video-first sample's waiting stream takes no weight).
"""

from __future__ import annotations

import torch

from flowalign.objectives.diffusion_nft import implicit_errors


def routed_priors(priors: torch.Tensor, concerns: torch.Tensor) -> torch.Tensor:
    """W0[b, k] = p_k where reward k concerns branch b. priors: [K]; concerns: bool [M, K] → [M, K]."""
    if not concerns.any(0).all():
        raise ValueError("every reward must concern at least one branch")
    return priors.float()[None, :] * concerns.float()


def branch_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A_b = Σ_k W[b, k]·A_k. advantages: [B, K] (one column per reward); weights: [M, K] → [B, M]."""
    return advantages.float() @ weights.float().T


def interaction_gram(grads_a: torch.Tensor, grads_b: torch.Tensor) -> torch.Tensor:
    """G = (g_A·g_Bᵀ + g_B·g_Aᵀ) / 2 from each reward's gradient on two independent halves of a
    minibatch. grads_a, grads_b: [K, P] (one flattened parameter gradient per reward) → [K, K]."""
    cross = grads_a.float() @ grads_b.float().T
    return (cross + cross.T) / 2


def psd_part(gram: torch.Tensor) -> torch.Tensor:
    """The nearest positive semi-definite matrix of each symmetric G [M, K, K] (negative eigenvalues
    set to 0): the half-split estimate is unbiased but not PSD, and cosines need a PSD Gram to lie in [−1, 1]."""
    values, vectors = torch.linalg.eigh(gram.double())
    return (vectors @ torch.diag_embed(values.clamp(min=0)) @ vectors.transpose(1, 2)).to(gram.dtype)


def gradient_cosines(weights: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """cos_k = (G w)_k / √(G_kk·wᵀGw) of each branch, 0 where undefined. weights: [M, K]; gram: PSD [M, K, K] → [M, K]."""
    w = weights.float()
    gw = torch.einsum("bkj,bj->bk", gram.float(), w)
    norm = (torch.diagonal(gram, dim1=1, dim2=2).float().clamp(min=0) * (w * gw).sum(1, keepdim=True).clamp(min=0)).sqrt()
    return torch.where(norm > 1e-12, gw / norm.clamp(min=1e-12), torch.zeros_like(gw)).clamp(-1.0, 1.0)


def residual_weights(
    priors: torch.Tensor,
    gram: torch.Tensor,
    residual: torch.Tensor,
    *,
    active: bool,
    strength: float = 1.0,
    threshold: float = 0.3,
    max_residual: float = 4.0,
    floor_multiplier: torch.Tensor | None = None,
    secure: torch.Tensor | None = None,
    gate: str = "none",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One epoch's update of the routing: (W [M, K], cos [M, K], residual ρ [M, K]).

    priors: routed priors W0 [M, K]; gram: G [M, K, K] (made PSD here); residual: the current ρ.
    cos is measured under the weights ρ gives now, W(ρ) = W0·(1 + ρ) with each row rescaled to its
    prior mass; then ρ ← clip(ρ + strength·(threshold − cos), 0, max_residual), a dual-ascent step
    on the constraint cos_k ≥ threshold: a reward that stays suppressed gains weight epoch after
    epoch until it is not, and a residual no longer needed decays back to 0 (the prior). Only
    residuals relative to a row's least boosted reward change W, so that one is held at 0.
    ``active`` False (warm-up) returns W0 itself and ρ unchanged. Rewards with W0 = 0 keep 0.
    ``floor_multiplier``: λ [K] of ``floor_multipliers``, added to every row's residual (W ∝ W0·(1 + ρ + λ)).
    ``secure``: bool [K], rewards at or above their floor: their step is clipped at 0, so a low
    cosine does not boost a reward that is not falling (the residual goes to those that are).
    ``gate`` ("none" | "all" | "conflicts"): ``floor_gate`` switches off the rewards that compete
    with those below their floor (λ > 0) on their branches (after the residuals; cos is measured
    before the gate).
    """
    extra = torch.zeros(priors.shape[1]) if floor_multiplier is None else floor_multiplier.float()

    def routed(rho):
        boosted = priors.float() * (1 + rho + extra[None, :])
        return boosted * priors.float().sum(1, keepdim=True) / boosted.sum(1, keepdim=True).clamp(min=1e-12)

    gram = psd_part(gram.float())
    if not active:
        return priors, gradient_cosines(priors, gram), residual
    cos = gradient_cosines(routed(residual), gram)
    routed_mask = priors > 0
    step = strength * (threshold - cos)
    if secure is not None:
        step = torch.where(secure[None, :], step.clamp(max=0.0), step)
    residual = (residual + step) * routed_mask
    # only relative residuals change W (rows are rescaled): the least boosted routed reward of a row sits at 0
    floor = torch.where(routed_mask, residual, torch.full_like(residual, float("inf"))).min(1, keepdim=True).values
    residual = ((residual - floor.clamp(min=0)).clamp(min=0.0, max=max_residual)) * routed_mask
    weights = routed(residual)
    violated = extra > 0
    if gate != "none" and violated.any():
        weights = floor_gate(weights, priors, gram, violated, gate)
    return weights, cos, residual


def floor_gate(weights: torch.Tensor, priors: torch.Tensor, gram: torch.Tensor, violated: torch.Tensor,
               mode: str) -> torch.Tensor:
    """Switch off, per branch, the rewards that compete with a reward below its floor.

    weights: W [M, K]; priors: W0 [M, K]; gram: PSD G [M, K, K]; violated: bool [K]; mode "all" |
    "conflicts". A branch that carries a violated reward (W > 0) trains on the priors W0 of the
    rewards that do not compete with it: with "all" every other reward competes, with "conflicts"
    those whose gradient opposes the violated ones', (G w_V)_j < 0 with w_V = W masked to the
    violated rewards. The gated row is not rescaled and carries no residual or floor boost: as in
    CRPO, a violated constraint gets a step of its own at its own weight, not an amplified one (an
    earlier rule kept the row's mass, which trained sync alone at 3× its weight; on the audio-video
    world both rules gave the same results). Branches without a violated reward keep W. → [M, K]
    """
    if mode not in ("all", "conflicts"):
        raise ValueError(f"floor_gate: mode must be all or conflicts, got {mode!r}")
    w = weights.float()
    w_violated = w * violated[None, :].float()
    pull = torch.einsum("bjk,bk->bj", gram.float(), w_violated)
    competes = torch.ones_like(pull, dtype=torch.bool) if mode == "all" else pull < 0
    gated_rows = w_violated.sum(1, keepdim=True) > 0
    return torch.where(gated_rows, priors.float().masked_fill(~violated[None, :] & competes, 0.0), w)


def floor_multipliers(
    multiplier: torch.Tensor,
    means: torch.Tensor,
    floors: torch.Tensor,
    scales: torch.Tensor,
    *,
    strength: float,
    max_multiplier: float,
) -> torch.Tensor:
    """One dual-ascent step on the constraints r̄_k ≥ f_k: λ ← clip(λ + strength·(f − r̄)/s, 0, λ_max).

    multiplier λ, means r̄ (this epoch's), floors f, scales s (> 0): [K] → [K]. A NaN mean (no
    valid sample) leaves its λ as it is."""
    step = strength * (floors.float() - means.float()) / scales.float().clamp(min=1e-6)
    return (multiplier.float() + torch.nan_to_num(step, nan=0.0)).clamp(min=0.0, max=max_multiplier)


def response_ratio(output: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """u = ‖o‖ / ‖h‖ per token. output, residual: [B, N, D] → [B, N]."""
    return output.float().norm(dim=-1) / residual.float().norm(dim=-1).clamp(min=1e-6)


def token_weights(influence: torch.Tensor, alpha: float) -> torch.Tensor:
    """w = (u / mean u)^α renormalised to mean 1 over each sample's tokens. influence: [B, N] → [B, N]."""
    u = influence.float().clamp(min=1e-6)
    w = (u / u.mean(1, keepdim=True)) ** alpha
    return w / w.mean(1, keepdim=True)


def layer_gradient_scales(layer_influence: torch.Tensor, low: float = 0.25, high: float = 4.0) -> torch.Tensor:
    """s_l = clip(ū_l / mean_l ū_l, low, high). layer_influence: [L] mean response per module → [L]."""
    u = layer_influence.float()
    return (u / u.mean().clamp(min=1e-12)).clamp(low, high)


def branch_contrasts(v_theta, v_old, x_t, x0, t, masks, *, beta: float,
                     elem_weight: torch.Tensor | None = None) -> torch.Tensor:
    """C_i^b: what r_i^b multiplies in sample i's loss (``diffusion_nft_loss`` with ``masks`` = mean_i
    Σ_b [N + r·C]), with its graph to v_θ. Arguments as that loss's. Returns [B, M]."""
    pos, neg = implicit_errors(v_theta, v_old, x_t, x0, t, beta, masks, elem_weight)
    return (pos - neg) / beta


class RewardRouter:
    """The state of routing over a run: priors W0 [M, K], the Gram's EMA [M, K, K], the current
    weights W [M, K] and each cross-modal module's mean response (an EMA, for its gradient scale).

    ``observe`` adds one minibatch's interaction Gram [M, K, K] (``interaction_gram`` per branch);
    ``observe_rewards`` the epoch's per-reward training mean and std [K]; ``end_epoch(epoch)`` folds
    the epoch's Gram into the EMA, during warm-up accumulates the reward floors, and from epoch
    ``warmup`` on updates the floor multipliers and recomputes W with ``residual_weights``
    (before it W is W0). ``needs_gram`` says whether the next epoch's W can depend on a Gram at
    all: not while gate ``all`` holds every branch. An epoch without ``observe`` keeps the Gram
    and the residuals as they were (nothing was measured to step them on).
    """

    def __init__(self, priors: torch.Tensor, concerns: torch.Tensor, *, warmup: int, strength: float,
                 threshold: float, max_residual: float, gram_decay: float, floor_strength: float = 0.0,
                 floor_max: float = 10.0, floor_gates_residual: bool = False, floor_gate: str = "none"):
        self.priors = routed_priors(priors, concerns)
        self.weights = self.priors.clone()
        self.cos = torch.zeros_like(self.priors)
        self.residual = torch.zeros_like(self.priors)
        self.gram = torch.zeros(*self.priors.shape, self.priors.shape[1])
        self.pending_gram = torch.zeros_like(self.gram)
        self.layer_influence: dict[str, float] = {}
        self.warmup, self.strength, self.threshold = warmup, strength, threshold
        self.max_residual, self.gram_decay = max_residual, gram_decay
        self.floor_strength, self.floor_max = floor_strength, floor_max
        self.floor_gates_residual, self.floor_gate = floor_gates_residual, floor_gate
        k = self.priors.shape[1]
        self.floor_multiplier = torch.zeros(k)
        self.warmup_sums = torch.zeros(3, k)  # Σ n, Σ mean·n, Σ (std² + mean²)·n over the warm-up epochs
        self.epoch_rewards: tuple[torch.Tensor, torch.Tensor] | None = None
        self._seen, self._measured = False, False

    def observe(self, gram: torch.Tensor) -> None:
        self.pending_gram += gram.detach().float().cpu()
        self._measured = True

    @property
    def needs_gram(self) -> bool:
        """False while gate ``all`` holds every branch (each carries a reward below its floor): W is
        then the gated priors whatever the Gram, so measuring it (a batched backward pass per
        branch, reward and half-minibatch) would be wasted."""
        if self.floor_gate != "all":
            return True
        violated = self.floor_multiplier > 0
        return not bool((self.priors[:, violated] > 0).any(1).all())

    def observe_rewards(self, means: torch.Tensor, stds: torch.Tensor, counts: torch.Tensor) -> None:
        """This epoch's training rewards: per component mean, std and number of valid samples [K]."""
        self.epoch_rewards = (means.float(), stds.float(), counts.float())

    def floors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(f, s) [K]: each reward's mean and std over the warm-up epochs' samples."""
        n, total, squares = self.warmup_sums
        mean = total / n.clamp(min=1)
        return mean, (squares / n.clamp(min=1) - mean**2).clamp(min=0).sqrt()

    def observe_layers(self, influence: dict[str, float], decay: float = 0.9) -> None:
        for name, u in influence.items():
            old = self.layer_influence.get(name)
            self.layer_influence[name] = u if old is None else decay * old + (1 - decay) * u

    def end_epoch(self, epoch: int) -> None:
        """epoch: the number of epochs finished."""
        measured, self._measured = self._measured, False
        if measured:
            self.gram = self.pending_gram if not self._seen else \
                self.gram_decay * self.gram + (1 - self.gram_decay) * self.pending_gram
            self._seen = True
        self.pending_gram = torch.zeros_like(self.gram)
        secure = None
        if self.floor_strength > 0 and self.epoch_rewards is not None:
            means, stds, counts = self.epoch_rewards
            if epoch <= self.warmup:  # the rewards sampled under W0
                self.warmup_sums += torch.stack([counts, means * counts, (stds**2 + means**2) * counts])
            else:
                floors, scales = self.floors()
                self.floor_multiplier = floor_multipliers(self.floor_multiplier, means, floors, scales,
                                                          strength=self.floor_strength, max_multiplier=self.floor_max)
            if self.floor_gates_residual and epoch >= self.warmup:  # the floors are complete from here on
                secure = means >= self.floors()[0]  # NaN (no valid sample): not secure
        self.epoch_rewards = None
        self.weights, self.cos, self.residual = residual_weights(  # strength 0: ρ stays (see needs_gram)
            self.priors, self.gram, self.residual, active=epoch >= self.warmup,
            strength=self.strength if measured else 0.0,
            threshold=self.threshold, max_residual=self.max_residual, floor_multiplier=self.floor_multiplier,
            secure=secure, gate=self.floor_gate)

    def state_dict(self) -> dict:
        return {"weights": self.weights, "cos": self.cos, "gram": self.gram, "residual": self.residual, "seen": self._seen,
                "layer_influence": dict(self.layer_influence), "floor_multiplier": self.floor_multiplier,
                "warmup_sums": self.warmup_sums}

    def load_state_dict(self, state: dict) -> None:
        self.weights, self.cos, self.gram = state["weights"], state["cos"], state["gram"]
        self.residual = state["residual"]
        self._seen, self.layer_influence = state["seen"], dict(state["layer_influence"])
        # checkpoints written before reward floors existed have none: they start from λ = 0
        self.floor_multiplier = state.get("floor_multiplier", torch.zeros_like(self.floor_multiplier))
        self.warmup_sums = state.get("warmup_sums", torch.zeros_like(self.warmup_sums))
