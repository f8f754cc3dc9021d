"""Shared fixtures: a tiny random SD3 pipeline saved to a local folder, loaded as a user would."""

import pytest
import torch

from reward_models.worlds.shapes import vocabulary
from pipelines.tiny import TinySD3Sizes, build_tiny_sd3_pipeline

# one torch thread for the whole session: the tests' ops are too small for two threads, which only
# wait on each other (the slowest kernel test ran ~20× slower with two on a busy 2-core machine)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd3")
    build_tiny_sd3_pipeline(vocabulary(), TinySD3Sizes(), seed=0).save_pretrained(path)
    return path


@pytest.fixture
def tiny_adapter(tiny_sd3_dir):
    from pipelines.sd3 import SD3Adapter

    return SD3Adapter.from_pretrained(str(tiny_sd3_dir))


@pytest.fixture(scope="module")
def tiny_folder(request, tmp_path_factory):
    """variant → folder of a tiny random pipeline saved with save_pretrained, built by the test module's
    ``PIPELINE_BUILDERS[variant]()`` (a dict of zero-argument builders), each once per module when first asked."""
    builders, built = request.module.PIPELINE_BUILDERS, {}

    def folder(variant: str):
        if variant not in built:
            built[variant] = tmp_path_factory.mktemp(f"tiny-{variant}")
            builders[variant]().save_pretrained(built[variant])
        return built[variant]
    return folder
