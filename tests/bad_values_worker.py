"""Runs run_training.py's own entry point (`cli.before_hydra`, then its `@hydra.main`) once per
override, in this one process, and prints one JSON line per run: exit code, what reached stdout
and stderr (file descriptors 1 and 2), and the run's train.log. Used by test_cli.py: forty
mistakes for the price of one start-up."""

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_once(main, argv: list[str]) -> dict:
    from tunix_train import cli

    sys.argv = ["run_training.py", *argv]
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            cli.before_hydra(sys.argv)  # what run_training.py runs before Hydra
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        out.seek(0), err.seek(0)
        return {"code": code, "stdout": out.read().decode(), "stderr": err.read().decode()}


def main() -> None:
    spec = importlib.util.spec_from_file_location("run_training", REPO / "run_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base, runs = json.loads(sys.argv[1])
    for i, override in enumerate(runs):
        run_dir = Path(base) / f"run{i}"
        overrides = override if isinstance(override, list) else [override]
        result = run_once(module.main, [*overrides, f"hydra.run.dir={run_dir}"])
        # A refused command leaves no run dir (cli.refused_leaves_no_run_dir); a log if it did.
        result["run_dir_left"] = run_dir.exists()
        log = run_dir / "train.log"
        result["log"] = log.read_text() if log.exists() else ""
        print(json.dumps({"override": override, **result}), flush=True)


if __name__ == "__main__":
    main()
