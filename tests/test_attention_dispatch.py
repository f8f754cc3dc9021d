"""``model.attention`` set to a backend of diffusers' attention dispatcher: applied to every denoiser
of the families whose attention goes through it (same predictions as sdpa for a CPU backend), one
fallback line where the backend cannot run or where the family's attention bypasses the dispatcher
(SD3, the UNets), and accepted by the config."""

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName

from flowalign.config import load_config
from reward_models.worlds.shapes import vocabulary
from pipelines import load_adapter
from pipelines.attention import DISPATCHER_BACKENDS, attention_modules, attention_processors, resolve_attention
from pipelines.tiny_zoo import build_tiny_wan22_pipeline, build_tiny_z_image_pipeline



def test_the_backend_list_is_diffusers():
    assert set(DISPATCHER_BACKENDS) == {b.value for b in AttentionBackendName}


def test_a_backend_that_needs_an_accelerator_falls_back_on_a_cpu_in_one_line():
    backend, message = resolve_attention("flash", "cpu")
    assert backend == "sdpa" and message.count("\n") == 0
    assert "flash requested but" in message and "falling back to sdpa" in message
    assert resolve_attention("_native_math", "cpu") == ("_native_math", None)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dispatch")
    build_tiny_z_image_pipeline(vocabulary()).save_pretrained(root / "z_image")
    build_tiny_wan22_pipeline(vocabulary(), "a14b").save_pretrained(root / "wan22")
    return root


def _prediction(adapter):
    x = adapter.initial_noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        return adapter.predict(x, adapter.schedule(4).timesteps[-2], adapter.encode(["a red circle", "two squares"]),
                               2.0)


@pytest.mark.parametrize("family, sizes", [("z_image", {"height": 16, "width": 16}),
                                           ("wan", {"height": 32, "width": 32, "num_frames": 5})])
def test_a_dispatcher_backend_reaches_every_denoiser(folders, family, sizes, capsys):
    path = str(folders / ("z_image" if family == "z_image" else "wan22"))
    plain = load_adapter(family, path, attention="sdpa", options={"max_sequence_length": 16}, **sizes)
    math_ = load_adapter(family, path, attention="_native_math", options={"max_sequence_length": 16}, **sizes)
    assert math_.attention == "_native_math" and "falling back" not in capsys.readouterr().err
    for model in math_.denoisers().values():  # both Wan 2.2 experts
        assert all(str(getattr(a.processor._attention_backend, "value", a.processor._attention_backend)) ==
                   "_native_math" for a in attention_modules(model))
    assert (_prediction(math_) - _prediction(plain)).abs().max() <= 1e-5


def test_families_outside_the_dispatcher_keep_sdpa_and_say_so(tiny_sd3_dir, capsys):
    adapter = load_adapter("sd3", str(tiny_sd3_dir), attention="_native_math")
    err = capsys.readouterr().err
    assert adapter.attention == "sdpa" and err.count("falling back to sdpa") == 1
    assert "does not go through diffusers' attention dispatcher" in err
    assert set(attention_processors(adapter.model)) == {"JointAttnProcessor2_0"}


def test_the_config_accepts_dispatcher_backends():
    assert load_config(None, ["model.attention=_native_cudnn"]).model.attention == "_native_cudnn"
