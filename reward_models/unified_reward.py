"""UnifiedReward-Think as Pref-GRPO's pairwise judge: a vision-language model served by vLLM.

Pref-GRPO (Wang et al., arXiv 2508.20751; github CodeGoat24/Pref-GRPO) asks UnifiedReward-Think
which of two images better follows the caption, for every pair of a prompt's group, and trains on
each image's win rate (``reward_models/pref_grpo.py``). This is that judge as a
``PreferenceModel``, a client of an OpenAI-compatible chat server, as the authors serve it::

    vllm serve CodeGoat24/UnifiedReward-Think-qwen-7b --served-model-name UnifiedReward --port 8080

One request per pair (``pair_workers`` at a time): the caption template, then Image 1 and Image 2
as base64 JPEG (quality 95) data URLs. The verdict is read from the answer as the authors read it
(``cal_win_rate`` in fastvideo/train_flux_pref_grpo.py at commit 6c87cfe, ``_pairwise_win_rate``
in fastvideo/rewards/unifiedreward_think.py at 3e787f6): the text inside ``<answer>…</answer>``;
"Image 1 is better" in it → 1, else "Image 2 is better" → 0, else (or no answer tag) → ½.

Where this differs from their code: a request that still fails after ``retries`` tries scores NaN,
so ``pref_grpo`` leaves that pair out of both images' win rates (their client returns a record
without the pair's indices, on which their counting stops with a KeyError). Their client sends no
sampling settings (the server's defaults; ``temperature`` sends one) and ``max_tokens`` 2048 (4096
at 3e787f6). ``template`` defaults to their Pref-GRPO caption template at 6c87cfe, the paper's;
their later UnifiedReward-Think-qwen3vl-8b uses the longer one in fastvideo/rewards/templates.py.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image

TEMPLATE = (
    'Given a caption and two images generated based on this caption, please analyze in detail '
    'the two provided images. Evaluate them on various dimensions such as semantic consistency '
    '(how closely the image content aligns with the caption), aesthetics (composition, color '
    'usage, artistic expression), authenticity (realism and attention to detail), and any '
    'other factors you deem relevant. For each evaluation dimension, provide a score between '
    '1-10 for both images (e.g., Image 1: 8/10, Image 2: 6/10) and provide a concise rationale '
    'for the score. Calculate the total score for each image by summing all dimension scores. '
    'Use a chain-of-thought process to detail your reasoning steps, and enclose all your '
    'detailed reasoning within <think> and </think> tags. Then, in the <answer> tag, output '
    "exactly one of the following strings: 'Image 1 is better' or 'Image 2 is better' based on "
    'the total scores. No additional text is allowed in the <answer> section.\n'
    '\n'
    'Example output format:\n'
    '<think>\n'
    '1. Semantic consistency: Image 1 (9/10) - ...; Image 2 (7/10) - ...\n'
    '2. Aesthetics: Image 2 (8/10) - ...; Image 1 (8/10) - ...\n'
    '3. Authenticity: Image 1 (8/10) - ...; Image 2 (5/10) - ...\n'
    '[Additional dimensions if any]: Image 2 (8/10) - ...; Image 1 (6/10) - ...\n'
    'Total score:\n'
    'Image 1: 9+8+8+6=31\n'
    'Image 2: 7+8+5+8=28\n'
    '</think>\n'
    '<answer>Image 1 is better</answer>\n'
    '**Note: In the example above, scores and the final answer are placeholders meant only to '
    'demonstrate the format. Your actual evaluation should be based on the quality of two '
    'given images.**\n'
    '\n'
    'Your task is provided as follows:\n'
    'Text Caption: [{prompt}]'
)
BETTER = ("Image 1 is better", "Image 2 is better")


def verdict(output: str, better: tuple[str, str] = BETTER) -> float:
    """P(Image 1 ≻ Image 2) read from the judge's text (module docstring).

    >>> verdict("<think>…</think><answer>Image 2 is better</answer>"), verdict("Image 1 is better")
    (0.0, 0.5)
    """
    match = re.search(r"<answer>(.*?)</answer>", output, re.DOTALL)
    answer = match.group(1).strip() if match else ""
    if answer and better[0] in answer:
        return 1.0
    if answer and better[1] in answer:
        return 0.0
    return 0.5


def jpeg_data_url(image: torch.Tensor, quality: int = 95) -> str:
    """image float [3, H, W] in [0, 1] → "data:image/jpeg;base64,…" (8-bit RGB, JPEG ``quality``)."""
    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


class UnifiedRewardThink:
    """``pref_grpo``'s ``preference``: ``"reward_models.unified_reward:UnifiedRewardThink"`` with
    ``preference_kwargs: {api_url: http://host:8080}``. ``template`` has one ``{prompt}`` field."""

    def __init__(self, api_url: str = "http://localhost:8080", model: str = "UnifiedReward",
                 template: str = TEMPLATE, max_tokens: int = 2048, temperature: float | None = None,
                 pair_workers: int = 16, timeout_s: float = 160.0, retries: int = 10, backoff_s: float = 2.0):
        if "{prompt}" not in template:
            raise ValueError("template must contain a {prompt} field")
        self.url = api_url.rstrip("/") + "/v1/chat/completions"
        self.model, self.template, self.max_tokens, self.temperature = model, template, max_tokens, temperature
        self.pair_workers, self.timeout_s, self.retries, self.backoff_s = pair_workers, timeout_s, retries, backoff_s

    def request(self, image_1: torch.Tensor, image_2: torch.Tensor, prompt: str) -> dict:
        """The chat-completions body for one pair (images float [3, H, W] in [0, 1])."""
        content = [{"type": "image_url", "image_url": {"url": jpeg_data_url(image)}} for image in (image_1, image_2)]
        content.append({"type": "text", "text": self.template.format(prompt=prompt)})
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": self.max_tokens}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    def judge(self, body: dict) -> float:
        """One pair's verdict; NaN when every try failed (the backoff doubles, at most 10 s, as theirs)."""
        data = json.dumps(body).encode()
        for attempt in range(self.retries):
            try:
                req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=self.timeout_s) as response:
                    return verdict(json.loads(response.read())["choices"][0]["message"]["content"])
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                if attempt + 1 < self.retries:
                    time.sleep(min(self.backoff_s * 2**attempt, 10.0))
        return math.nan

    def prefer(self, images_a: torch.Tensor, images_b: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images_a, images_b float [P, 3, H, W] in [0, 1] → P(a ≻ b), float [P] (NaN: no answer)."""
        bodies = [self.request(a, b, p) for a, b, p in zip(images_a, images_b, prompts)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.pair_workers, len(bodies)))) as pool:
            return torch.tensor(list(pool.map(self.judge, bodies)), dtype=torch.float32)
