"""Shared fixtures: a tiny random SD3 pipeline saved to a local folder, loaded as a user would."""

import pytest
import torch

from flowalign.worlds.shapes import vocabulary
from pipelines.tiny import TinySD3Sizes, build_tiny_sd3_pipeline

torch.set_num_threads(2)


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
def one_thread():
    """One torch thread for a module of tiny-model tests: their ops are too small for two threads,
    which only wait on each other (5× slower on a busy 2-core machine); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
