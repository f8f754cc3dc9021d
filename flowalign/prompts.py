"""Prompt sources: the built-in worlds, a prompt file or a Hugging Face dataset. A prompt is a dict
with at least ``"prompt"``; GenEval-style records also carry ``"tag"`` and ``"include"`` for
verifiers; an image-conditioned task's records carry ``"image"``, the conditioning image's path
(relative paths are resolved against the prompt file's folder; several, for Qwen-Image-Edit-Plus: a
list, or in a CSV paths separated by "|"), which the adapter encodes with the prompt and the rewards
receive in their metadata.

In a recipe, a relative prompt path is relative to the recipe file's folder (``resolve_source``);
on the command line and in Python, to the working directory."""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

BUILTIN_SOURCES = ("shapes", "shapes_edit", "chess", "av")  # "<world>:<split>" sources, not files
DATASET_PREFIX = "hf:"  # hf:PATH[:SPLIT], a Hugging Face dataset (datasets.load_from_disk / load_dataset)
DATASET_FILES = {".parquet": "parquet", ".arrow": "arrow"}  # read through datasets too

log = logging.getLogger(__name__)


def load_prompts(source: str | list) -> list[dict]:
    """A list given in Python (prompt strings or records with a "prompt" key) as records, or
    ``"shapes:train"`` / ``"shapes:test"`` / ``"shapes:all"``, ``"shapes_edit:train"`` /
    ``"shapes_edit:test"`` / ``"shapes_edit:all"`` (the edit world's records, their input images written
    once to a temporary folder: ``reward_models.worlds.shapes_edit.edit_prompt_file``), ``"chess:train"`` /
    ``"chess:test"`` (theme requests, ``flowalign.chess.requests``; ``chess:<split>:<model folder>``
    for another model's split), ``"av:train"`` / ``"av:test"`` / ``"av:all"`` (the audio-video
    world, ``reward_models.worlds.audio_video``), a ``.txt`` file (one prompt per line), a ``.jsonl`` file (one
    record per line with a "prompt" key), a ``.csv`` file (a header row naming a "prompt" column;
    every column becomes a key of the record) or a Hugging Face dataset with a "prompt" column
    (``dataset_records``): ``hf:PATH[:SPLIT]``, a folder written by ``save_to_disk``, a
    ``.parquet`` or ``.arrow`` file. In .txt and .jsonl files a line starting with ``#`` is a
    comment (the shipped prompt files say where they come from that way)."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("prompts: an empty list (prompts and eval_prompts need at least one prompt)")
        bad = next((i for i, p in enumerate(source) if not (isinstance(p, str) or isinstance(p, dict)
                                                            and isinstance(p.get("prompt"), str))), None)
        if bad is not None:
            raise ValueError(f"prompts: prompts[{bad}] is {type(source[bad]).__name__} {source[bad]!r:.60}, not a "
                             "prompt (a string, or a record whose \"prompt\" is a string)")
        records = [{"prompt": p} if isinstance(p, str) else dict(p) for p in source]
        return check_records(records, "prompts (a list)")
    if not isinstance(source, str):
        raise ValueError(f"prompts must be a list of prompts or a source name, got {type(source).__name__}")
    if source.startswith("shapes:"):
        from reward_models.worlds.shapes import prompt_split

        return prompt_split(source.split(":", 1)[1])
    if source.startswith("shapes_edit:"):  # edit records whose input images are written once (edit_prompt_file)
        from reward_models.worlds.shapes_edit import edit_prompt_file

        return load_prompts(str(edit_prompt_file(source.split(":", 1)[1])))
    if source.startswith("av:"):
        from reward_models.worlds.audio_video import prompt_split as av_split

        return av_split(source.split(":", 1)[1])
    if source.startswith("chess:"):
        from flowalign.chess.requests import DEFAULT_MODEL, chess_requests

        _, split, *model = source.split(":", 2)
        return chess_requests(split, model[0] if model else DEFAULT_MODEL)
    if source.startswith(DATASET_PREFIX):
        return dataset_records(source[len(DATASET_PREFIX):])
    path = Path(source).expanduser()
    if path.is_dir() or path.suffix in DATASET_FILES:
        return dataset_records(source)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: tried {path.resolve()} (or use shapes:train / shapes:test / shapes_edit:train / shapes_edit:test / chess:train / chess:test / av:train / av:test)")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(read_text(path).splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}: line {number} is not JSON ({error})") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise ValueError(f"{path}: line {number} has no \"prompt\" key")
            if not isinstance(record["prompt"], str) or not record["prompt"].strip():
                raise ValueError(f"{path}: line {number}: \"prompt\" must be a non-empty string, got "
                                 f"{record['prompt']!r:.60}")
            records.append(record)
        return check_records([resolve_image(r, path) for r in records], path)
    if path.suffix == ".csv":
        read_text(path)  # UTF-8 text, not binary
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames and "prompt" not in reader.fieldnames:
                raise ValueError(f"{path}: the first line must be a header naming a \"prompt\" column "
                                 f"(and optionally \"image\", \"tag\", ...), got {reader.fieldnames}")
            records = list(reader)
        bad = [i + 2 for i, r in enumerate(records) if not r.get("prompt")]  # line 1 is the header
        if bad:
            raise ValueError(f"{path}: line {bad[0]} has no \"prompt\" value")
        return check_records([resolve_image(r, path) for r in records], path)
    if path.suffix == ".txt":
        lines = (line.strip() for line in read_text(path).splitlines())
        return check_records([{"prompt": line} for line in lines if line and not line.startswith("#")], path)
    raise ValueError(f"{path}: prompt files must be .txt (one prompt a line), .jsonl (one record a line), .csv "
                     f"(a header with a prompt column) or a Hugging Face dataset (hf:PATH, a save_to_disk folder, "
                     f".parquet, .arrow), got {path.suffix or 'no extension'}")


MAX_PROMPT_CHARS = 20_000  # far past any text encoder's context (T5: 512 tokens, Qwen: ~1024): a file read wrong


def read_text(path: Path) -> str:
    """A prompt file's text: UTF-8 and no NUL bytes (ValueError naming the file otherwise)."""
    data = path.read_bytes()
    if b"\0" in data:
        raise ValueError(f"{path}: a binary file (it holds NUL bytes), not UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start}); save it "
                         "as UTF-8") from None


def check_records(records: list[dict], where) -> list[dict]:
    """Every record's "prompt" a non-empty string of at most MAX_PROMPT_CHARS characters."""
    for i, record in enumerate(records):
        prompt = record.get("prompt")
        at = f"prompt {i + 1}"
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: {at}: \"prompt\" must be a non-empty string, got {prompt!r:.60}")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"{where}: {at}: a prompt of {len(prompt):,} characters (at most {MAX_PROMPT_CHARS:,}: "
                             "no text encoder reads that far; is the file one prompt a line?)")
    return records


def dataset_records(spec: str) -> list[dict]:
    """The rows of a Hugging Face dataset as prompt records (every column a key; "prompt" needed).

    ``spec``: ``PATH[:SPLIT]``. PATH is a folder written by ``Dataset.save_to_disk`` /
    ``DatasetDict.save_to_disk`` (``datasets.load_from_disk``), a ``.parquet`` / ``.arrow`` /
    ``.csv`` / ``.json`` / ``.jsonl`` file or a folder of such files (``datasets.load_dataset``), or
    a hub id (``load_dataset``; needs the network). SPLIT: default ``train`` when there are several,
    else the only one. Needs the optional ``datasets`` package (``pip install 'flowalign[datasets]'``).
    """
    path, split = spec, None
    head, _, tail = spec.rpartition(":")
    if head and tail and "/" not in tail and not Path(spec).expanduser().exists():
        path, split = head, tail
    try:
        import datasets
    except ImportError:
        raise ValueError(f"prompt source {spec!r} is a Hugging Face dataset, which needs the datasets package: "
                         "pip install 'flowalign[datasets]'") from None
    local = Path(path).expanduser()
    try:
        if (local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(local))
        elif local.is_file():
            builder = {".jsonl": "json", ".csv": "csv", ".json": "json", **DATASET_FILES}.get(local.suffix)
            if builder is None:
                raise ValueError(f"{local}: not a dataset file (.parquet, .arrow, .csv, .json, .jsonl)")
            loaded = datasets.load_dataset(builder, data_files=str(local))
        else:
            loaded = datasets.load_dataset(str(local) if local.is_dir() else path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"Hugging Face dataset not found: tried {local.resolve()} ({error})") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        split = split or ("train" if "train" in names else names[0] if len(names) == 1 else None)
        if split not in names:
            raise ValueError(f"{path}: no split {split!r}; it has {names} (choose one: hf:{path}:SPLIT)")
        loaded = loaded[split]
    elif split is not None and split != str(loaded.split):
        raise ValueError(f"{path}: a single split ({loaded.split}), not {split!r}")
    if "prompt" not in loaded.column_names:
        raise ValueError(f"{path}: the dataset has no \"prompt\" column (columns: {loaded.column_names}); "
                         "rename one: dataset.rename_column(\"caption\", \"prompt\")")
    records = [dict(row) for row in loaded]
    bad = next((i for i, r in enumerate(records) if not str(r.get("prompt") or "").strip()), None)
    if bad is not None:
        raise ValueError(f"{path}: row {bad} has no prompt")
    if local.exists():  # an "image" path column, relative to the dataset's folder like a prompt file's
        anchor = local / "dataset" if local.is_dir() else local
        records = [resolve_image(r, anchor) if isinstance(r.get("image"), (str, list)) else r for r in records]
    return records


def is_file_source(source: str) -> bool:
    """A prompt source that names a path (not a built-in world split, not a list)."""
    return source.partition(":")[0] not in BUILTIN_SOURCES


def resolve_source(source: str, folder: Path) -> str:
    """A recipe's prompt source with a relative path made relative to the recipe's ``folder``.

    Absolute paths, built-in splits and hub ids (``hf:org/name`` with no such folder) are kept. A
    relative path found next to the recipe wins; one found only relative to the working directory
    (what recipes meant before 2026-12) is kept with a warning; one found nowhere becomes the
    recipe-relative path, so the error names that.
    """
    prefix = DATASET_PREFIX if source.startswith(DATASET_PREFIX) else ""
    rest = source[len(prefix):]
    if not is_file_source(source) or not rest or Path(rest).expanduser().is_absolute() or rest.startswith("~"):
        return source
    head, _, tail = rest.rpartition(":")
    split = f":{tail}" if prefix and head and "/" not in tail and not (folder / rest).exists() else ""
    name = rest[: len(rest) - len(split)]
    beside = Path(os.path.normpath(folder / name))
    if beside.exists():
        return f"{prefix}{beside}{split}"
    if Path(name).exists():
        log.warning("prompt source %s is relative to the working directory; recipes' relative paths are read from "
                    "the recipe's folder (%s): write %s", source, folder, os.path.relpath(Path(name).resolve(), folder))
        return source
    return source if prefix else str(beside)  # hf:org/name is a hub id


def resolve_image(record: dict, prompt_file: Path) -> dict:
    """A record's "image" as an absolute path (relative to the prompt file's folder); it must exist.
    Several input images (Qwen-Image-Edit-Plus): a list of paths (jsonl) or paths separated by "|"
    (CSV), resolved to a list."""
    if record.get("image") is None or record.get("image") == "":
        return record
    given = record["image"]
    if not (isinstance(given, str) or isinstance(given, list) and given and all(isinstance(g, str) for g in given)):
        raise ValueError(f"{prompt_file}: \"image\" of {str(record.get('prompt'))[:60]!r} must be a path or a list of "
                         f"paths, got {given!r:.60}")
    several = isinstance(given, list) or "|" in given
    paths = given if isinstance(given, list) else given.split("|")
    resolved = []
    for path in paths:
        image = (prompt_file.parent / Path(str(path).strip()).expanduser()).resolve()
        if not image.is_file():
            raise FileNotFoundError(f"{prompt_file}: conditioning image of {str(record.get('prompt'))[:60]!r} not "
                                    f"found: tried {image}")
        check_image(image)
        resolved.append(str(image))
    return {**record, "image": resolved if several else resolved[0]}


def check_image(path: Path) -> None:
    """A conditioning image that decodes (PIL's ``verify``: header and data, no pixels kept);
    ValueError naming the file otherwise."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.verify()
    except Exception as error:  # noqa: BLE001  (PIL raises many kinds for a broken file)
        raise ValueError(f"{path}: not a readable image ({type(error).__name__}: {error})") from None
