"""Docs as typed: the commands README.md and docs/ show, run the way a user types them.

A `Typed` working copy is a fresh copy of the repository's files (what a clone holds: tracked
files and files not ignored), so relative paths in a command (`outputs/sums-sft`,
`demo_data/…`, `checkpoints/…`) mean what they mean for a user at the repository root. A
command runs through `bash` from there, character for character as the page shows it; a test
may only append overrides after it (CPU scale: a tiny model, fewer steps) and set the
environment the page tells CPU users to set (`XLA_FLAGS` for simulated devices). Nothing in a
shown command is replaced.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compile_flags import FAST_COMPILE, SAME_PROGRAM, with_fast_compile

# A scheduler's variables (the suite run inside a SLURM allocation, say) would make the commands
# the tests start tasks of that job (tunix_train/parallel/distributed.py): they are left out.
SCHEDULER_VARIABLES = ("SLURM_", "OMPI_")

REPO = Path(__file__).resolve().parent.parent

# Appended to training commands to make them CPU-sized (the command's own keys come first, so
# these win; model keys a checkpoint decides are left out where one is imported). Gemma 3 in 4
# local layers, one scanned body: a docs command's subject is the command, not the layer kinds
# (tests/helpers.py's ONE_STACK), and its step compiles in half the time of 7 layers. The
# vocabulary of gemma3_tiny (the byte-level tokenizer's 512) also for the pages' real sizes
# (gemma3_1b: 262,144 rows, whose output head alone doubled a CPU-scale run's time).
TINY_MODEL = ["model.num_layers=4", "model.embed_dim=64", "model.hidden_dim=128",
              "model.head_dim=16", "model.sliding_window=16", "model.vocab_size=512"]
CPU_SCALE = [*TINY_MODEL, "data.seq_len=32", "data.max_corpus_bytes=400000",
             "training.mixed_precision=fp32"]


SMALL_BATCH = ["training.micro_batch_size=2"]


def cpu_scale(command: str) -> list[str]:
    """CPU_SCALE for `command`: with pipeline stages, two blocks of layers (one per stage)."""
    if '"pp"' not in command:
        return CPU_SCALE
    return [o if not o.startswith("model.num_layers=") else "model.num_layers=12"
            for o in CPU_SCALE]


def page_commands(page: str, containing: str = "") -> list[str]:
    """Command lines of the ```bash blocks of `page` (a path under the repository root), in
    order, without comments; only those containing `containing` if given."""
    text = (REPO / page).read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#") and containing in line]


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), flags=re.S)


def repository_files() -> list[str]:
    """What a clone of the repository holds: tracked files and those git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
    return [name for name in listed.stdout.decode().split("\0") if name]


class Typed:
    """A fresh copy of the repository where commands run as typed."""

    def __init__(self, root: Path):
        self.root = root
        for name in repository_files():
            source, target = REPO / name, root / name
            if not source.exists() and not source.is_symlink():
                continue  # deleted in the working tree, not yet committed
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_symlink():
                os.symlink(os.readlink(source), target)
            else:
                shutil.copy2(source, target)
        # The package's bytecode too (conftest.py writes it; copy2 kept the sources' times, so it
        # is valid here): the commands import this copy's package, not the installed one.
        for compiled in REPO.glob("tunix_train/**/__pycache__/*.pyc"):
            target = root / compiled.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(compiled, target)

    def env(self, extra: dict | None = None, command: str = "", many_steps: bool = False) -> dict:
        """The user's shell: `python` is this interpreter; no simulated devices unless the
        page sets them (conftest's 8 are the test process's own)."""
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")
               and not k.startswith(SCHEDULER_VARIABLES)}
        if "TUNIX_TEST_TIMING" in os.environ:  # measuring (tests/timing/): its sitecustomize only
            env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.update(extra or {})
        # Codegen flags only (compile_flags.py); the commands are unchanged. A planner command
        # compiles as a user's does but for LLVM's optimisation: the memory figures it prints
        # (XLA's analysis) are the ones the page shows.
        planner = "tunix_train.plan" in command
        if many_steps:
            return env
        return with_fast_compile(env, SAME_PROGRAM if planner else FAST_COMPILE)

    def line(self, command: str, append: list[str] | tuple = ()) -> str:
        return " ".join([command, *map(shlex.quote, append)])

    def run(self, command: str, *append: str, env: dict | None = None, timeout: int = 900,
            many_steps: bool = False) -> subprocess.CompletedProcess:
        """`command` exactly as shown, then `append`, from the working copy's root.

        `many_steps`: a run of a page's full step count (hundreds of steps, or tens of a
        laptop-sized model), whose steps cost more than its compile: it compiles with XLA's
        defaults, as a user's does, not compile_flags.FAST_COMPILE, whose programs run 2-3x
        slower (2026-11-29, 2-core VM: docs/grpo.md's GRPO command 0.23 s/step against 0.65;
        its test and the checkpointing page's, cold 235 s against 232, warm 142 against 219)."""
        return subprocess.run(["bash", "-c", self.line(command, append)], cwd=self.root,
                              env=self.env(env, command, many_steps), capture_output=True,
                              text=True, timeout=timeout)

    def start(self, command: str, *append: str, env: dict | None = None) -> subprocess.Popen:
        """The same, running; stdout and stderr as one stream of lines."""
        # bash execs a lone simple command itself (`VAR=… python …` included): signals reach it.
        return subprocess.Popen(["bash", "-c", self.line(command, append)],
                                cwd=self.root, env=self.env(env, command), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)

    def run_python(self, code: str, env: dict | None = None,
                   timeout: int = 300) -> subprocess.CompletedProcess:
        """A page's Python block, exactly as shown, run from the root as a script."""
        script = self.root / "shown_snippet.py"
        script.write_text(code)
        return subprocess.run([sys.executable, script.name], cwd=self.root, env=self.env(env),
                              capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> str:
    """The output of a command that must have succeeded (else the assertion shows its end)."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}:\n{readable(output)}"
    return output


def readable(output: str, tail: int = 8000) -> str:
    """What of a failed command's output a failure shows: the Python stacks of processes that
    died on a signal (faulthandler's dumps: where each was), then the output's end without
    native stack frames (`    @     0x7f…  Flush()`, from an aborting C++ library in each
    process), which would fill it."""
    lines = [line for line in output.splitlines()
             if not re.match(r"\s*@\s+0x[0-9a-f]+\s", line)]
    stacks = [line for line in lines if re.match(
        r"(Fatal Python error|Thread 0x|Current thread 0x|  File \")", line)
        and not line.startswith("  File \"<frozen")]
    shown = "\n".join(lines)[-tail:]
    if any(line.startswith("Fatal Python error") for line in stacks):
        shown = "Python stacks:\n" + "\n".join(stacks)[-12000:] + "\n...\n" + shown
    return shown


def last_printed(result: subprocess.CompletedProcess) -> str:
    """The last line a command that must have succeeded printed on stdout (logs go elsewhere
    too: stderr's warnings are not what it printed)."""
    ok(result)
    return result.stdout.strip().splitlines()[-1]


def devices(n: int) -> dict:
    """The environment docs/distributed_training.md tells CPU users to set."""
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}


@pytest.fixture(scope="module")
def typed(tmp_path_factory) -> Typed:
    """A fresh working copy with docs/data.md's first command run: every page's demo files (and
    a user's "own" corpus). The test_docs_as_typed*.py files each import it (one per file)."""
    typed = Typed(tmp_path_factory.mktemp("typed") / "tunix_train")
    ok(typed.run(page_commands("docs/data.md", "tunix_train.data.demo")[0]))
    return typed
