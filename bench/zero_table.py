"""The ZeRO table of docs/memory_and_communication.md, reproduced from the planner's plan.json.

    python bench/zero_table.py [extra overrides]     # prints the Markdown table

Runs `python -m tunix_train.plan` for each model, fsdp size and ZeRO stage (one compile each,
on simulated CPU devices) and reads back the per-device bytes it wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = ("gemma3_1b", "gemma3_4b")
FSDP = (8, 16)
SETTINGS = ["training.micro_batch_size=1", "data.seq_len=2048", "training.remat=none"]
GB = 1e9


def plan(model: str, fsdp: int, stage: int, extra: list[str], out: Path) -> dict:
    run_dir = out / f"{model}_{fsdp}_{stage}"
    subprocess.run(
        [sys.executable, "-m", "tunix_train.plan", f"model={model}",
         f'model.mesh_shape=[[{fsdp},1],["fsdp","tp"]]', f"training.zero_stage={stage}",
         *SETTINGS, *extra, f"hydra.run.dir={run_dir}"],
        check=True, capture_output=True, text=True,
    )
    return json.loads((run_dir / "plan.json").read_text())


def row(record: dict) -> str:
    b = {k: v / GB for k, v in record["per_device_bytes"].items()}
    state = b["params"] + b["grads"] + b["optimizer"]
    psi, n = record["num_params"], record["mesh"]["fsdp"]
    zero = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
            3: 16 * psi / n}[record["zero_stage"]] / GB
    return (f"| {record['model']} | {n} | {record['zero_stage']} | {b['params']:.2f} | "
            f"{b['grads']:.2f} | {b['optimizer']:.2f} | {state:.2f} | {zero:.2f} | "
            f"{b['temp']:.2f} | {b['total']:.2f} |")


def main(extra: list[str]) -> None:
    print("| model | fsdp N | stage | params | grads | optimizer | model state | ZeRO paper "
          "| XLA temporaries | total |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for model in MODELS:
            for fsdp in FSDP:
                for stage in range(4):
                    print(row(plan(model, fsdp, stage, extra, Path(out))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
