"""The tiny-model builders of pipelines/tiny.py are reproducible across processes: the same seed
gives the same tokenizer ids (the BPE trainer numbers tokens in a per-process hash order)."""

import subprocess
import sys

SCRIPT = """
from pipelines.tiny import build_clip_tokenizer
from reward_models.worlds.shapes import vocabulary
t = build_clip_tokenizer(vocabulary())
print(sorted(t.get_vocab().items()), t("a red circle").input_ids)
"""


def test_clip_tokenizer_ids_are_the_same_in_every_process():
    outputs = {subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
               for _ in range(2)}
    assert len(outputs) == 1
