"""The shapes world's pairwise judge for Pref-GRPO: which of two images better follows the prompt.

Like Pref-GRPO's judge (UnifiedReward-Think), it sees two images and their prompt, nothing else:
the prompt's spec is looked up among the shapes world's prompts. It reads each image with the
shapes verifier (``reward_models/shapes.py``) and compares one component, ``score`` by default,
the fraction of the GenEval-style checks that pass (one per include item, "nothing extra", one per
relation):

    P(a ≻ b) = 1 if s_a > s_b,   ½ if s_a = s_b,   0 if s_a < s_b

Why this judge: UnifiedReward-Think is told to score each image on each dimension, sum the
scores and name the image with the higher total; here the dimensions are the verifier's checks,
so the total is ``score`` times the number of checks. A tie counts ½ for each image, as the
authors' code counts an answer that names neither image (``_pairwise_win_rate`` in
fastvideo/rewards/unifiedreward_think.py). Their judge must name one image, so its ties are
rare; ``score`` ties often (a group's images pass the same checks), and a tie teaches nothing.
``criterion="soft_score"`` (the relaxed checks) leaves almost no ties. The judge is exact and
noise-free, so what a benchmark measures is the win-rate advantage, not a judge's errors (a
learned pairwise model would add its own).

One verdict needs two verifier reads; ``pref_win_rate`` with ``base: shapes``, ``component:
score``, ``temperature: 0`` reaches the same win rates from one read per sample (the tests check
that they agree), and configs/shapes_pref_grpo.yaml uses it.

    reward.name=pref_grpo 'reward.kwargs={preference: "reward_models.shapes_judge:ShapesJudge"}'
        'reward.weights={win_rate: 1.0}' 'eval.extra_rewards=[shapes]'
"""

from __future__ import annotations

import torch

from reward_models.pref_grpo import bradley_terry
from reward_models.shapes import ShapesVerifier
from reward_models.worlds.shapes import prompt_split


class ShapesJudge:
    """A ``PreferenceModel`` (``reward_models.pref_grpo``) on the shapes world.

    >>> import random, numpy as np
    >>> from reward_models.worlds.shapes import render_scene
    >>> spec = prompt_split("test")[0]
    >>> good = torch.from_numpy(np.array(render_scene(spec, random.Random(0)))).permute(2, 0, 1)[None] / 255
    >>> blank = torch.full_like(good, 245 / 255)
    >>> ShapesJudge().prefer(torch.cat([good, blank]), torch.cat([blank, blank]), [spec["prompt"]] * 2).tolist()
    [1.0, 0.5]
    """

    def __init__(self, criterion: str = "score", min_area: int = 10):
        self.verifier = ShapesVerifier(min_area)
        if criterion not in self.verifier.components:
            raise ValueError(f"criterion must be one of {list(self.verifier.components)}, got {criterion!r}")
        self.criterion = criterion
        self.specs = {spec["prompt"]: spec for spec in prompt_split("all")}

    def scores(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images float [P, 3, H, W] in [0, 1] → the verifier's ``criterion``, float [P]."""
        unknown = sorted({p for p in prompts if p not in self.specs})
        if unknown:
            raise ValueError(f"not a shapes-world prompt: {unknown[0]!r}")
        return self.verifier(images, prompts, [self.specs[p] for p in prompts])[self.criterion]

    def prefer(self, images_a: torch.Tensor, images_b: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """P(a ≻ b), float [P] in {0, ½, 1} (module docstring)."""
        return bradley_terry(self.scores(images_a, prompts), self.scores(images_b, prompts), temperature=0)
