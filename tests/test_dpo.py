"""DPO (`trainer=dpo`): the losses against NumPy, the pairs' rows, ln 2 at step 0 through
run_training.py on two meshes that agree with each other, the precomputed reference against the
live one, resume against the uninterrupted run, the reference's memory, and bad input.
docs/dpo.md's laptop example learns against an lr=0 control in tests/test_docs_as_typed_pages.py."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FAMILY_MODELS, ONE_STACK, TINY, compose_config, run_cli
from tunix_train import validation
from tunix_train.config import ConfigError
from tunix_train.data import demo
from tunix_train.data import tokenizer as tokenizer_lib
from tunix_train.dpo import objective as objective_lib
from tunix_train.dpo.pairs import Pair, read_pairs
from tunix_train.models import families
from tunix_train.training import reference
from tunix_train.training.setup import Setup

# ---------------------------------------------------------------------------------------------
# The formulas, against NumPy written from the papers.


def log_sigmoid(x):
    return -np.log1p(np.exp(-x))


def numpy_pair_loss(h, beta, loss, eps):
    if loss == "sigmoid":  # DPO eq. 7; conservative DPO's smoothed labels
        return -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)
    if loss == "ipo":  # IPO eq. 17, tau = beta
        return (h - 1 / (2 * beta)) ** 2
    return max(0.0, 1 - beta * h)  # SLiC's hinge


@pytest.mark.parametrize("loss,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0),
                                      ("hinge", 0.0)])
def test_each_loss_and_metric_equals_numpy_on_random_log_probs(loss, eps):
    rng = np.random.default_rng(0)
    rows, length, beta = 6, 20, 0.3
    logp, ref = (-rng.gamma(2.0, 1.0, (rows, length)) for _ in range(2))
    segments = np.zeros((rows, length), np.int32)
    weights = np.zeros((rows, length), np.float32)
    for r in range(rows - 1):  # the last row holds no pair: it must count nothing
        cut, end = rng.integers(4, 9), rng.integers(12, 19)
        segments[r, :cut], segments[r, cut:end] = 1, 2
        weights[r] = 1.0
        weights[r, :2] = weights[r, cut:cut + 3] = 0.0  # the prompts' targets, masked
    pair_sums = jax.jit(objective_lib.pair_sums, static_argnums=0)  # one program, not op by op
    got_loss, got = pair_sums(
        objective_lib.Objective(beta, loss, eps), jnp.asarray(logp), jnp.asarray(ref),
        jnp.asarray(weights), jnp.asarray(segments))
    want = {"loss": 0.0, "tokens": 0, "chosen_reward": 0.0, "rejected_reward": 0.0, "margin": 0.0,
            "accuracy": 0}
    for r in range(rows - 1):
        sums = {}
        for segment in (1, 2):
            tokens = [t for t in range(length) if segments[r, t] == segment and weights[r, t]]
            sums[segment] = (sum(logp[r, t] for t in tokens), sum(ref[r, t] for t in tokens))
        (pw, rw), (pl, rl) = sums[1], sums[2]
        want["loss"] += numpy_pair_loss((pw - rw) - (pl - rl), beta, loss, eps)
        want["tokens"] += 1
        want["chosen_reward"] += beta * (pw - rw)
        want["rejected_reward"] += beta * (pl - rl)
        want["margin"] += beta * (pw - rw) - beta * (pl - rl)
        want["accuracy"] += beta * (pw - rw) > beta * (pl - rl)
    assert 0 < want["accuracy"] < rows - 1  # both outcomes occur
    np.testing.assert_allclose(float(got_loss), want.pop("loss"), rtol=1e-5)
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_pairs_row_scores_each_response_after_its_own_prompt():
    pair = Pair(prompt=(2, 10, 11), chosen=(20, 21, 1), rejected=(30, 1))
    row = pair.row(16)
    # segment 1: BOS p p c c EOS → 5 (input, target) columns, targets c c EOS counted
    assert row["segment_ids"].tolist() == [1] * 5 + [2] * 4 + [0] * 7
    assert row["positions"].tolist()[:9] == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert row["inputs"].tolist()[:9] == [2, 10, 11, 20, 21, 2, 10, 11, 30]
    assert row["targets"].tolist()[:9] == [10, 11, 20, 21, 1, 10, 11, 30, 1]
    assert row["weights"].tolist()[:9] == [0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert pair.length() == 9 and not row["weights"][9:].any()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return demo.write_preferences(tmp_path_factory.mktemp("demo"), demo.documents(100_000))


def test_chat_messages_take_the_familys_turns_and_parquet_equals_json_lines(pairs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in pairs.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "pairs.parquet")
    chats = [{"prompt": [{"role": "user", "content": r["prompt"]}],
              "chosen": [{"role": "assistant", "content": r["chosen"]}],
              "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in records]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    tokenizer = tokenizer_lib.ByteTokenizer()
    family = families.of(compose_config().model)
    read = lambda path, *o: read_pairs(compose_config(  # noqa: E731
        "trainer=dpo", "data=preferences", f"data.path={path}", "data.seq_len=256",
        *o).data, tokenizer, family)
    assert read(pairs) == read(tmp_path / "pairs.parquet")
    text, chat = read(pairs, "data.chat_template=true"), read(tmp_path / "chat.jsonl")
    assert [p.prompt for p in text[0]] == [p.prompt for p in chat[0]]
    first = chat[0][0]
    assert tokenizer.decode(first.prompt[1:]).startswith("<start_of_turn>user\nreverse ")
    assert tokenizer.decode(first.chosen[:-1]).endswith("<end_of_turn>\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    # Its other fields are the prompt and the chosen response: the pair lacks its rejected
    # one, and pointing data.rejected_field at either would be wrong advice.
    with pytest.raises(ConfigError, match=r"data.rejected_field: .* has no field 'rejected' \(it "
                                          r"has prompt, chosen\); every record needs one: add it "
                                          r"there, or set data.rejected_field to the field that "
                                          r"holds it\.$"):
        read(tmp_path / "bad.jsonl", f"data.eval_path={pairs}")
    (tmp_path / "named.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b",
                                                      "worse": "c"}) + "\n")
    with pytest.raises(ConfigError, match=r"\(it has prompt, chosen, worse\); set "
                                          r"data.rejected_field to worse\.$"):
        read(tmp_path / "named.jsonl", f"data.eval_path={pairs}")


@pytest.mark.parametrize("override,match", [
    (["trainer=dpo"], "trainer=dpo needs data=preferences"),
    (["data=preferences"], "data=preferences is for trainer=dpo"),
    (["trainer=dpo", "data=preferences", "dpo.loss=kto"], "dpo.loss='kto' is not one of"),
    (["trainer=dpo", "data=preferences", "dpo.beta=0"], "dpo.beta=0.0 is out of range"),
    (["trainer=dpo", "data=preferences", "dpo.loss=ipo", "dpo.label_smoothing=0.1"],
     "dpo.label_smoothing=0.1 applies to dpo.loss=sigmoid only"),
    (["trainer=dpo", "data=preferences", 'model.mesh_shape=[[2,2,2],["pp","fsdp","tp"]]'],
     "pipeline stages, which trainer=dpo does not support"),
])
def test_bad_dpo_settings_are_refused_by_name(override, match):
    with pytest.raises(ConfigError, match=match):
        validation.validate(compose_config(*override))


# ---------------------------------------------------------------------------------------------
# Whole runs.

STEPS = 4
RUN = [*ONE_STACK, "trainer=dpo", "data=preferences", "data.seq_len=48", "logging.every_steps=1",
       "training.global_batch_size=8", f"training.steps={STEPS}", "optimizer.lr=3e-3",
       "data.eval_batches=1"]


def metrics(run_dir: Path, key: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in lines if key in r}


@pytest.fixture(scope="module")
def one_device(pairs, tmp_path_factory) -> Path:
    """run_training.py on one device ([[1,1]]): the reference the others are compared with."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    result = run_cli([*RUN, f"data.path={pairs}", 'model.mesh_shape=[[1,1],["fsdp","tp"]]',
                      f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("mesh,extra", [
    ('[[4,2],["fsdp","tp"]]', ["training.profile_communication=true"]),
    # Each pair's row split over cp: its log-probability sums add up over the cp devices.
    ('[[2,2,2],["fsdp","cp","tp"]]', []),
], ids=["fsdp4_tp2", "fsdp2_cp2_tp2"])
def test_first_loss_is_ln2_and_8_devices_with_accumulation_equal_one_device(
        one_device, pairs, tmp_path, mesh, extra):
    """Through run_training.py: [[1,1]] and 8 devices with two accumulated micro-batches (and
    the communication profile on) give the same losses and held-out metrics, the first ln 2."""
    run_dir = tmp_path / "run"
    result = run_cli([*RUN, f"data.path={pairs}", f"model.mesh_shape={mesh}",
                      "training.gradient_accumulation_steps=2", *extra,
                      f"hydra.run.dir={run_dir}"],
                     cwd=tmp_path,
                     env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    whole, shard = (float(x) for x in
                    __import__("re").search(r"parameters: .* \(([\d.]+) MB fp32\); per device "
                                            r"([\d.]+) MB", log).groups())
    assert shard < whole / 3  # really sharded over 8 devices
    for key in ("loss", "chosen_reward", "rejected_reward", "margin", "eval_loss",
                "eval_margin", "eval_accuracy"):
        got, want = metrics(run_dir, key), metrics(one_device, key)
        assert sorted(got) == sorted(want), key
        if key == "eval_accuracy":  # at step 0 the policy is the reference: every margin is 0
            got.pop(0), want.pop(0)  # up to rounding (eval_margin's 1e-6), its sign is noise
        np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                                   rtol=1e-5, atol=1e-6, err_msg=key)
    for losses in (metrics(run_dir, "loss"), metrics(one_device, "loss")):
        assert losses[1] == pytest.approx(math.log(2), abs=1e-6)
        assert losses[STEPS] < losses[1]
    if extra:
        assert list((run_dir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_precomputed_reference_and_resume_give_the_live_runs_losses(pairs, tmp_path):
    """In one process on [[8,1]]: the precomputed reference's losses are the live reference's;
    the live run restarted from its checkpoint of step 2 repeats steps 3 and 4 bit for bit."""
    import shutil

    from tunix_train.dpo import trainer as dpo_trainer

    run = [*RUN, f"data.path={pairs}", 'model.mesh_shape=[[8,1],["fsdp","tp"]]',
           "checkpoint.every_steps=2", "checkpoint.async_save=false"]
    dpo_trainer.run(compose_config(*run), tmp_path / "live")
    dpo_trainer.run(compose_config(*run, "dpo.precompute_reference=true"), tmp_path / "pre")
    live, pre = metrics(tmp_path / "live", "loss"), metrics(tmp_path / "pre", "loss")
    np.testing.assert_allclose(list(pre.values()), list(live.values()), rtol=1e-6)
    shutil.copytree(tmp_path / "live", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / str(STEPS))
    summary = dpo_trainer.run(compose_config(*run), tmp_path / "resumed")
    assert summary["final_step"] == STEPS
    for key in ("loss", "margin", "accuracy", "grad_norm"):
        got = [r for r in map(json.loads, (tmp_path / "resumed" / "metrics.jsonl").read_text(
        ).splitlines()) if key in r][-2:]  # the restarted run's steps 3 and 4
        want = metrics(tmp_path / "live", key)
        assert [(r["step"], r[key]) for r in got] == [(s, want[s]) for s in (3, 4)], key


def test_the_reference_model_is_counted_and_lora_or_precomputing_holds_none():
    """The start-up report and the planner add the reference to the compiled step's memory: a
    copy of the weights in the compute dtype sharded like the policy, none with LoRA (the base,
    adapters off) or precomputed log-probs."""
    from tunix_train.dpo.trainer import DpoTask

    common = [*TINY, "model.num_layers=2", 'model.mesh_shape=[[2,1],["fsdp","tp"]]',
              "training.micro_batch_size=1", "training.mixed_precision=bf16"]
    base = [*common, "trainer=dpo", "data=preferences"]
    devices = jax.devices()[:2]
    plans = {}
    for name, extra in {"full": [], "lora": ["lora.rank=4"]}.items():
        cfg = compose_config(*base, *extra)
        setup = Setup.create(cfg, devices)
        plans[name] = setup, setup.analyse(setup.compile_train_step(*DpoTask.loss(cfg)))
    setup, full = plans["full"]
    weights_bf16 = sum(
        math.prod(s.shard_shape(a.shape)) * 2 for a, s in
        zip(jax.tree.leaves(setup.params.abstract), jax.tree.leaves(setup.params.shardings)))
    assert full.per_device_bytes["reference"] == weights_bf16 > 0
    assert "reference model (dpo)" in "\n".join(full.memory_lines())
    steps_total = full.xla_memory["arguments"] + full.xla_memory["outputs"] - \
        full.xla_memory["aliased"] + full.xla_memory["temp"]
    assert full.per_device_bytes["total"] == steps_total + weights_bf16
    held, line = reference.memory(Setup.create(compose_config(
        *base, "dpo.precompute_reference=true"), devices))
    assert held == 0 and "dpo.precompute_reference=true" in line
    lora = plans["lora"][1]
    assert lora.per_device_bytes["reference"] == 0
    assert "LoRA: the frozen base" in "\n".join(lora.memory_lines())
    # LoRA's DPO step takes what LoRA's next-token step takes, plus the batch's reference
    # log-probs: no second model among its arguments
    sft = Setup.create(compose_config(*common, "lora.rank=4"), devices)
    sft_arguments = sft.analyse(sft.compile_train_step()).xla_memory["arguments"]
    b = sft.batch
    ref_logps = b.accum * b.rows * b.seq_len * 4 // sft.options.sync.fsdp
    assert lora.xla_memory["arguments"] == sft_arguments + ref_logps


def test_dpo_with_lora_starts_at_ln2_and_learns(pairs, tmp_path):
    """With LoRA the reference is the base with the adapters off: step 0 is ln 2 (B = 0), and
    only the adapters move the held-out margin, measured on 32 pairs (on 8, its sign after 4
    steps was noise: -0.023 on Python 3.12's standard library, which the pairs' words come
    from, against +0.046 on 3.11's; on 32, +0.078 and +0.044)."""
    from tunix_train.dpo import trainer as dpo_trainer

    dpo_trainer.run(compose_config(*RUN, f"data.path={pairs}", "lora.rank=4", "optimizer.lr=1e-2",
                                   'model.mesh_shape=[[4,2],["fsdp","tp"]]',
                                   "data.eval_batches=4"), tmp_path)
    loss, margin = metrics(tmp_path, "loss"), metrics(tmp_path, "eval_margin")
    assert loss[1] == pytest.approx(math.log(2), abs=1e-6) and loss[STEPS] < loss[1]
    assert margin[0] == 0 and margin[STEPS] > 0


def test_dpo_on_a_mixture_of_experts_starts_at_ln2_and_learns(pairs, tmp_path):
    """qwen3_moe's tiny model through the same trainer on fsdp 4 x tp 2 (DPO's objective is the
    pairs' log-probabilities; the router's losses are not added to it): ln 2 at step 0, then
    the held-out margin rises (more slowly than a dense model's: 12 steps)."""
    from tunix_train.dpo import trainer as dpo_trainer

    dpo_trainer.run(compose_config(*RUN, f"data.path={pairs}",
                                   'model.mesh_shape=[[4,2],["fsdp","tp"]]', "training.steps=12",
                                   "training.eval_every_steps=4", *FAMILY_MODELS["qwen3_moe"]),
                    tmp_path)
    loss, margin = metrics(tmp_path, "loss"), metrics(tmp_path, "eval_margin")
    assert loss[1] == pytest.approx(math.log(2), abs=1e-6) and loss[12] < loss[1]
    assert margin[0] == 0 and margin[12] > margin[8] > margin[4], margin
    assert margin[12] > 0
