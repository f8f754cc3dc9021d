"""Write the prompt files the real-model recipes read (configs/prompts/), from the public prompt lists
in ../shared/data/prompts (their origin, commit and license: ../shared/data/SOURCES.md).

Every file starts with ``#`` comment lines saying where its prompts come from and how they were
chosen (flowalign.prompts skips them); configs/prompts/SOURCES.md is the overview. Deterministic:
running it again writes the same bytes::

    python scripts/make_recipe_prompts.py --data ../shared/data/prompts --out configs/prompts

Choices, each written into the file's header:
* pickscore: Pick-a-Pic user prompts (Flow-GRPO's dataset/pickscore, MIT). The training list is
  25,432 prompts (2.9 MB) and contains explicit ones; we ship a seeded sample of 4,096 train
  prompts and the whole test list, both without the lines that match EXPLICIT (a crude word
  filter: it lowers the rate, it proves nothing).
* geneval: the 553 x 4 test records as Flow-GRPO ships them; Flow-GRPO's training records (4+ MiB)
  are not redistributed, so up to GENEVAL_PER_TAG training records per task are generated here
  with GenEval's own templates over the test set's objects, colors, relations and plurals, none
  equal to a test prompt.
* ocr: the 1,018 test prompts; Flow-GRPO's training prompts (4+ MiB) are not redistributed, so
  training uses Flow-GRPO's own small OCR task lists (assets/simple_ocr_animals_digit{1,3,5}.txt).
* hpdv2: the 400 HPDv2 test prompts (DanceGRPO evaluates on them).
* flow_grpo_assets: simple_animals.txt and imagenet_classes.txt (DDPO's prompt functions).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import re
from pathlib import Path

EXPLICIT = re.compile(r"\b(nude|nudes|naked|nsfw|sex|sexy|porn|breasts?|boobs|nipples?|topless|erotic|hentai|"
                      r"lingerie|bikini|penis|vagina|genitals|xxx|fuck\w*|cum|orgasm|rape|lewd|seductive|"
                      r"underwear|thong|busty|cleavage|gore)\b", re.IGNORECASE)
PICKSCORE_TRAIN = 4096
GENEVAL_PER_TAG = 250
NUMBERS = {2: "two", 3: "three", 4: "four"}
FLOW_GRPO = "yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd (MIT)"


def lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().split("\n") if line.strip()]


def header(*text: str, source: Path) -> str:
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    return "".join(f"# {t}\n" for t in (*text, f"source file sha256 {digest} (first 16 hex); written by "
                                        "scripts/make_recipe_prompts.py; see configs/prompts/SOURCES.md"))


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def geneval_train(test: list[dict], seed: int = 0) -> list[dict]:
    """GenEval-style training records: GENEVAL_PER_TAG of each of the six tasks, from the test
    set's own vocabulary (objects, colors, relations, plurals), none with a test prompt."""
    objects = sorted({i["class"] for r in test for i in r["include"]})
    colors = sorted({i["color"] for r in test for i in r["include"] if "color" in i})
    relations = sorted({i["position"][0] for r in test for i in r["include"] if "position" in i})
    plural = {}
    for r in test:
        if r["tag"] == "counting":
            cls, count = r["include"][0]["class"], r["include"][0]["count"]
            plural[cls] = r["prompt"].removeprefix(f"a photo of {NUMBERS[count]} ")
    taken = {r["prompt"] for r in test}
    rng = random.Random(seed)

    def one(tag: str) -> dict:
        a, b = rng.sample(objects, 2)
        c1, c2 = rng.sample(colors, 2)
        if tag == "single_object":
            return {"include": [{"class": a, "count": 1}], "prompt": f"a photo of {article(a)} {a}"}
        if tag == "two_object":
            return {"include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
                    "prompt": f"a photo of {article(a)} {a} and {article(b)} {b}"}
        if tag == "counting":
            cls, n = rng.choice(sorted(plural)), rng.choice(sorted(NUMBERS))
            return {"include": [{"class": cls, "count": n}], "exclude": [{"class": cls, "count": n + 1}],
                    "prompt": f"a photo of {NUMBERS[n]} {plural[cls]}"}
        if tag == "colors":
            return {"include": [{"class": a, "count": 1, "color": c1}], "prompt": f"a photo of {article(c1)} {c1} {a}"}
        if tag == "position":
            rel = rng.choice(relations)
            return {"include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]}],
                    "prompt": f"a photo of {article(a)} {a} {rel} {article(b)} {b}"}
        return {"include": [{"class": a, "count": 1, "color": c1}, {"class": b, "count": 1, "color": c2}],
                "prompt": f"a photo of {article(c1)} {c1} {a} and {article(c2)} {c2} {b}"}

    records = []
    for tag in ("single_object", "two_object", "counting", "colors", "position", "color_attr"):
        made: dict[str, dict] = {}
        for _ in itertools.repeat(None, 100 * GENEVAL_PER_TAG):
            if len(made) == GENEVAL_PER_TAG:
                break
            record = one(tag)
            if record["prompt"] not in taken and record["prompt"] not in made:
                made[record["prompt"]] = {"tag": tag, **record}
        records += made.values()
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data/prompts", help="the prompt folder of shared/data")
    parser.add_argument("--out", default="configs/prompts")
    args = parser.parse_args(argv)
    data, out = Path(args.data), Path(args.out)
    files: dict[str, str] = {}

    source = data / "pickscore/train.txt"
    clean = [p for p in lines(source) if not EXPLICIT.search(p)]
    sample = random.Random(0).sample(clean, PICKSCORE_TRAIN)
    files["pickscore/train.txt"] = header(
        f"Pick-a-Pic user prompts: a seeded sample (random.Random(0)) of {PICKSCORE_TRAIN} of the {len(clean)} lines",
        f"of Flow-GRPO's dataset/pickscore/train.txt ({len(lines(source))} prompts) that match no word of the",
        "EXPLICIT filter in scripts/make_recipe_prompts.py (crude: user prompts may still be unsuitable).",
        f"From {FLOW_GRPO}.", source=source) + "\n".join(sample) + "\n"
    source = data / "pickscore/test.txt"
    test = [p for p in lines(source) if not EXPLICIT.search(p)]
    files["pickscore/test.txt"] = header(
        f"Pick-a-Pic user prompts: Flow-GRPO's dataset/pickscore/test.txt ({len(lines(source))} prompts) without the",
        f"{len(lines(source)) - len(test)} that match the EXPLICIT filter of scripts/make_recipe_prompts.py.",
        f"From {FLOW_GRPO}.", source=source) + "\n".join(test) + "\n"

    source = data / "geneval/test_metadata.jsonl"
    test_records = [json.loads(line) for line in lines(source)]
    files["geneval/test_metadata.jsonl"] = header(
        "GenEval's 553 prompts, each 4 times (as Flow-GRPO evaluates): Flow-GRPO's dataset/geneval/test_metadata.jsonl,",
        f"unchanged. From {FLOW_GRPO}; GenEval (djghosh13/geneval, MIT).", source=source) + \
        "\n".join(lines(source)) + "\n"
    train_records = geneval_train(test_records)
    tags = [r["tag"] for r in train_records]
    per_tag = ", ".join(f"{tag} {tags.count(tag)}" for tag in dict.fromkeys(tags))
    files["geneval/train_metadata.jsonl"] = header(
        f"GenEval-style training records, generated: {len(train_records)} records ({per_tag}),",
        "GenEval's templates over the objects, colors, relations and plurals of geneval/test_metadata.jsonl",
        "(random.Random(0)), none equal to a test prompt (so no single_object: the test set has every object's).",
        "Flow-GRPO trains on its own",
        "dataset/geneval/train_metadata.jsonl (over 4 MiB, made the same way, not redistributed here).",
        source=source) + "\n".join(json.dumps(r) for r in train_records) + "\n"

    source = data / "ocr/test.txt"
    files["ocr/test.txt"] = header(
        f"Text-rendering prompts: Flow-GRPO's dataset/ocr/test.txt ({len(lines(source))} prompts), unchanged.",
        f"From {FLOW_GRPO}.", source=source) + "\n".join(lines(source)) + "\n"
    parts = [data / f"flow_grpo_assets/simple_ocr_animals_digit{k}.txt" for k in (1, 3, 5)]
    ocr_train = [p for part in parts for p in lines(part)]
    files["ocr/train.txt"] = header(
        "Text-rendering training prompts, a small stand-in: Flow-GRPO's assets/simple_ocr_animals_digit1/3/5.txt",
        f"({len(ocr_train)} prompts, concatenated). Flow-GRPO trains on dataset/ocr/train.txt (over 4 MiB, not",
        f"redistributed here): copy it and set data.train_prompts to it. From {FLOW_GRPO}.",
        source=parts[2]) + "\n".join(ocr_train) + "\n"

    source = data / "hpdv2/test.txt"
    files["hpdv2/test.txt"] = header(
        "The 400 HPDv2 test prompts (Human Preference Dataset v2, Apache-2.0), as Tencent-Hunyuan/MixGRPO @",
        "e5cdd6a427778d8c8b2e7a48ce16972141adbe7c ships them (data/prompts_test.txt), unchanged.",
        source=source) + "\n".join(lines(source)) + "\n"
    for name in ("simple_animals.txt", "imagenet_classes.txt"):
        source = data / "flow_grpo_assets" / name
        files[f"flow_grpo_assets/{name}"] = header(
            f"Flow-GRPO's flow_grpo/assets/{name} ({len(lines(source))} lines, DDPO's prompt lists), unchanged.",
            f"From {FLOW_GRPO}.", source=source) + "\n".join(lines(source)) + "\n"

    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"{path}: {sum(1 for line in text.splitlines() if not line.startswith('#'))} prompts, "
              f"{len(text.encode()) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
