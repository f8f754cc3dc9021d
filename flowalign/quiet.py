"""Library noise, silenced unless ``--verbose``: diffusers' and transformers' loading progress bars
(one per component and weight file, on every command that loads a model) and diffusers' "No LoRA
keys associated to CLIPTextModel..." warnings, which every load of a transformer-only LoRA prints
and which are harmless (flowalign trains the denoiser, never the text encoders). Other warnings of
these libraries are kept. Set before the libraries load (their environment variables) and, for
diffusers' bars, on its logging module once imported."""

from __future__ import annotations

import logging
import os

LORA_LOGGERS = ("diffusers.loaders.lora_base", "diffusers.loaders.lora_pipeline", "diffusers.loaders.peft")


class HarmlessLoraWarning(logging.Filter):
    """Drops diffusers' "No LoRA keys associated to <text encoder>" records, passes every other one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("No LoRA keys associated to")


def quiet(diffusers_bars: bool = True) -> None:
    """Silence the noise above for this process (environment settings the user made are kept).
    ``diffusers_bars``: diffusers' loading bars too, which imports it (seconds: it loads torch's compiler
    stack), so a command that loads no diffusers pipeline (the reward server) passes False."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # huggingface_hub's and transformers' bars
    for name in LORA_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, HarmlessLoraWarning) for f in logger.filters):
            logger.addFilter(HarmlessLoraWarning())
    if diffusers_bars:
        import diffusers.utils.logging

        diffusers.utils.logging.disable_progress_bar()  # "Loading pipeline components..."
