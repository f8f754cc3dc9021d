"""Pref-GRPO: win rates from a pairwise judge, checked against the authors' counting and
advantages (CodeGoat24/Pref-GRPO at 6c87cfe, fastvideo/train_flux_pref_grpo.py: ``cal_win_rate``
and the ``use_group`` advantages; unchanged at 3e787f6 in fastvideo/rewards/unifiedreward_think.py
and dispatcher.py), the shapes world's judge, the recipes and a run through the trainer."""

from __future__ import annotations

import base64
import io
import itertools
import json
import math
import random
import re
import threading
from collections import defaultdict
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.advantages import group_advantages
from flowalign.config import load_config
from flowalign.trainer import Trainer
from helpers import tiny_config
from reward_models.base import build_reward
from reward_models.pref_grpo import PrefGRPO, bradley_terry, group_win_rates
from reward_models.shapes_judge import ShapesJudge
from reward_models.unified_reward import TEMPLATE, UnifiedRewardThink, verdict
from reward_models.worlds.shapes import BACKGROUND, prompt_split, render_scene

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# ------------------------------------------------------------------ the authors' code, as a reference


def authors_win_rates(n: int, outputs: dict[tuple[int, int], str]) -> list[float]:
    """Their ``cal_win_rate``: every pair (i < j) counts once for both; the answer naming Image 1
    gives i a win, Image 2 gives j one, anything else ½ each; win rate = wins / comparisons,
    rounded to 3 decimals (0 for an image never compared)."""
    win, count = defaultdict(float), defaultdict(int)
    for (i, j), output in outputs.items():
        count[i] += 1
        count[j] += 1
        match = re.search(r"<answer>(.*?)</answer>", output, re.DOTALL)
        answer = match.group(1).strip() if match else None
        if answer and "Image 1 is better" in answer:
            win[i] += 1
        elif answer and "Image 2 is better" in answer:
            win[j] += 1
        else:
            win[i] += 0.5
            win[j] += 0.5
    return [round(win[k] / count[k], 3) if count[k] else 0.0 for k in range(n)]


def authors_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Their ``use_group`` advantages: (r − group mean) / (torch's unbiased group std + 1e-8), then
    clamped to ±adv_clip_max (5) in the loss."""
    adv = torch.zeros_like(rewards)
    for lo in range(0, len(rewards), group_size):
        r = rewards[lo:lo + group_size]
        adv[lo:lo + group_size] = (r - r.mean()) / (r.std() + 1e-8)
    return adv.clamp(-5, 5)


# ------------------------------------------------------------------ a judge behind an HTTP server


def brightness_of(url: str) -> float:
    data = base64.b64decode(url.split(",", 1)[1])
    return float(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32).mean() / 255)


class JudgeServer:
    """An OpenAI-compatible chat server that judges like UnifiedReward-Think would be asked to:
    the brighter image is better; within 0.05 it answers naming neither (a tie). ``fail``: answer
    HTTP 500 to every request. Records every request body."""

    def __init__(self, fail: bool = False):
        self.bodies, server = [], self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append((self.path, body))
                if fail:
                    self.send_response(500)
                    self.end_headers()
                    return
                content = body["messages"][0]["content"]
                b1, b2 = (brightness_of(c["image_url"]["url"]) for c in content[:2])
                answer = "Both are equally good" if abs(b1 - b2) < 0.05 else f"Image {1 if b1 > b2 else 2} is better"
                reply = json.dumps({"choices": [{"message": {"content": f"<think>…</think>\n<answer>{answer}</answer>"}}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply.encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def grey(levels: list[float]) -> torch.Tensor:
    return torch.tensor(levels)[:, None, None, None].expand(-1, 3, 16, 16).contiguous()


# ------------------------------------------------------------------ win rates and advantages


def test_a_hand_computed_group_through_the_judge_matches_the_authors():
    """Four images, brightness 0.9, 0.5, 0.52, 0.1: image 0 beats everyone, 1 and 2 tie, both beat
    3. Win rates by hand: 0: 3/3 = 1; 1 and 2: (1 + ½) / 3 = ½; 3: 0. Advantages by hand: mean ½,
    deviations ±½, 0, 0; their unbiased std sqrt(0.5 / 3) gives ±sqrt(1.5) = ±1.2247; our population
    std sqrt(0.5 / 4) gives ±sqrt(2) = ±1.4142 (eps 1e-4 aside): theirs × sqrt(G / (G − 1))."""
    server = JudgeServer()
    try:
        judge = UnifiedRewardThink(api_url=server.url, pair_workers=4, retries=1)
        reward = build_reward("pref_grpo", preference=judge, group_size=4)
        images, prompts = grey([0.9, 0.5, 0.52, 0.1]), ["a cat"] * 4
        win = reward(images, prompts, [{}] * 4)["win_rate"]
    finally:
        server.close()
    torch.testing.assert_close(win, torch.tensor([1.0, 0.5, 0.5, 0.0]))

    # what the judge was asked: six pairs (no image against itself), each Image 1, Image 2, then the
    # template with the caption, as the authors' client sends it
    assert len(server.bodies) == 6 == math.comb(4, 2)
    path, body = server.bodies[0]
    assert path == "/v1/chat/completions" and body["model"] == "UnifiedReward" and body["max_tokens"] == 2048
    content = body["messages"][0]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url", "text"]
    assert content[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert content[2]["text"] == TEMPLATE.format(prompt="a cat") and content[2]["text"].endswith("[a cat]")
    assert "temperature" not in body  # theirs sends no sampling settings

    # the authors' counting on the same answers gives the same win rates
    answers = {(i, j): f"<answer>{'Image 1 is better' if a - b >= 0.05 else 'Image 2 is better' if b - a >= 0.05 else 'tie'}</answer>"
               for (i, a), (j, b) in itertools.combinations(enumerate([0.9, 0.5, 0.52, 0.1]), 2)}
    assert authors_win_rates(4, answers) == win.tolist()

    theirs = authors_advantages(win, 4)
    torch.testing.assert_close(theirs, torch.tensor([math.sqrt(1.5), 0.0, 0.0, -math.sqrt(1.5)]))
    ours, _ = group_advantages(win, torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(ours, torch.tensor([math.sqrt(2), 0.0, 0.0, -math.sqrt(2)]), rtol=1e-3, atol=0)
    torch.testing.assert_close(ours, theirs * math.sqrt(4 / 3), rtol=1e-3, atol=0)


def test_the_advantage_factor_against_theirs_on_groups_of_eight():
    """Random judged groups of their size (8): win rates equal their counting (up to their rounding
    to 3 decimals) and our advantages are theirs × sqrt(8 / 7) (eps 1e-4 vs 1e-8 aside). The clamp
    at 5 binds in neither: |A| ≤ sqrt(G − 1) = 2.65 with the population std."""
    g, n = 8, 6
    gen = torch.Generator().manual_seed(0)
    answers = [{pair: f"<answer>Image {torch.randint(1, 3, (), generator=gen).item()} is better</answer>"
                if torch.rand((), generator=gen) < 0.8 else "no answer" for pair in itertools.combinations(range(g), 2)}
               for _ in range(n)]
    prob = torch.full((g * n, g * n), float("nan"))
    for k, group in enumerate(answers):
        for (i, j), output in group.items():
            prob[k * g + i, k * g + j] = verdict(output)
            prob[k * g + j, k * g + i] = 1 - verdict(output)
    groups = torch.arange(g * n) // g
    win = group_win_rates(prob, groups)
    theirs_win = torch.tensor([w for group in answers for w in authors_win_rates(g, group)])
    torch.testing.assert_close(win, theirs_win, rtol=0, atol=5e-4)  # their round(·, 3)
    torch.testing.assert_close(win.view(n, g).sum(1), torch.full((n,), g / 2))  # every game shared out
    ours, _ = group_advantages(win, groups)
    theirs = authors_advantages(win, g)
    torch.testing.assert_close(ours, theirs * math.sqrt(g / (g - 1)), rtol=1e-3, atol=1e-6)
    assert ours.abs().max() <= math.sqrt(g - 1)


def test_self_comparisons_are_excluded_and_ties_count_half():
    # a ≻ b in a group of two: [1, 0]; counting the self-tie would give [0.75, 0.25]
    prob = bradley_terry(torch.tensor([2.0, 1.0])[:, None], torch.tensor([2.0, 1.0])[None, :], temperature=0)
    torch.testing.assert_close(group_win_rates(prob, torch.zeros(2, dtype=torch.long)), torch.tensor([1.0, 0.0]))
    # an all-tied group: ½ each, zero spread, zero advantages (no gradient)
    prob = bradley_terry(torch.ones(3)[:, None], torch.ones(3)[None, :], temperature=0)
    win = group_win_rates(prob, torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(win, torch.full((3,), 0.5))
    assert group_advantages(win, torch.zeros(3, dtype=torch.long))[0].abs().max() == 0


def test_a_failed_request_leaves_the_pair_out():
    server = JudgeServer(fail=True)
    try:
        judge = UnifiedRewardThink(api_url=server.url, retries=2, backoff_s=0.01)
        p = judge.prefer(grey([0.9]), grey([0.1]), ["a cat"])
    finally:
        server.close()
    assert torch.isnan(p).all() and len(server.bodies) == 2  # tried twice, then NaN
    prob = torch.tensor([[float("nan"), float("nan"), 1.0], [float("nan"), float("nan"), 1.0], [0.0, 0.0, float("nan")]])
    torch.testing.assert_close(group_win_rates(prob, torch.zeros(3, dtype=torch.long)), torch.tensor([1.0, 1.0, 0.0]))


def test_win_rates_are_invariant_to_a_monotone_transform_of_the_score():
    """The paper's point: a hard judge's win rates depend on the order of the underlying scores
    only, so any strictly increasing transform leaves them (and the advantages) unchanged, while
    Flow-GRPO's normalised scores change with it."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 5, (24,), generator=gen).float() / 4  # ties, like a partial score
    groups = torch.arange(24) // 8

    def win(s):
        return group_win_rates(bradley_terry(s[:, None], s[None, :], temperature=0), groups)

    for transform in (lambda s: torch.exp(5 * s) - 3, lambda s: s**3 + 1e-3 * s, lambda s: 100 * s + 7):
        torch.testing.assert_close(win(transform(scores)), win(scores), rtol=0, atol=0)
    direct, _ = group_advantages(scores, groups)
    bent, _ = group_advantages(torch.exp(5 * scores), groups)
    assert (direct - bent).abs().max() > 0.1  # the pointwise advantage is not invariant


# ------------------------------------------------------------------ the shapes judge


def shapes_image(spec: dict, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.array(render_scene(spec, random.Random(seed)))).permute(2, 0, 1).float() / 255


def test_the_shapes_judge_compares_partial_scores_and_agrees_with_the_one_read_path():
    """Per two-object prompt a group of four: the scene (score 1), the scene drawn a second time
    (1), its first object alone (include[0] passes; include[1] and "nothing extra" fail: 1/3) and
    a blank image (0). Win rates by hand: (1 + 1 + ½) / 3 = 5/6 for each scene, 1/3, 0."""
    specs = [s for s in prompt_split("all", ("two_object",))][:3]
    images, prompts, metadata = [], [], []
    for k, spec in enumerate(specs):
        alone = {**spec, "include": spec["include"][:1]}
        blank = torch.tensor(BACKGROUND, dtype=torch.float32)[:, None, None].expand(3, 32, 32) / 255
        images += [shapes_image(spec, k), shapes_image(spec, 100 + k), shapes_image(alone, k), blank]
        prompts += [spec["prompt"]] * 4
        metadata += [spec] * 4
    images = torch.stack(images)
    judge = ShapesJudge()
    torch.testing.assert_close(judge.scores(images, prompts), torch.tensor([1.0, 1.0, 1 / 3, 0.0] * 3))

    pairwise = PrefGRPO(judge, group_size=4)(images, prompts, metadata)["win_rate"]
    torch.testing.assert_close(pairwise, torch.tensor([5 / 6, 5 / 6, 1 / 3, 0.0] * 3))
    one_read = build_reward("pref_win_rate", base="shapes", component="score", temperature=0, group_size=4)
    out = one_read(images, prompts, metadata)
    torch.testing.assert_close(out["win_rate"], pairwise)
    assert set(out) == {"win_rate", "accuracy", "score", "soft_score"}  # the held-out accuracy is reported

    with pytest.raises(ValueError, match="not a shapes-world prompt"):
        judge.prefer(images[:1], images[:1], ["a photo of a dragon"])
    with pytest.raises(ValueError, match="criterion"):
        ShapesJudge("colour")


# ------------------------------------------------------------------ recipes and a run


def test_the_shapes_recipe_is_flow_grpos_with_the_win_rate_reward():
    ours, base = load_config(CONFIGS / "shapes_pref_grpo.yaml"), load_config(CONFIGS / "shapes_flow_grpo.yaml")
    assert ours.method == "flow_grpo" and ours.reward.name == "pref_win_rate"
    assert ours.reward.kwargs == {"base": "shapes", "component": "score", "temperature": 0}
    assert ours.reward.weights == {"win_rate": 1.0} and base.reward.weights == {"score": 1.0}
    assert ours.train.sample_batch_size % ours.train.group_size == 0  # no group split across reward calls
    mine, theirs = asdict(ours), asdict(base)
    for d in (mine, theirs):
        d.pop("output_dir"), d.pop("reward"), d.pop("sources")
    assert mine == theirs


def test_the_flux_recipe_carries_the_authors_settings():
    c = load_config(CONFIGS / "flux_dev_pref_grpo_unifiedreward.yaml")
    assert c.method == "dance_grpo" and c.sampling.sde == "dance_grpo" and c.sampling.eta == 0.7
    assert (c.sampling.num_steps, c.sampling.fraction, c.train.group_size) == (25, 0.6, 8)
    assert c.reward.weights == {"pref_grpo": 0.7, "clip_score": 1.4} and c.train.per_reward_advantages
    pref = c.reward.kwargs["rewards"]["pref_grpo"]["kwargs"]
    assert pref["preference"] == "reward_models.unified_reward:UnifiedRewardThink"
    assert c.train.sample_batch_size % c.train.group_size == 0
    assert (c.train.clip_range, c.train.advantage_clip, c.train.kl_beta, c.train.learning_rate) == (1e-4, 5.0, 0.0, 1e-5)


def test_pref_grpo_trains_through_the_trainer(tiny_sd3_dir, tmp_path):
    """Two epochs of the tiny model on the win rate of the verifier's soft score (the untrained
    model's images pass no strict check, so ``score`` would tie everywhere): every group's win
    rates sum to G / 2, so the logged mean win rate is exactly ½, and the policy moves."""
    trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path, "reward.name=pref_win_rate",
                                  "reward.kwargs={base: shapes, component: soft_score, temperature: 0}",
                                  "reward.weights={win_rate: 1.0}"))
    summary = trainer.train()
    assert len(trainer.history) == 2
    for h in trainer.history:
        assert h["reward/win_rate"] == pytest.approx(0.5, abs=1e-6)
        assert h["train/grad_norm"] > 0
        assert h["adv/zero_spread_groups"] < 1
    assert all("accuracy" in result for result in summary["evals"].values())
