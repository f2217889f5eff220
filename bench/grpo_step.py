"""Where a GRPO step's time goes: rollouts (sampling) against updates (the sharded train step).

    python bench/grpo_step.py                       # gemma3_tiny on CPU, the sums task
    python bench/grpo_step.py model=gemma3_270m data.seq_len=1024 grpo.max_new_tokens=512 \
        training.global_batch_size=64 training.mixed_precision=bf16     # on a GPU

Runs run_training.py with `trainer=grpo` on the one-digit sums prompts (from random weights:
the shapes, not the answers, set the time; every completion runs to max_new_tokens when no EOS
comes) and prints the median of each part over the steps after the first (which compiles),
with their ratio, from the run's own metrics.jsonl.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tunix_train.data import demo  # noqa: E402

DEFAULTS = ["trainer=grpo", "data=prompts", "data.seq_len=64", "grpo.max_new_tokens=32",
            "grpo.rewards=[answer]", "training.global_batch_size=64", "grpo.num_generations=8",
            "training.steps=12", "logging.every_steps=1", "checkpoint.every_steps=0"]


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        prompts = demo.write_sums(Path(tmp))
        run_dir = Path(tmp) / "run"
        result = subprocess.run(
            [sys.executable, str(REPO / "run_training.py"), *DEFAULTS, f"data.path={prompts}",
             *overrides, f"hydra.run.dir={run_dir}"], capture_output=True, text=True)
        if result.returncode:
            sys.exit(result.stderr[-3000:])
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")
                   if '"rollout_s"' in line][1:]
    rollout = statistics.median(r["rollout_s"] for r in records)
    update = statistics.median(r["update_s"] for r in records)
    tokens = statistics.median(r["rollout_tokens_per_s"] for r in records)
    print(f"steps measured: {len(records)} (the first, compiling, left out)")
    print(f"rollout {rollout * 1e3:,.0f} ms ({tokens:,.0f} generated tokens/s) | "
          f"update {update * 1e3:,.0f} ms | rollout / update = {rollout / update:.2f} | "
          f"rollout share of the step {rollout / (rollout + update):.0%}")


if __name__ == "__main__":
    main(sys.argv[1:])
