"""What the checkpoints' content hashes (flowalign/integrity.py) cost, on the demo model's checkpoint.

    OMP_NUM_THREADS=1 python scripts/measure_checkpoint_hash.py --config configs/shapes_nft.yaml

Builds the recipe's trainer (the built-in shapes-sd3 model, its LoRA), writes one checkpoint and
times, over ``--reps`` repetitions: the whole ``save_checkpoint``, hashing its files as the writer
does (``folder_sha256``), checking them as resume does (``sha256_mismatch``) and the whole
``read_checkpoint``. Files are in the page cache after the first pass, as they are right after a
save; a cold read from a slow disk costs the disk's read time on top.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from flowalign.config import load_config
from flowalign.integrity import folder_sha256, sha256_mismatch
from flowalign.trainer import Trainer


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls."""
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/shapes_nft.yaml")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(load_config(args.config, [f"output_dir={out}", "tracker=none"]))
        save = timed(trainer.save_checkpoint, args.reps)
        folder = Path(out) / "checkpoints" / "epoch-000000"
        digests = json.loads((folder / "state.json").read_text())["sha256"]
        files = [folder / name for name in digests]
        result = {"config": args.config, "files": len(files),
                  "megabytes": round(sum(f.stat().st_size for f in files) / 2**20, 2),
                  "save_checkpoint_s": round(save, 4),
                  "hash_on_write_s": round(timed(lambda: folder_sha256(folder), args.reps), 4),
                  "check_on_resume_s": round(timed(lambda: sha256_mismatch(folder, digests), args.reps), 4),
                  "read_checkpoint_s": round(timed(lambda: trainer.read_checkpoint(folder), args.reps), 4)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
