"""Held-out accuracy of an untrained model, with exactly the evaluation a training run does first.

    python scripts/measure_baseline.py configs/shapes_flow_grpo.yaml --out pipelines/demo_models/shapes-sd3/baseline.json

The result equals the "before" entry of that config's metrics.json (same prompts, seeds, noise).
"""

from __future__ import annotations

import argparse
import json
import tempfile

from flowalign.config import load_config
from flowalign.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, as for flowalign train")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(args.config, [*args.overrides, f"output_dir={tmp}", "tracker=none"])
        result = Trainer(config).evaluate("baseline")  # a fresh LoRA is zero-initialised: the base model
    result = {"config": args.config, "overrides": args.overrides, "sampling": "ODE", **result}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
