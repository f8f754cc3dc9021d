"""The shape of a tree rollout: which steps branch and into how many children (pure index
arithmetic; ``flowalign.rollout.tree_rollout`` samples it).

A tree has S steps and one root (the group's shared initial noise, latent depth 0). Step i takes
every node at depth i to ``branches[i]`` children at depth i + 1 (1: the step does not branch, the
node goes on alone), so depth d holds N_d = Π_{i<d} branches[i] nodes and the tree has
L = N_S leaves, one rollout each. A node at depth d is an ancestor of Lb_d = Π_{i≥d} branches[i]
leaves; with the leaves numbered depth-first (a node's children in order, each one's leaves
contiguous), leaf ℓ passes through node ⌊ℓ / Lb_d⌋ of depth d. Step i's edge into leaf ℓ's node at
depth i + 1 is shared by the Lb_{i+1} leaves below that node; its *owner* is the first of them
(ℓ mod Lb_{i+1} = 0), which trains it once. A tree whose branches are all 1 is a plain rollout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    """branches: children per node at each of the S steps (1 = no split); split_noise_scale: the
    sampling noise of a branching step is this multiple of the step's std (BranchGRPO's
    ``tree_split_noise_scale``); its log-prob stays the density under the step's own std, as the
    rescoring computes it."""

    branches: tuple[int, ...]
    split_noise_scale: float = 1.0

    def __post_init__(self):
        if not self.branches or any(int(k) < 1 for k in self.branches):
            raise ValueError(f"a tree needs ≥ 1 step and branches ≥ 1 per step, got {list(self.branches)}")
        if not self.split_noise_scale > 0:
            raise ValueError(f"split_noise_scale must be > 0, got {self.split_noise_scale}")

    @classmethod
    def split_at(cls, num_steps: int, points, factor: int = 2, split_noise_scale: float = 1.0) -> "TreeShape":
        """``factor`` children at each step in ``points`` (distinct, in [0, num_steps)), 1 elsewhere."""
        points = [int(p) for p in points]
        if len(set(points)) != len(points) or any(not 0 <= p < num_steps for p in points):
            raise ValueError(f"split points must be distinct steps in [0, {num_steps}), got {points}")
        return cls(tuple(factor if i in points else 1 for i in range(num_steps)), split_noise_scale)

    @property
    def num_steps(self) -> int:
        return len(self.branches)

    @property
    def leaves(self) -> int:
        return math.prod(self.branches)

    @property
    def split_steps(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.branches) if k > 1)

    def nodes_at(self, depth: int) -> int:
        """N_d: the tree's nodes at latent depth d (0 = the root, S = the leaves)."""
        return math.prod(self.branches[:depth])

    def leaves_below(self, depth: int) -> int:
        """Lb_d: the leaves under each node at depth d."""
        return math.prod(self.branches[depth:])

    def edge_owner(self) -> torch.Tensor:
        """bool [L, S]: leaf ℓ owns step i's edge (it is the first leaf below the edge's child)."""
        leaf = torch.arange(self.leaves)
        return torch.stack([leaf % self.leaves_below(i + 1) == 0 for i in range(self.num_steps)], dim=1)

    def node_means(self, values: torch.Tensor, depth: int) -> torch.Tensor:
        """values [T, L] per leaf of T trees → [T, N_d]: each depth-d node's mean over its leaves."""
        return values.reshape(values.shape[0], self.nodes_at(depth), self.leaves_below(depth)).mean(-1)

    def to_leaves(self, node_values: torch.Tensor, depth: int) -> torch.Tensor:
        """[T, N_d, ...] per node → [T, L, ...]: each leaf gets its depth-d ancestor's value."""
        return node_values.repeat_interleave(self.leaves_below(depth), dim=1)
