"""HPS v2 / v2.1 (Wu et al. 2023): an open_clip ViT-H-14 fine-tuned on human preference pairs.

score = cos(image features, prompt features), HPSv2's own scoring (its ``score`` takes the
diagonal of ``image_features @ text_features.T`` with both normalised). The checkpoint is
``HPS_v2_compressed.pt`` or ``HPS_v2.1_compressed.pt`` from hub repo ``xswu/HPSv2``: a dict whose
``"state_dict"`` loads into open_clip's ``ViT-H-14``.
"""

from __future__ import annotations

from pathlib import Path

from reward_models.base import Reward, register_reward
from reward_models.clip_score import open_clip_cosine
from reward_models.clip_utils import hub_failure, load_open_clip, load_state_dict_file, pick_device

HPS_REPO = "xswu/HPSv2"


def hps_checkpoint_file(checkpoint: str, repo: str = HPS_REPO) -> str:
    """A local checkpoint path, or a bare file name (``"HPS_v2.1_compressed.pt"``) fetched from ``repo``."""
    path = Path(checkpoint).expanduser()
    if path.is_file() or "/" in checkpoint or checkpoint.startswith((".", "~")):
        return str(path)  # a path: load_state_dict_file names it if it is missing
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo, checkpoint)
    except Exception as error:  # offline, missing file, bad repo: all say the same to the user
        raise hub_failure("HPS checkpoint", checkpoint, error,
                          f"Download {checkpoint} from hub repo {repo} and pass its path.") from error


@register_reward("hpsv2")
class HPSv2(Reward):
    """``checkpoint``: a local ``.pt`` file or a file name in ``repo``; ``arch``: an open_clip
    architecture name (``"ViT-H-14"``) or a local open_clip folder whose ``open_clip_config.json``
    gives the architecture (its weights, if any, are not loaded). Example::

        reward = HPSv2("HPS_v2.1_compressed.pt")
        reward(images, prompts, metadata)["hpsv2"]  # float [B]
    """

    components = ("hpsv2",)
    modality = "image"

    def __init__(self, checkpoint: str = "HPS_v2.1_compressed.pt", arch: str = "ViT-H-14", repo: str = HPS_REPO,
                 device: str | None = None):
        state = load_state_dict_file(hps_checkpoint_file(checkpoint, repo), "HPS checkpoint")  # fail before the build
        self.model, self.preprocess, self.tokenizer = load_open_clip(arch, pick_device(device), load_weights=False)
        # strict: a checkpoint that does not fit the architecture must fail here, not score noise
        self.model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})

    def __call__(self, samples, prompts, metadata):
        return {"hpsv2": open_clip_cosine(self.model, self.preprocess, self.tokenizer, samples, prompts)}
