"""BranchGRPO: per-depth node advantages by hand on a tiny tree and against a transcription of the
authors' TreeNode algorithm on bigger ones; the loss is the mean over the tree's edges, each once
(on-policy: −mean A); a gradient step raises the log-prob of good edges over bad ones; wrong settings
fail before the model loads; a tiny end-to-end run."""

import math

import pytest
import torch

from flowalign.config import ConfigError
from flowalign.objectives.base import Minibatch
from flowalign.objectives.branch_grpo import tree_advantages
from flowalign.samplers.tree import TreeShape
from flowalign.trainer import Trainer
from helpers import tiny_config

# 4 steps, splits at 0 and 1: 4 leaves per tree, group_size 4 (tiny_config: 2 groups, batches of 8)
BRANCH = ("method=branch_grpo", "sampling.sde=dance_grpo", "sampling.eta=0.3", "sampling.shared_group_noise=true",
          "train.branch_split_points=[0,1]", "train.branch_split_noise_scale=4.0", "train.clip_range=1e-3")


def test_advantages_by_hand_on_a_tiny_tree():
    shape = TreeShape.split_at(3, [0, 1])  # depth 1: 2 nodes, depth 2 and 3: the 4 leaves
    adv = tree_advantages(torch.tensor([[1.0, 3.0, 5.0, 9.0]]), shape, clip=5.0)[0]
    a1 = 2.5 / (5 / math.sqrt(2))  # node means 2 and 7: mean 4.5, unbiased std 5/√2
    leaf_std = math.sqrt((3.5**2 + 1.5**2 + 0.5**2 + 4.5**2) / 3)
    expected = torch.tensor([[-a1, -3.5 / leaf_std, -3.5 / leaf_std],
                             [-a1, -1.5 / leaf_std, -1.5 / leaf_std],
                             [a1, 0.5 / leaf_std, 0.5 / leaf_std],
                             [a1, 4.5 / leaf_std, 4.5 / leaf_std]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


def test_a_depth_without_spread_or_with_one_node_has_zero_advantage_and_the_clip_applies():
    shape = TreeShape.split_at(3, [1])  # step 0 into a single node: 0
    adv = tree_advantages(torch.tensor([[2.0, 2.0], [0.0, 1.0]]), shape, clip=0.5)
    assert (adv[:, :, 0] == 0).all() and (adv[0] == 0).all()  # tree 0: equal leaves
    assert adv[1, :, 1].tolist() == [-0.5, 0.5]  # ±1/√2·... = ±0.7071 clipped to ±0.5


class Node:
    """The authors' TreeNode, transcribed: children, a reward, a depth."""

    def __init__(self, depth, parent=None):
        self.depth, self.children, self.reward, self.parent = depth, [], None, parent

    def leaves(self):
        return [self] if not self.children else [x for c in self.children for x in c.leaves()]


def authors_advantages(rewards: list[float], branches: tuple[int, ...], log_probs=None) -> torch.Tensor:
    """compute_node_rewards_from_leaves (mean over leaf descendants, or with log_probs [L, S]
    (use_prob_weighted) bottom-up softmax(children's log_prob)-weighted children's rewards) and
    compute_hierarchical_advantages_by_depth (per depth: (r − mean) / (std + 1e-8), 0 below 1e-6 or
    one node), then each transition takes its child's advantage: [L, S]."""
    root, current = Node(0), None
    current = [root]
    for k in branches:
        nxt = []
        for node in current:
            for _ in range(k):
                child = Node(node.depth + 1, node)
                node.children.append(child)
                nxt.append(child)
        current = nxt
    for leaf, r in zip(current, rewards):
        leaf.reward = torch.tensor(r)
    by_depth, stack = {}, [root]
    while stack:
        node = stack.pop(0)
        by_depth.setdefault(node.depth, []).append(node)
        stack += node.children
    if log_probs is not None:  # each edge's log-prob: its first leaf's entry at the edge's step
        for depth in range(1, len(branches) + 1):
            for node in by_depth[depth]:
                node.log_prob = log_probs[current.index(node.leaves()[0]), depth - 1]
    for depth in reversed(range(len(branches))):
        for node in by_depth[depth]:
            if log_probs is None:
                node.reward = torch.stack([x.reward for x in node.leaves()]).mean()
            elif len(node.children) == 1:
                node.reward = node.children[0].reward
            else:
                w = torch.softmax(1.0 * torch.stack([c.log_prob for c in node.children]), dim=0)
                node.reward = torch.sum(w * torch.stack([c.reward for c in node.children]))
    advantage = {}
    for nodes in by_depth.values():
        if len(nodes) <= 1:
            advantage.update({id(n): torch.tensor(0.0) for n in nodes})
            continue
        r = torch.stack([n.reward for n in nodes])
        a = torch.zeros_like(r) if r.std() < 1e-6 else (r - r.mean()) / (r.std() + 1e-8)
        advantage.update({id(n): a[i] for i, n in enumerate(nodes)})
    out = torch.zeros(len(current), len(branches))
    for ell, leaf in enumerate(current):
        node = leaf
        while node.parent is not None:
            out[ell, node.depth - 1] = advantage[id(node)]
            node = node.parent
    return out.clamp(-5.0, 5.0)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("branches", [(2, 1, 2, 2, 1, 1), (3, 1, 2, 1), (1, 2, 1, 2, 1)])
def test_advantages_equal_the_authors_tree_algorithm(branches, weighted):
    shape = TreeShape(branches)
    g = torch.Generator().manual_seed(len(branches))
    rewards = torch.rand(3, shape.leaves, generator=g)
    rewards[2, : shape.leaves // 2] = 0.25  # some nodes tie
    log_probs = None
    if weighted:  # per node, like a rollout's: every leaf below an edge carries its log-prob
        per_node = [torch.randn(3, shape.nodes_at(i + 1), generator=g) for i in range(len(branches))]
        log_probs = torch.stack([shape.to_leaves(per_node[i], i + 1) for i in range(len(branches))], dim=2)
    ours = tree_advantages(rewards, shape, clip=5.0, log_probs=log_probs)
    for t in range(3):
        theirs = authors_advantages(rewards[t].tolist(), branches, None if log_probs is None else log_probs[t])
        torch.testing.assert_close(ours[t], theirs, rtol=0, atol=1e-5)
    if weighted and branches != (1, 2, 1, 2, 1):  # there, two nodes a depth: ±1/√2 whatever their rewards
        assert not torch.allclose(ours, tree_advantages(rewards, shape, clip=5.0))  # the weighting matters


def _epoch(tmp_path, tiny_sd3_dir, *extra):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *BRANCH, *extra))
    batch = trainer.sample_epoch()
    advantages, _ = trainer.compute_advantages(batch)
    idx = torch.arange(8)
    mb = Minibatch.of(batch, idx, torch.nan_to_num(advantages), torch.isfinite(advantages))
    return trainer, batch, mb


def test_on_policy_the_loss_is_minus_the_mean_advantage_over_the_edges_each_once(tiny_sd3_dir, tmp_path):
    trainer, batch, mb = _epoch(tmp_path, tiny_sd3_dir)
    obj = trainer.objective
    shape = obj.shape
    assert shape.branches == (2, 2, 1, 1) and type(obj).__name__ == "BranchGRPO"
    terms = obj.terms(batch)
    assert terms == [0, 1, 2]
    adv, trained = obj.edges(mb)
    assert trained[:, :3].sum(0).tolist() == [4, 8, 8]  # 2 trees × (2, 4, 4) edges
    by_hand = tree_advantages(mb.rewards.reshape(2, 4), shape, 5.0).reshape(8, 4)
    torch.testing.assert_close(adv, by_hand)
    total, ratio = 0.0, []
    for j in terms:
        loss, stats = obj.loss(mb, j)
        total += float(loss.detach()) / len(terms)  # what Accelerate's accumulation sums
        ratio.append(float(stats["ratio"]))
    expected = -(adv[:, :3] * trained[:, :3]).sum() / trained[:, :3].sum()
    assert total == pytest.approx(float(expected), abs=1e-4)
    assert ratio == pytest.approx([1.0] * 3, abs=1e-4)  # each edge rescored under the sampling weights


def test_a_gradient_step_raises_good_edges_over_bad_ones(tiny_sd3_dir, tmp_path):
    trainer, batch, mb = _epoch(tmp_path, tiny_sd3_dir, "train.clip_range=10")  # no clipping: the pure gradient
    obj = trainer.objective
    adv, trained = obj.edges(mb)
    assert (adv * trained).abs().sum() > 0
    before = [obj.transition(mb, j, "ref").log_prob for j in range(3)]
    for j in range(3):
        obj.loss(mb, j)[0].backward()
    with torch.no_grad():
        for p in trainer.params:
            if p.grad is not None:
                p -= 1e-2 * p.grad  # plain gradient descent on the surrogate
    after = [obj.transition(mb, j).log_prob.detach() for j in range(3)]
    gain = sum(((a - b) * adv[:, j] * trained[:, j]).sum() for j, (a, b) in enumerate(zip(after, before)))
    assert float(gain) > 0  # Σ_e A_e·Δlog p_e: good edges up, bad ones down


@pytest.mark.parametrize("override,key", [("train.group_size=8", "train.group_size"),
                                          ("train.branch_split_points=[0,3]", "train.branch_split_points"),
                                          ("sampling.shared_group_noise=false", "sampling.shared_group_noise"),
                                          ("train.keep_extremes=1", "train.keep_extremes"),
                                          ("train.branch_node_reward=max", "train.branch_node_reward"),
                                          ("train.branch_depth_pruning=[1,2,3]", "train.branch_depth_pruning")])
def test_wrong_settings_fail_before_the_model_loads(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Trainer(tiny_config(tmp_path / "no-model-here", tmp_path, *BRANCH, override))


def test_branch_grpo_trains_end_to_end_with_depth_pruning(tiny_sd3_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, *BRANCH, "train.branch_depth_pruning=[3]",
                                  "train.branch_node_reward=prob_weighted"))
    start = [p.detach().clone() for p in trainer.params]
    trainer.train()
    assert len(trainer.history) == 2 and all(h["train/grad_norm"] > 0 for h in trainer.history)
    assert trainer.objective.terms(trainer.sample_epoch()) == [0, 1]  # depth 3 = step 2's edges: pruned
    assert any(not torch.equal(a, p) for a, p in zip(start, trainer.params))
    assert math.isfinite(trainer.history[-1]["train/policy_loss"])
