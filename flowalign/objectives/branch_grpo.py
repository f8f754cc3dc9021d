"""BranchGRPO (Li et al., arXiv 2509.06040): tree-shaped rollouts that share prefixes, per-step
advantages from the tree, and the clipped-ratio loss on every edge of the tree once.

Source: the authors' code, Fredreic1849/BranchGRPO at 19fbb9fc92ad1857212f3b664d6e9ff80c8b3804,
fastvideo/train_branchgrpo_flux.py (``run_tree_sample_step``, ``flux_step_with_split``,
``compute_node_rewards_from_leaves``, ``compute_hierarchical_advantages_by_depth``,
``train_one_step_tree``) with scripts/finetune/finetune_flux_branchgrpo_8gpus.sh for the values.
Read, not copied.

Rollout (``../shared/METHODS.md`` §1 for the steps): each prompt group is one tree
(``flowalign/samplers/tree.py``) grown from the group's shared noise (``--init_same_noise``).
Every step is DanceGRPO's SDE (``sampling.sde: dance_grpo``, ``flux_step(sde_solver=True)``, η = 0.3);
at each step of ``train.branch_split_points`` (``--tree_split_points 0,3,6,9`` of 20) every node
gets ``train.branch_factor`` = 2 children (the code's fixed ``num_splits = 2``), each drawn as

    x' = μ + c·std·z,   c = train.branch_split_noise_scale (4.0 in the script; argparse default 0.3)

and scored, at sampling and when rescored, as N(μ, std²): the code's log-prob ignores c (so does
ours: ``tree_rollout``). The group is the 2^4 = 16 leaves (``--num_generations 16``).

Advantages (per tree, no ``--use_group``): a node's reward is the mean of the rewards of the leaves
below it; at each depth d of the tree, over its N_d nodes n,

    A(n) = (r(n) − mean_d r) / (std_d r + 1e-8)     std unbiased (torch.std);
    A(n) = 0 where std_d r < 1e-6 or N_d = 1;         then clipped to ±train.advantage_clip (5.0)

and the edge of step i into node n (depth i + 1) trains with A(n). After the last split a node has
one leaf, so those edges carry the leaves' own standardised rewards.

Loss: each edge e = (x → x') of every tree once, with the PPO clip of Flow-GRPO (train.clip_range,
``--clip_range 1e-3``) on r_e = exp(log p_θ(x'|x) − log p_old(x'|x)) (log-prob: mean over elements):

    L = (1 / E) · Σ_e max(−A_e·r_e, −A_e·clip(r_e, 1 − ε, 1 + ε))     (+ β·KL, Flow-GRPO's, if kl_beta > 0)

over the E edges of the minibatch's trees that train (the trainer sums the steps' terms: each term
is scaled so the sum is this mean over edges, not a mean of per-step means: a step with 16 edges
weighs 8 times one with 2, as in the code). ``train.branch_depth_pruning``: depths whose edges do not
train (``--depth_pruning``; sampling and rewards unchanged).

Where flowalign differs from the code, and why:
* the last step: the code's is an SDE step to σ' = 0 and trains; ours is the deterministic Euler
  step every flowalign rollout ends with, not trained (the code scores the last step's x̂0, which is
  that Euler step's result, so the rewarded image is the same).
* batching: the code shuffles all transitions of a process's trees and steps the optimizer every
  ``gradient_accumulation_steps`` (12) of them, each loss divided by 12·E_tree (E_tree: transitions per
  tree); we take one optimizer step per minibatch of whole trees (train.train_batch_size), its loss
  the mean over its edges. The code's step gradient is 1/E_tree times a mean over 12 transitions;
  under AdamW a constant gradient scale cancels (up to its ε), so what differs is which edges share
  an optimizer step.
* ``train.branch_node_reward: prob_weighted`` is ``--tree_prob_weighted`` (off in the script): a node's
  reward is Σ_c softmax_c(log p_c)·r(c) over its children c at a split (temperature 1, the code's α),
  log p_c the edge's log-prob at sampling (mean over elements).
* not implemented: width pruning (``--width_pruning_mode`` 1/2; 0 in the script), the
  sliding depth-pruning window (``--depth_pruning_slide``: it slides an empty list in the script) and
  ``--mix_ode_sde_tree`` (off). ``--use_group`` (leaf advantages only) is not the script's mode.
* a tree with a dropped (NaN) reward does not train (the code has no dropped rewards).
The paper was not read for this file; the formulas are the code's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowalign.domains import Annotated, above, at_least
from flowalign.objectives.base import Minibatch, register, tree_rules
from flowalign.objectives.flow_grpo import FlowGRPO, flow_grpo_loss
from flowalign.samplers.steps import plan_steps
from flowalign.samplers.tree import TreeShape

STD_FLOOR = 1e-6  # a depth whose node rewards spread less than this gets advantage 0 (the code's check)
STD_EPS = 1e-8  # added to the std in the division (the code's)
NODE_REWARDS = ("mean", "prob_weighted")


def node_rewards(rewards: torch.Tensor, shape: TreeShape, log_probs: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each depth's node rewards [T, N_d], d = 0..S, from the leaves' rewards [T, L]: the mean over
    the leaves below (``log_probs`` None), or (``--tree_prob_weighted``, log_probs [T, L, S] of each
    leaf's edges) bottom-up, a node's reward the softmax(log p of its children's edges)-weighted sum of
    its children's (one child: its reward)."""
    if log_probs is None:
        return [shape.node_means(rewards.float(), d) for d in range(shape.num_steps + 1)]
    levels = [rewards.float()]
    for i in reversed(range(shape.num_steps)):
        k, children = shape.branches[i], levels[0]  # children: [T, N_{i+1}]
        if k == 1:
            levels.insert(0, children)
            continue
        owner = torch.arange(0, shape.leaves, shape.leaves_below(i + 1), device=log_probs.device)
        weight = torch.softmax(log_probs[:, owner, i].float().reshape(len(children), -1, k), dim=-1)
        levels.insert(0, (weight * children.reshape(len(children), -1, k)).sum(-1))
    return levels


def tree_advantages(rewards: torch.Tensor, shape: TreeShape, clip: float,
                    log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-edge advantages of T trees: rewards [T, L] of the leaves (depth-first) → [T, L, S], entry
    [t, ℓ, i] the advantage of step i's edge into leaf ℓ's node at depth i + 1 (module docstring;
    ``log_probs`` [T, L, S]: node rewards weighted by the children's edge probabilities, ``node_rewards``)."""
    out = torch.zeros(*rewards.shape, shape.num_steps, dtype=torch.float32, device=rewards.device)
    levels = node_rewards(rewards, shape, log_probs)
    for i in range(shape.num_steps):
        depth = i + 1
        if shape.nodes_at(depth) < 2:
            continue
        node = levels[depth]  # [T, N_d]
        std = node.std(dim=1, keepdim=True)
        adv = torch.where(std < STD_FLOOR, torch.zeros_like(node), (node - node.mean(1, keepdim=True)) / (std + STD_EPS))
        out[:, :, i] = shape.to_leaves(adv, depth)
    return out.clamp(-clip, clip)


@dataclass
class BranchGRPOOptions:
    """``train.*`` options of method branch_grpo (the tree; its loss is Flow-GRPO's clip)."""

    # steps at which every node branches (--tree_split_points; < sampling.num_steps − 1, the last step being
    # deterministic); train.group_size must be branch_factor ** len(branch_split_points)
    branch_split_points: Annotated[list[int], at_least(0)] = field(default_factory=lambda: [0, 3, 6, 9])
    branch_factor: Annotated[int, at_least(2)] = 2  # children per node at a split step (the code's fixed 2)
    # the sampling noise of a split step in units of the step's std (--tree_split_noise_scale; the
    # authors' script sets 4.0); log-probs stay under the step's own std, as in the code
    branch_split_noise_scale: Annotated[float, above(0)] = 4.0
    # tree depths (1 = the first step's children) whose edges do not train (--depth_pruning); [] = none
    branch_depth_pruning: Annotated[list[int], at_least(1)] = field(default_factory=list)
    # a node's reward: mean (of the leaves below; the script's) | prob_weighted (--tree_prob_weighted: the
    # softmax of its children's edge log-probs weighs their rewards)
    branch_node_reward: str = "mean"


@register
class BranchGRPO(FlowGRPO):
    """BranchGRPO: one tree per prompt group, per-depth node advantages, the clipped ratio on every
    edge once. Rescoring is Flow-GRPO's (``FlowGRPO.transition``); the trainer's group advantages are
    not used (the tree's are computed from the minibatch's rewards, which holds whole trees)."""

    name = "branch_grpo"  # rollout, predictions and progress: Flow-GRPO's
    options = (BranchGRPOOptions,)
    per_reward_advantages = False

    def __init__(self, ctx):
        super().__init__(ctx)
        self.unit = self.config.train.group_size  # a minibatch holds whole trees
        self.shape = self.tree_shape(self.config)

    @classmethod
    def tree_shape(cls, config) -> TreeShape:
        t = config.train
        return TreeShape.split_at(config.sampling.num_steps, t.branch_split_points, t.branch_factor,
                                  t.branch_split_noise_scale)

    @classmethod
    def sampler_text(cls, config, prediction: str) -> str:
        t = config.train
        return (f"{super().sampler_text(config, prediction)}; one tree per prompt group: {t.branch_factor} children "
                f"per node at steps {list(t.branch_split_points)} (split noise × {t.branch_split_noise_scale:g}), "
                "each edge trained once")

    @classmethod
    def validate(cls, config) -> list[tuple[str, bool, str]]:
        t, s = config.train, config.sampling
        last = s.num_steps - 1
        points = list(t.branch_split_points)
        rules = [("sampling.eta", s.eta > 0, "must be > 0: branch_grpo trains log-probabilities of SDE steps"),
                 ("train.branch_split_points", bool(points) and len(set(points)) == len(points)
                  and all(0 <= p < last for p in points),
                  f"must be distinct steps in [0, {last}) (the last step is deterministic), got {points}"),
                 ("train.branch_factor", t.branch_factor >= 2, f"must be ≥ 2, got {t.branch_factor}"),
                 ("train.branch_split_noise_scale", t.branch_split_noise_scale > 0,
                  f"must be > 0, got {t.branch_split_noise_scale}"),
                 ("train.branch_depth_pruning", all(1 <= d <= s.num_steps for d in t.branch_depth_pruning),
                  f"must list depths in [1, {s.num_steps}], got {list(t.branch_depth_pruning)}"),
                 ("train.branch_node_reward", t.branch_node_reward in NODE_REWARDS,
                  f"must be one of {', '.join(NODE_REWARDS)}, got {t.branch_node_reward!r}"),
                 ("train.keep_extremes", t.keep_extremes == 0,
                  "must be 0 for branch_grpo: every leaf of a tree feeds its nodes' rewards")]
        if all(ok for _, ok, _ in rules):
            rules += tree_rules(config, cls.tree_shape(config), "method branch_grpo")
            rules.append(("train.branch_depth_pruning", cls.num_terms(config) > 0,
                          "prunes every stochastic step's edges: nothing would train"))
        return rules

    @classmethod
    def term_steps(cls, config) -> list[int]:
        """The stochastic steps whose edges train (not pruned)."""
        s = config.sampling
        plan = plan_steps(s.num_steps, 1, s.eta, s.step_mode, fraction=s.fraction, window_size=s.window_size,
                          window_start=s.window_start if s.window_start is not None else 0)
        pruned = set(config.train.branch_depth_pruning)
        return [j for j in range(s.num_steps) if plan.noise_levels[j] > 0 and j + 1 not in pruned]

    @classmethod
    def num_terms(cls, config) -> int:
        return len(cls.term_steps(config))

    def terms(self, batch) -> list[int]:
        pruned = set(self.config.train.branch_depth_pruning)
        return [j for j in super().terms(batch) if j + 1 not in pruned]

    def edges(self, mb: Minibatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages [b, S] of each row's edges, trained bool [b, S]: the edges each row trains: it
        owns them, the plan trains the step, the depth is not pruned, every leaf of its tree has a reward)."""
        leaves = self.shape.leaves
        trees = len(mb.idx) // leaves
        idx = mb.idx.reshape(trees, leaves)
        if len(mb.idx) % leaves or not bool((idx - idx[:, :1] == torch.arange(leaves, device=idx.device)).all()):
            raise RuntimeError("a branch_grpo minibatch must hold whole trees, leaves in order")
        rewards = mb.rewards.reshape(trees, leaves)
        whole = (mb.valid.reshape(trees, leaves).all(1) & torch.isfinite(rewards).all(1)).repeat_interleave(leaves)
        log_probs = None
        if self.config.train.branch_node_reward == "prob_weighted":
            log_probs = mb.traj.log_probs.reshape(trees, leaves, -1)
        adv = tree_advantages(torch.nan_to_num(rewards), self.shape, self.config.train.advantage_clip, log_probs)
        keep = torch.ones(self.shape.num_steps, dtype=torch.bool, device=whole.device)
        keep[[d - 1 for d in self.config.train.branch_depth_pruning]] = False
        trained = mb.traj.trained & whole[:, None].to(mb.traj.trained.device) & keep.to(mb.traj.trained.device)
        return adv.reshape(trees * leaves, -1), trained

    def loss(self, mb, j):
        t, s = self.config.train, self.config.sampling
        adv, trained = self.edges(mb)
        terms = self.num_terms(self.config)
        total = int(trained[:, self.term_steps(self.config)].sum())
        rows = trained[:, j].nonzero().squeeze(1)
        empty = len(rows) == 0  # nothing trains at this step: one row weighted 0 keeps the graph for backward
        sub = mb.select(rows if not empty else torch.zeros(1, dtype=torch.long, device=trained.device))
        out, ref_mean = self.rescore(sub, j)
        a = adv[rows if not empty else torch.zeros(1, dtype=torch.long), j].to(out.log_prob.device)
        weight = torch.full_like(out.log_prob, 0.0 if empty else 1.0)
        loss, stats = flow_grpo_loss(out.log_prob, sub.traj.log_probs[:, j], a, clip_range=t.clip_range, beta=t.kl_beta,
                                     mean=out.mean, ref_mean=ref_mean, std=out.std, weight=weight,
                                     reduction=s.log_prob_reduction)
        # the mean over the minibatch's E edges: this step's n_j edges weigh n_j / E of it (× the terms, which
        # the trainer's accumulation divides by)
        scale = len(rows) * terms / max(total, 1)
        stats["edges"] = torch.tensor(float(len(rows)))
        return loss * scale, stats
