"""The neural rewards, each on tiny random weights saved in its real checkpoint's layout and loaded
by path through the public constructor a user's checkpoint takes, scoring shapes-world images.
Expected values are computed by hand from the loaded parts."""

import json
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch import nn

from reward_models.worlds.shapes import prompt_split, render_scene, to_array, vocabulary
from pipelines.base import ModelNotFoundError
from pipelines.tiny import BOS, EOS, build_clip_tokenizer
from reward_models.base import Reward, available_rewards, build_reward, register_reward

TINY_OPEN_CLIP = {  # open_clip model_cfg: a 1-layer ViT on 24 px and a 1-layer text tower
    "embed_dim": 16,
    "vision_cfg": {"image_size": 24, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
OPENAI_MEAN, OPENAI_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def to_tensor(images: list[Image.Image]) -> torch.Tensor:
    """PIL images → float [B, 3, H, W] in [0, 1]."""
    return torch.from_numpy(np.stack([to_array(i) for i in images])).permute(0, 3, 1, 2).float() / 255


@pytest.fixture(scope="module")
def scenes():
    specs = prompt_split("train")[::7][:4]
    return to_tensor([render_scene(s, random.Random(i)) for i, s in enumerate(specs)]), [s["prompt"] for s in specs]


# --------------------------------------------------------------------------- transformers CLIP


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny ``CLIPModel`` + ``CLIPProcessor`` folder, as ``save_pretrained`` writes a hub repo."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(0)
    tokenizer = build_clip_tokenizer(vocabulary(), max_length=16)
    vocab = tokenizer.get_vocab()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=vocab[BOS],
                         eos_token_id=vocab[EOS], pad_token_id=vocab[EOS]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=24, patch_size=8),
        projection_dim=8)
    path = tmp_path_factory.mktemp("tiny-clip")
    CLIPModel(config).save_pretrained(path)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24})
    image_processor.save_pretrained(path)  # preprocessor_config.json, as in openai/clip-vit-large-patch14
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return path


def load_clip(path):
    from transformers import CLIPModel, CLIPProcessor

    return CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)


class RealLayoutMLP(nn.Module):
    """The improved-aesthetic-predictor's module layout, so ``state_dict`` has its real keys."""

    def __init__(self, dims=(8, 32, 16, 8, 4, 1)):
        super().__init__()
        d = dims
        self.layers = nn.Sequential(nn.Linear(d[0], d[1]), nn.Dropout(0.2), nn.Linear(d[1], d[2]),
                                    nn.Dropout(0.2), nn.Linear(d[2], d[3]), nn.Dropout(0.1),
                                    nn.Linear(d[3], d[4]), nn.Linear(d[4], d[5]))


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory):
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("aesthetic") / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(RealLayoutMLP().state_dict(), path)
    return path


def test_aesthetic_is_the_mlp_on_the_normalised_clip_embedding(clip_dir, mlp_file, scenes):
    images, prompts = scenes
    reward = build_reward("aesthetic", clip_path=str(clip_dir), mlp_path=str(mlp_file), device="cpu")
    got = reward(images, prompts, [{}] * len(prompts))["aesthetic"]

    model, processor = load_clip(clip_dir)
    state = torch.load(mlp_file, weights_only=True)
    assert sorted(state) == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("bias", "weight")]
    with torch.no_grad():
        pixels = processor(images=(images * 255).round().to(torch.uint8), return_tensors="pt")["pixel_values"]
        assert pixels.shape[-2:] == (24, 24)  # the reward resized 32 px to the model's 24
        e = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        x = e / e.norm(dim=-1, keepdim=True)
        for i in (0, 2, 4, 6, 7):  # the real MLP has no activations; dropout is off at inference
            x = F.linear(x, state[f"layers.{i}.weight"], state[f"layers.{i}.bias"])
    assert got.shape == (len(prompts),)
    torch.testing.assert_close(got, x.squeeze(1), rtol=1e-4, atol=1e-5)
    assert got.unique().numel() == len(prompts)  # different images, different scores


def test_aesthetic_mlp_loads_from_safetensors_and_rejects_wrong_keys(clip_dir, mlp_file, tmp_path, scenes):
    from safetensors.torch import save_file

    from reward_models.aesthetic import aesthetic_mlp

    state = torch.load(mlp_file, weights_only=True)
    save_file(state, tmp_path / "mlp.safetensors")
    images, prompts = scenes
    a = build_reward("aesthetic", clip_path=str(clip_dir), mlp_path=str(mlp_file), device="cpu")
    b = build_reward("aesthetic", clip_path=str(clip_dir), mlp_path=str(tmp_path / "mlp.safetensors"), device="cpu")
    meta = [{}] * len(prompts)
    torch.testing.assert_close(a(images, prompts, meta)["aesthetic"], b(images, prompts, meta)["aesthetic"])
    with pytest.raises(ValueError, match="layers"):
        aesthetic_mlp({"fc.weight": torch.zeros(1, 8), "fc.bias": torch.zeros(1)})


def test_pickscore_is_logit_scale_times_cosine(clip_dir, scenes):
    images, prompts = scenes
    reward = build_reward("pickscore", model=str(clip_dir), processor=str(clip_dir), device="cpu")
    got = reward(images, prompts, [{}] * len(prompts))["pickscore"]

    model, processor = load_clip(clip_dir)
    with torch.no_grad():
        pixels = processor(images=(images * 255).round().to(torch.uint8), return_tensors="pt")["pixel_values"]
        text = processor(text=prompts, padding=True, truncation=True, max_length=16, return_tensors="pt")
        img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        txt = model.text_projection(model.text_model(input_ids=text["input_ids"],
                                                     attention_mask=text["attention_mask"]).pooler_output)
        expected = model.logit_scale.exp() * F.cosine_similarity(img, txt, dim=-1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)

    # the same image under the same prompt scores the same; a different image scores differently
    twice = reward(images[[0, 0, 1]], [prompts[0]] * 3, [{}] * 3)["pickscore"]
    assert twice[0] == twice[1] and twice[0] != twice[2]


# --------------------------------------------------------------------------- open_clip


def write_open_clip_folder(path, with_weights: bool = True, seed: int = 0):
    """The layout of an open_clip hub repo: open_clip_config.json (+ open_clip_pytorch_model.bin)."""
    import open_clip

    path.mkdir(parents=True, exist_ok=True)
    (path / "open_clip_config.json").write_text(json.dumps(
        {"model_cfg": TINY_OPEN_CLIP, "preprocess_cfg": {"mean": OPENAI_MEAN, "std": OPENAI_STD}}))
    torch.manual_seed(seed)
    model = open_clip.CLIP(**TINY_OPEN_CLIP)
    if with_weights:
        torch.save(model.state_dict(), path / "open_clip_pytorch_model.bin")
    return model


def hand_cosine(model, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """cos(image, text) with open_clip's own tokenizer and an explicit resize + normalise."""
    import open_clip

    with torch.no_grad():
        u8 = (images * 255).round() / 255  # the reward scores 8-bit images
        pixels = F.interpolate(u8, size=24, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
        pixels = (pixels - torch.tensor(OPENAI_MEAN)[:, None, None]) / torch.tensor(OPENAI_STD)[:, None, None]
        img = model.encode_image(pixels)
        txt = model.encode_text(open_clip.SimpleTokenizer(context_length=16)(prompts))
    return F.cosine_similarity(img, txt, dim=-1)


def test_clip_score_is_the_cosine_of_image_and_text_features(tmp_path, scenes):
    images, prompts = scenes
    model = write_open_clip_folder(tmp_path / "tiny-open-clip").eval()
    reward = build_reward("clip_score", model=str(tmp_path / "tiny-open-clip"), device="cpu")
    got = reward(images, prompts, [{}] * len(prompts))["clip_score"]
    # PIL's bicubic resize and torch's antialiased one differ by a few grey levels only
    torch.testing.assert_close(got, hand_cosine(model, images, prompts), rtol=0, atol=2e-3)
    assert got.abs().max() <= 1

    # the scores are a function of (image, prompt): swap the prompts and they change
    swapped = reward(images, prompts[::-1], [{}] * len(prompts))["clip_score"]
    assert not torch.allclose(got, swapped)
    same = reward(images[[0, 0]], [prompts[0]] * 2, [{}] * 2)["clip_score"]
    assert same[0] == same[1]
    torch.testing.assert_close(same[0], got[0])  # batch size changes only the float rounding


def test_hps_loads_the_state_dict_checkpoint_into_the_architecture(tmp_path, scenes):
    images, prompts = scenes
    write_open_clip_folder(tmp_path / "arch", with_weights=False)  # the architecture only
    trained = write_open_clip_folder(tmp_path / "unused", seed=3).eval()
    torch.save({"state_dict": trained.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    reward = build_reward("hpsv2", checkpoint=str(tmp_path / "HPS_v2.1_compressed.pt"), arch=str(tmp_path / "arch"),
                          device="cpu")
    got = reward(images, prompts, [{}] * len(prompts))["hpsv2"]
    torch.testing.assert_close(got, hand_cosine(trained, images, prompts), rtol=0, atol=2e-3)

    # a checkpoint of another architecture fails loudly instead of scoring noise
    torch.save({"state_dict": {"visual.proj": torch.zeros(2, 2)}}, tmp_path / "wrong.pt")
    with pytest.raises(RuntimeError):
        build_reward("hpsv2", checkpoint=str(tmp_path / "wrong.pt"), arch=str(tmp_path / "arch"), device="cpu")


def test_missing_local_paths_name_the_path_tried(tmp_path, clip_dir, mlp_file):
    missing = tmp_path / "no-such-model"
    cases = [
        ("aesthetic", dict(clip_path=str(clip_dir), mlp_path=str(missing / "mlp.pth"))),
        ("aesthetic", dict(clip_path=str(missing), mlp_path=str(mlp_file))),
        ("pickscore", dict(model=str(missing), processor=str(clip_dir))),
        ("clip_score", dict(model=str(missing))),
        ("clip_score", dict(model=f"local-dir:{missing}")),
        ("hpsv2", dict(checkpoint=str(missing / "HPS_v2.1_compressed.pt"), arch="ViT-B-32")),
    ]
    for name, kwargs in cases:
        with pytest.raises(ModelNotFoundError, match="tried"):
            build_reward(name, device="cpu", **kwargs)
    try:
        build_reward("clip_score", model=str(missing))
    except ModelNotFoundError as error:
        assert str(missing) in str(error)
    with pytest.raises(ValueError, match="without weights"):
        build_reward("clip_score", model="ViT-B-32")
    (tmp_path / "not-open-clip").mkdir()
    with pytest.raises(ModelNotFoundError, match="open_clip_config.json"):
        build_reward("clip_score", model=str(tmp_path / "not-open-clip"))


# --------------------------------------------------------------------------- OCR


def text_image(text: str, size=(240, 80)) -> Image.Image:
    image = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(image).text((16, 12), text, fill=(0, 0, 0), font=ImageFont.load_default(size=48))
    return image


@pytest.mark.skipif(shutil.which("tesseract") is None,
                    reason="tesseract binary missing (apt-get install tesseract-ocr)")
def test_ocr_reads_rendered_text_back():
    reward = build_reward("ocr")
    images = to_tensor([text_image("HELLO"), text_image("HELLO"), text_image("")])
    prompts = ['a sign that says "hello"', 'a sign that says "WORLD"', 'a sign that says "HELLO"']
    got = reward(images, prompts, [{}] * 3)["ocr"]
    assert got[0] == 1.0  # read back exactly (case-insensitive)
    assert got[1] < 0.5 and got[2] == 0.0  # wrong target; nothing written
    assert ((got >= 0) & (got <= 1)).all()
    assert torch.isnan(reward(images[:1], ["no quotes here"], [{}])["ocr"]).all()


# --------------------------------------------------------------------------- Pref-GRPO


@register_reward("test_brightness")
class Brightness(Reward):
    components = ("brightness",)

    def __call__(self, samples, prompts, metadata):
        return {"brightness": samples.mean((1, 2, 3))}


class BrightnessPreference:
    """A pairwise model for ``pref_grpo`` by import string: the brighter image wins."""

    def prefer(self, images_a, images_b, prompts):
        return (images_a.mean((1, 2, 3)) > images_b.mean((1, 2, 3))).float()


def test_win_rates_sum_to_half_the_group_and_follow_the_base_reward():
    g, n = 3, 4
    levels = torch.rand(g * n, generator=torch.Generator().manual_seed(0))
    images = levels[:, None, None, None].expand(-1, 3, 8, 8).contiguous()
    prompts = [f"prompt {k}" for k in range(g) for _ in range(n)]
    reward = build_reward("pref_win_rate", base="test_brightness", temperature=0.1)
    assert reward.components == ("win_rate", "brightness")
    out = reward(images, prompts, [{}] * len(prompts))
    win = out["win_rate"].view(g, n)
    torch.testing.assert_close(win.sum(1), torch.full((g,), n / 2))  # n(n−1)/2 games, each shared, over n−1
    assert (win.argmax(1) == levels.view(g, n).argmax(1)).all()
    torch.testing.assert_close(out["brightness"], levels)

    # the same through the generic pairwise path: Bradley–Terry asked pair by pair
    from reward_models.pref_grpo import BradleyTerryPreference, PrefGRPO

    pairwise = PrefGRPO(BradleyTerryPreference(Brightness(), "brightness", temperature=0.1), group_size=n)
    torch.testing.assert_close(pairwise(images, prompts, [{}] * len(prompts))["win_rate"], out["win_rate"])

    # hard wins (temperature 0) are ranks / (n − 1)
    hard = build_reward("pref_win_rate", base="test_brightness", temperature=0)(images, prompts, [{}] * len(prompts))
    ranks = levels.view(g, n).argsort(1).argsort(1).float()
    torch.testing.assert_close(hard["win_rate"].view(g, n), ranks / (n - 1))


def test_pref_grpo_by_import_string_groups_and_nan():
    images = torch.tensor([0.1, 0.9, 0.5, 0.2, 0.3, 0.7])[:, None, None, None].expand(-1, 3, 4, 4)
    prompts = ["same prompt"] * 6
    reward = build_reward("pref_grpo", preference="test_neural_rewards:BrightnessPreference", group_size=3)
    torch.testing.assert_close(reward(images, prompts, [{}] * 6)["win_rate"],
                               torch.tensor([0.0, 1.0, 0.5, 0.0, 0.5, 1.0]))
    by_metadata = build_reward("pref_grpo", preference="test_neural_rewards:BrightnessPreference")
    meta = [{"group_id": k} for k in ("a", "a", "a", "b", "b", "b")]
    torch.testing.assert_close(by_metadata(images, prompts, meta)["win_rate"],
                               torch.tensor([0.0, 1.0, 0.5, 0.0, 0.5, 1.0]))
    with pytest.raises(ValueError, match="group_size=4"):
        build_reward("pref_grpo", preference="test_neural_rewards:BrightnessPreference", group_size=4)(
            images, prompts, [{}] * 6)

    # a sample the base reward cannot score gets NaN; its group mates play the others only
    base = images.mean((1, 2, 3)).clone()
    base[1] = float("nan")
    from reward_models.pref_grpo import bradley_terry, group_win_rates

    win = group_win_rates(bradley_terry(base[:3, None], base[None, :3], 0), torch.zeros(3, dtype=torch.long))
    assert torch.isnan(win[1]) and win[0] == 0.0 and win[2] == 1.0


def test_every_new_reward_is_registered():
    assert {"aesthetic", "clip_score", "pickscore", "hpsv2", "ocr", "pref_grpo", "pref_win_rate"} <= set(
        available_rewards())
