"""OCR reward (Flow-GRPO): how well the text in the image matches the prompt's quoted text.

The target is the first double-quoted part of the prompt (``'a sign that says "OPEN"'`` → ``OPEN``).
Both strings are lower-cased with all whitespace removed; reward = 1 when the target occurs in
the recognised text, else 1 − min(d, n) / n with d the edit distance and n the target's length,
so it lies in [0, 1]. A prompt without quoted text cannot be scored: NaN (the trainer drops it).

Flow-GRPO reads text with PaddleOCR; here the engine is Tesseract (``apt-get install
tesseract-ocr`` and ``pip install flowalign[ocr]``), run in sparse-text mode (``--psm 11``) that
looks for words anywhere in the image, one process per image in a thread pool.
"""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import torch

from reward_models.base import Reward, register_reward
from reward_models.clip_utils import to_pil

_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')  # not single quotes: apostrophes ("cat's") would match


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted (straight or curly) part of ``prompt``, or None.

    >>> quoted_text('a neon sign that says "Open Late"')
    'Open Late'
    >>> quoted_text("a cat") is None
    True
    """
    match = _QUOTED.search(prompt)
    return None if match is None else next(g for g in match.groups() if g is not None)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1).

    >>> edit_distance("kitten", "sitting")
    3
    """
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_similarity(recognised: str, target: str) -> float:
    """1 − normalised edit distance, case- and whitespace-insensitive, in [0, 1] (see module doc).

    >>> ocr_similarity("HELL0", "hello")
    0.8
    >>> ocr_similarity("HELL0 world", "hello")  # extra text costs too, down to 0
    0.0
    >>> ocr_similarity("xx hello xx", "Hello")
    1.0
    """
    recognised, target = ("".join(s.lower().split()) for s in (recognised, target))
    if not target:
        return float("nan")
    if target in recognised:
        return 1.0
    return 1.0 - min(edit_distance(recognised, target), len(target)) / len(target)


@register_reward("ocr")
class OcrReward(Reward):
    """Tesseract OCR against the prompt's quoted text. Example::

        reward = OcrReward()
        reward(images, ['a sign that says "HELLO"'] * len(images), [{}] * len(images))["ocr"]  # [B] in [0, 1]
    """

    components = ("ocr",)
    modality = "image"

    def __init__(self, tesseract_config: str = "--psm 11", lang: str = "eng", workers: int = 4,
                 tesseract_cmd: str | None = None):
        try:
            import pytesseract
        except ImportError as error:
            raise ImportError("the ocr reward needs pytesseract: pip install 'flowalign[ocr]'") from error
        cmd = tesseract_cmd or shutil.which("tesseract")
        if cmd is None or shutil.which(cmd) is None:
            raise FileNotFoundError(f"the ocr reward needs the tesseract binary (tried {tesseract_cmd or 'tesseract'} "
                                    "on PATH): apt-get install tesseract-ocr")
        pytesseract.pytesseract.tesseract_cmd = cmd
        self.pytesseract, self.config, self.lang, self.workers = pytesseract, tesseract_config, lang, workers

    def read(self, samples: torch.Tensor) -> list[str]:
        """samples float [B, 3, H, W] in [0, 1] → the text Tesseract finds in each image."""
        with ThreadPoolExecutor(max_workers=self.workers) as pool:  # each call is a subprocess
            return list(pool.map(lambda image: self.pytesseract.image_to_string(
                image, lang=self.lang, config=self.config), to_pil(samples)))

    def __call__(self, samples, prompts, metadata):
        texts = self.read(samples)
        targets = [quoted_text(p) for p in prompts]
        return {"ocr": torch.tensor([float("nan") if t is None else ocr_similarity(r, t)
                                     for r, t in zip(texts, targets)], dtype=torch.float32)}
