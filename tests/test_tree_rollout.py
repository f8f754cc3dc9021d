"""Tree rollouts (flowalign/samplers/tree.py, flowalign.rollout.tree_rollout): a tree with one branch
is a plain rollout to the last digit, log-probs included; leaves share their prefixes exactly and
differ after a split; the model runs once per node; every stored log-prob is what rescoring the edge
gives (on-policy ratio 1), the split noise scale included; each edge is trained once; the epoch
sampler builds a tree only when the objective asks for one."""

import pytest
import torch

from flowalign.config import load_config
from flowalign.objectives.base import check, tree_rules
from flowalign.rollout import rollout, transition, tree_rollout
from flowalign.samplers.steps import StepPlan, plan_steps
from flowalign.samplers.tree import TreeShape

PROMPTS = ["a photo of a red circle", "a photo of two squares"]


class Counting:
    """The adapter, counting the rows its model predicts."""

    def __init__(self, adapter):
        self.adapter, self.rows = adapter, 0

    def __getattr__(self, name):
        return getattr(self.adapter, name)

    def predict(self, x, *args, **kwargs):
        self.rows += len(x)
        return self.adapter.predict(x, *args, **kwargs)


def test_shape_arithmetic_by_hand():
    shape = TreeShape.split_at(5, [0, 2], factor=2)
    assert shape.branches == (2, 1, 2, 1, 1) and shape.leaves == 4 and shape.split_steps == (0, 2)
    assert [shape.nodes_at(d) for d in range(6)] == [1, 2, 2, 4, 4, 4]
    assert [shape.leaves_below(d) for d in range(6)] == [4, 2, 2, 1, 1, 1]
    owner = shape.edge_owner()  # step 0 and 1: edges into 2 nodes (leaves 0 and 2 own them); then every leaf
    assert owner.tolist() == [[True] * 5, [False, False, True, True, True], [True] * 5, [False, False, True, True, True]]
    values = torch.tensor([[1.0, 3.0, 5.0, 7.0]])
    assert shape.node_means(values, 1).tolist() == [[2.0, 6.0]] and shape.node_means(values, 0).tolist() == [[4.0]]
    assert shape.to_leaves(torch.tensor([[2.0, 6.0]]), 1).tolist() == [[2.0, 2.0, 6.0, 6.0]]
    with pytest.raises(ValueError, match="distinct steps"):
        TreeShape.split_at(4, [1, 4])


@pytest.mark.parametrize("sde", ["flow_grpo", "dance_grpo"])
def test_a_tree_with_one_branch_is_a_plain_rollout_to_the_last_digit(tiny_adapter, sde):
    cond = tiny_adapter.encode(PROMPTS)
    noise = tiny_adapter.initial_noise(2, torch.Generator().manual_seed(1))
    schedule, plan = tiny_adapter.schedule(4), plan_steps(4, 2, 0.7, "fraction", generator=torch.Generator().manual_seed(3))
    plain = rollout(tiny_adapter, cond, noise, schedule, plan, generator=torch.Generator().manual_seed(2), sde=sde)
    tree = tree_rollout(tiny_adapter, cond, noise, schedule, plan, TreeShape((1, 1, 1, 1), split_noise_scale=4.0),
                        generator=torch.Generator().manual_seed(2), sde=sde)
    assert torch.equal(tree.latents, plain.latents) and torch.equal(tree.log_probs, plain.log_probs)
    assert torch.equal(tree.trained, plain.trained) and torch.equal(tree.noise_levels, plain.noise_levels)
    assert (plain.log_probs[:, :3] != 0).all()  # the comparison covers real log-densities


def _tree(adapter, shape, eta=1.0, sde="flow_grpo", seed=2):
    cond = adapter.encode(PROMPTS).repeat_interleave(shape.leaves)
    roots = adapter.initial_noise(2, torch.Generator().manual_seed(1))
    schedule = adapter.schedule(shape.num_steps)
    plan = plan_steps(shape.num_steps, 2 * shape.leaves, eta)
    return tree_rollout(adapter, cond, roots, schedule, plan, shape, generator=torch.Generator().manual_seed(seed),
                        sde=sde), roots, cond


def test_leaves_share_their_prefix_exactly_and_differ_after_each_split(tiny_adapter):
    shape = TreeShape.split_at(5, [0, 2])  # 4 leaves per tree
    traj, roots, _ = _tree(tiny_adapter, shape)
    lat = traj.latents.reshape(2, 4, 6, *traj.latents.shape[2:])
    assert torch.equal(lat[:, :, 0], roots[:, None].expand_as(lat[:, :, 0]))  # the root: the group's noise
    for d in range(1, 6):
        size = shape.leaves_below(d)
        for first in range(0, 4, size):  # leaves under one node: equal latents (and log-probs of its edge)
            block = lat[:, first:first + size, d]
            assert torch.equal(block, block[:, :1].expand_as(block))
            lp = traj.log_probs.reshape(2, 4, 5)[:, first:first + size, d - 1]
            assert torch.equal(lp, lp[:, :1].expand_as(lp))
    assert not torch.equal(lat[:, 0, 1], lat[:, 2, 1]) and not torch.equal(lat[:, 0, 3], lat[:, 1, 3])
    assert not torch.equal(lat[0, 0, 1], lat[1, 0, 1])  # two trees are two prompts


def test_the_model_runs_once_per_node(tiny_adapter):
    shape = TreeShape.split_at(5, [0, 2])
    counting = Counting(tiny_adapter)
    _tree(counting, shape)
    assert counting.rows == 2 * sum(shape.nodes_at(d) for d in range(5)) == 2 * (1 + 2 + 2 + 4 + 4)  # not 2·4·5


@pytest.mark.parametrize("sde,scale", [("flow_grpo", 1.0), ("dance_grpo", 4.0)])
def test_every_stored_log_prob_is_the_rescored_edge(tiny_adapter, sde, scale):
    """Rescoring each leaf's recorded step under the same weights gives its stored log-prob (ratio 1),
    also at split steps sampled with a scaled noise: the density is under the step's own std."""
    shape = TreeShape.split_at(4, [0, 1], split_noise_scale=scale)
    traj, _, cond = _tree(tiny_adapter, shape, eta=0.6, sde=sde)
    for j in range(3):
        out = transition(tiny_adapter, traj.latents[:, j], j, traj.schedule, 0.6, cond, 1.0, sde=sde,
                         prev_sample=traj.latents[:, j + 1])
        torch.testing.assert_close(out.log_prob, traj.log_probs[:, j], rtol=0, atol=1e-5)
    assert (traj.log_probs[:, 3] == 0).all()  # the last step: deterministic


def test_the_split_noise_scale_widens_the_children_only_at_split_steps(tiny_adapter):
    shape = TreeShape.split_at(4, [1])
    base, _, _ = _tree(tiny_adapter, shape, eta=0.5)
    wide, _, _ = _tree(tiny_adapter, TreeShape(shape.branches, split_noise_scale=3.0), eta=0.5)
    assert torch.equal(wide.latents[:, :2], base.latents[:, :2])  # before the split: the same draws
    mean = transition(tiny_adapter, base.latents[:, 1], 1, base.schedule, 0.5, _tree(tiny_adapter, shape)[2], 1.0,
                      noise=torch.zeros_like(base.latents[:, 1])).mean
    torch.testing.assert_close(wide.latents[:, 2] - mean, 3.0 * (base.latents[:, 2] - mean), rtol=1e-4, atol=1e-5)


def test_each_edge_trains_once(tiny_adapter):
    shape = TreeShape.split_at(4, [0, 2])
    traj, _, _ = _tree(tiny_adapter, shape)
    per_step = traj.trained.reshape(2, 4, 4).sum(1)[0].tolist()
    assert per_step == [2, 2, 4, 0]  # edges into depth 1, 2, 3 nodes; the last step is deterministic
    plan = StepPlan(torch.ones(4), torch.ones(8, 4, dtype=torch.bool))
    plan.noise_levels[1] = 0.0
    with pytest.raises(ValueError, match="step 0 branches"):
        tree_rollout(tiny_adapter, tiny_adapter.encode(PROMPTS).repeat_interleave(2), torch.zeros(2, 4, 8, 8),
                     tiny_adapter.schedule(4), StepPlan(torch.tensor([0.0, 1.0, 1.0, 0.0]), plan.trained[:4]),
                     TreeShape.split_at(4, [0]))


def test_tree_rules_name_the_key():
    shape = TreeShape.split_at(4, [0, 1])
    ok = load_config(None, ["sampling.step_mode=window", "sampling.window_size=2", "sampling.window_start=0",
                            "train.group_size=4", "sampling.shared_group_noise=true", "train.sample_batch_size=8",
                            "train.train_batch_size=8", "sampling.num_steps=4"])
    check(tree_rules(ok, shape, "a test"))
    for override, key in [("train.group_size=8", "train.group_size"),
                          ("sampling.shared_group_noise=false", "sampling.shared_group_noise"),
                          ("train.sample_batch_size=6", "train.sample_batch_size"),
                          ("sampling.window_start=2", "sampling.eta")]:
        bad = load_config(None, ["train.group_size=4", "sampling.shared_group_noise=true", "train.sample_batch_size=8",
                                 "train.train_batch_size=8", "sampling.num_steps=4", "sampling.step_mode=window",
                                 "sampling.window_size=1", override])
        rules = [r for r in tree_rules(bad, shape, "a test") if not r[1]]
        assert rules and rules[0][0] == key, override
