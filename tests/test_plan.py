"""`python -m tunix_train.plan` as a user runs it (no simulated devices set up beforehand), and
`training.profile_communication` in a real run."""

import gzip
import json
import os
import subprocess
import sys

import jax
import pytest

from compile_flags import with_fast_compile
from helpers import ONE_STACK, REPO, TINY, compose_config, mesh_arg, run_cli
from tunix_train.training import state as state_lib
from tunix_train.training.setup import Setup

pytestmark = pytest.mark.slow
MODEL = [*ONE_STACK, mesh_arg(4, 2), "training.micro_batch_size=2"]


def run_plan(args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    with_fast_compile(env)
    return subprocess.run([sys.executable, "-m", "tunix_train.plan", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_planner_simulates_the_mesh_and_matches_a_real_allocation(tmp_path):
    result = run_plan([*MODEL, "plan.device_memory_gb=0.001", f"hydra.run.dir={tmp_path}/plan"],
                      cwd=REPO)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]  # a script acts
    record = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert record["mesh"] == {"fsdp": 4, "tp": 2} and record["zero_stage"] == 3
    assert record["fits"] is False and "does NOT fit" in result.stdout
    [verdict] = [line for line in result.stdout.splitlines() if "verdict:" in line]
    assert "zero_stage" not in verdict  # already 3: never suggested
    assert "lower training.micro_batch_size from 2" in verdict and "remat=full" in verdict
    assert {"params", "grads", "optimizer", "temp", "total"} <= set(record["per_device_bytes"])
    assert record["flops_per_step"] > 0 and record["tokens_per_step"] == 8 * 32
    assert {"kind", "axis", "count", "bytes"} <= set(record["collectives"][0])
    # The same configuration, really allocated here (conftest's 8 CPU devices).
    cfg = compose_config(*MODEL)
    setup = Setup.create(cfg)
    params = setup.fresh_state()["params"]
    assert record["num_params"] == sum(x.size for x in jax.tree.leaves(params))
    assert record["per_device_bytes"]["params"] == state_lib.param_bytes(params)[1]


def test_planner_needs_every_mesh_size(tmp_path):
    result = run_plan([*TINY, f"hydra.run.dir={tmp_path}/plan"], cwd=REPO)
    assert result.returncode == 2
    assert "set plan.num_devices" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_shown_planner_commands_compose():
    from test_docs import DOCS, shown_commands, split_command

    shown = [line for page in DOCS for line in shown_commands(page, "-m tunix_train.plan")]
    assert len(shown) >= 5  # README and memory_and_communication.md
    for line in shown:
        compose_config(*split_command(line, "tunix_train.plan")[1])


def trace_viewer_event_names(xplane) -> set[str]:
    """The event names of `xplane` as TensorBoard's profile plugin converts it for its trace
    viewer (xprof, in a process of its own: it brings its own XLA libraries)."""
    script = ("import json, sys\n"
              "from xprof.convert import raw_to_tool_data\n"
              "data, _ = raw_to_tool_data.xspace_to_tool_data([sys.argv[1]], 'trace_viewer', {})\n"
              "events = json.loads(data)['traceEvents']\n"
              "print(json.dumps(sorted({e.get('name') or '' for e in events})))")
    result = subprocess.run([sys.executable, "-c", script, str(xplane)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_profiled_run_leaves_report_trace_and_startup_lines(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli([*MODEL, "training.gradient_accumulation_steps=2",
                      "training.sync_gradients_every=2", "training.steps=3",
                      "logging.every_steps=1", "training.profile_communication=true",
                      f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                     env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "memory per device (compiled step)" in log
    assert "gradient sync: every 2 micro-step(s) = 1 reduce-scatter(s)" in log
    assert "local unreduced gradient buffer" in log
    report = json.loads((run_dir / "comm_report.json").read_text())
    assert report["gradient_reductions_per_step"] == 1
    assert list((run_dir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    [trace] = (run_dir / "tensorboard" / "plugins" / "profile").glob("*/*.trace.json.gz")
    # The run says where its trace is and how to open it (Perfetto needs nothing installed).
    assert f"profiler trace of steps 2-3: {trace} (open it at https://ui.perfetto.dev" in log
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    # TensorBoard's Profile tab (the [profile] extra, in the test install) reads the run's
    # xplane: its trace viewer shows every kind of collective the report counts.
    [xplane] = (run_dir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb")
    shown = {name.replace("_", "-") for name in trace_viewer_event_names(xplane)}  # all_gather.3
    kinds = {c["kind"] for c in report["collectives"]}
    missing = {kind for kind in kinds if not any(name.startswith(kind) for name in shown)}
    assert kinds and not missing, missing

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert {"communication/text_summary", "memory/text_summary"} <= set(events.Tags()["tensors"])


def test_the_planned_bf16_step_counts_no_fp32_copy_of_the_weights():
    """The CPU widens bf16 matmuls to fp32 and hoists the widening of whole weight stacks out
    of the layer loop: a copy an accelerator never makes, which the planner's compile leaves
    out (plan.AS_ON_ACCELERATORS), while an fp32 step, with nothing to widen, stays within 1%."""
    from tunix_train import trainers
    from tunix_train.plan import AS_ON_ACCELERATORS

    def temporaries(precision: str) -> tuple[int, int, int, bool]:
        cfg = compose_config("model=llama3_tiny", mesh_arg(1, 1), "data.seq_len=64",
                             "lora.rank=4", "training.remat=full",
                             f"training.mixed_precision={precision}")
        setup = Setup.create(cfg, jax.devices()[:1])
        lowered = setup.train_step(trainers.task_of("default").loss(cfg)[0]).lower(
            setup.state.with_shardings(), setup.abstract_batch())
        frozen = jax.tree.leaves_with_path(setup.state.abstract[state_lib.FROZEN])
        mlp = [x for path, x in frozen if "mlp" in jax.tree_util.keystr(path) and x.ndim == 3]
        default = lowered.compile()
        stacks = {"f32[" + ",".join(map(str, x.shape)) + "]" for x in mlp}
        return (default.memory_analysis().temp_size_in_bytes,
                lowered.compile(AS_ON_ACCELERATORS).memory_analysis().temp_size_in_bytes,
                sum(x.size for x in mlp) * 4, any(s in default.as_text() for s in stacks))

    default, planned, mlp_fp32, widened = temporaries("bf16")
    if widened:  # jax 0.10's CPU compiler: the MLP's stacks widened whole, out of the loop
        # At least the MLP's weights (gate, up, down: 3/4 of this model's, 4/5 of an 8B's);
        # attention's einsums widen per layer here.
        assert default - planned >= 0.9 * mlp_fp32 > 0
    else:  # jax 0.11's widens a layer's weights inside the loop: nothing to leave out
        assert 0 <= default - planned <= 0.03 * default
    default, planned, _, _ = temporaries("fp32")  # what else the pass hoists: small masks
    assert abs(default - planned) <= 0.01 * default
