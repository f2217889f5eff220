"""GRPO (`trainer=grpo`): formulas against NumPy, rollouts against teacher forcing, meshes against
each other, learning against a control run, resume against the uninterrupted run, bad input."""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (REPO, FAMILY_MODELS, ONE_STACK, cli_env, compose_config, family_tiny,
                     run_cli, sigterm_when_paused)
from tunix_train import starting_weights
from tunix_train.data import demo
from tunix_train.data import tokenizer as tokenizer_lib
from tunix_train.grpo import objective as objective_lib
from tunix_train.grpo.prompts import read_prompts
from tunix_train.models import families
from tunix_train.grpo.rewards import Rewards
from tunix_train.grpo.rollouts import RolloutMaker
from tunix_train.parallel import fsdp
from tunix_train.parallel.sharding import activate, on_devices, per_shard_rules
from tunix_train.training.reference import scorer as reference_scorer
from tunix_train.training import train_step
from tunix_train.training.setup import Setup

# ---------------------------------------------------------------------------------------------
# The formulas, against plain NumPy loops written from the definitions.


def numpy_advantages(rewards, kind):
    out = np.zeros_like(rewards, dtype=np.float64)
    for p, group in enumerate(rewards):
        for i, r in enumerate(group):
            mean = sum(group) / len(group)
            if kind == "grpo":
                std = (sum((x - mean) ** 2 for x in group) / len(group)) ** 0.5
                out[p, i] = (r - mean) / (std + 1e-6)
            elif kind == "dr_grpo":
                out[p, i] = r - mean
            else:
                others = [x for j, x in enumerate(group) if j != i]
                out[p, i] = r - sum(others) / len(others)
    return out


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_advantages_equal_numpy(kind):
    rewards = np.random.default_rng(0).integers(0, 3, size=(5, 4)).astype(np.float32)
    rewards[0] = 1.0  # a group without spread: no advantage at all
    got = objective_lib.advantages(rewards, kind)
    np.testing.assert_allclose(got, numpy_advantages(rewards, kind), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0], 0.0)


def numpy_loss(logp, old, ref, adv, mask, eps, eps_high, beta, estimator, aggregation):
    """Per-token terms and the aggregated loss, one token at a time."""
    rows, total, count, policy_sum, kl_sum = len(logp), 0.0, 0.0, 0.0, 0.0
    for i in range(rows):
        n = mask[i].sum()
        seq_loss = seq_policy = seq_kl = 0.0
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            ratio = np.exp(logp[i, t] - old[i, t])
            clipped = min(max(ratio, 1 - eps), 1 + eps_high)
            policy = max(-adv[i] * ratio, -adv[i] * clipped)
            delta = ref[i, t] - logp[i, t]
            kl = np.exp(delta) - delta - 1 if estimator == "k3" else -delta
            seq_loss += policy + beta * kl
            seq_policy += policy
            seq_kl += kl
        if aggregation == "token-mean":
            total, count = total + seq_loss, count + n
            policy_sum, kl_sum = policy_sum + seq_policy, kl_sum + seq_kl
        elif n:
            total, count = total + seq_loss / n, count + 1
            policy_sum, kl_sum = policy_sum + seq_policy / n, kl_sum + seq_kl / n
    return total / count, policy_sum / count, kl_sum / count


def loss_inputs():
    rng = np.random.default_rng(1)
    rows, length = 6, 9
    logp = rng.normal(-2.0, 0.5, (rows, length))
    old = logp + rng.normal(0.0, 0.6, (rows, length))  # ratios well outside [0.8, 1.2] too
    ref = logp + rng.normal(0.0, 0.3, (rows, length))
    adv = np.array([1.5, -0.7, 0.0, 2.0, -1.2, -0.3])
    lengths = [9, 6, 1, 7, 0, 8]  # uneven, one empty (all padding)
    mask = (np.arange(length)[None] < np.array(lengths)[:, None]).astype(np.float32)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("estimator", ["k3", "k1"])
@pytest.mark.parametrize("aggregation", ["sequence-mean-token-mean", "token-mean"])
def test_per_token_loss_kl_and_aggregation_equal_numpy(estimator, aggregation):
    logp, old, ref, adv, mask = loss_inputs()
    objective = objective_lib.Objective(epsilon=0.2, epsilon_high=0.28, beta=0.04,
                                        kl_estimator=estimator, temperature=1.0)
    adv_tokens = np.broadcast_to(adv[:, None], logp.shape)
    terms = objective.terms(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref),
                            jnp.asarray(adv_tokens))
    # The fixture clips tokens on both sides, with both signs of advantage.
    ratio = np.exp(logp - old)
    clipped = np.asarray(terms["clipped"]) * mask
    assert clipped[(ratio > 1.28) & (adv_tokens > 0)].any()
    assert clipped[(ratio < 0.8) & (adv_tokens < 0)].any()
    w = objective_lib.token_weights(mask, aggregation)
    got = [float(jnp.sum(w * terms[k]) / np.sum(w)) for k in ("loss", "policy", "kl")]
    want = numpy_loss(logp, old, ref, adv, mask, 0.2, 0.28, 0.04, estimator, aggregation)
    np.testing.assert_allclose(got, want, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Rollouts and the sharded update, on a tiny model.

GEMMA_TURN = families.FAMILIES["gemma3"].chat_turn

@pytest.fixture(scope="module")
def sums(tmp_path_factory) -> Path:
    """docs/grpo.md's demo_data/grpo/ folder."""
    return demo.write_sums(tmp_path_factory.mktemp("demo_data"))


def grpo_config(sums: Path, mesh: str, *extra: str):
    """GRPO's own mechanics on the one-stack Gemma 3 (helpers.ONE_STACK). Gemma's three layer
    kinds are sampled in the laptop example and in test_generate.py (the sampler against full
    recomputation)."""
    return compose_config(
        *ONE_STACK, "trainer=grpo", "data=prompts", f"data.path={sums / 'sums.jsonl'}",
        "data.seq_len=16", "grpo.max_new_tokens=4", "training.global_batch_size=16",
        "grpo.num_generations=4", "grpo.temperature=0.7", "grpo.top_k=8", "grpo.beta=0.04",
        "training.gradient_accumulation_steps=2", f"model.mesh_shape={mesh}", *extra)


def rollouts_on(sums: Path, mesh: str, devices: int, *extra: str):
    cfg = grpo_config(sums, mesh, *extra)
    setup = Setup.create(cfg, jax.devices()[:devices])
    tokenizer = tokenizer_lib.open_tokenizer("byte")
    prompts = read_prompts(cfg.data, tokenizer, 12, GEMMA_TURN)
    maker = RolloutMaker(setup, cfg.grpo, tokenizer, Rewards.create(cfg.grpo, prompts[0].fields))
    policy = starting_weights.initial_params(setup.params, 0)
    return setup, maker, maker.make(policy, prompts[:4], jax.random.key(1)), policy


# Mixtral: a mixture of experts routes each sampled token as teacher forcing routes it.
@pytest.mark.parametrize("mesh,devices,family", [
    ("[[1,1],[fsdp,tp]]", 1, None), ("[[2,2],[fsdp,tp]]", 4, None),
    ("[[2,2,2],[fsdp,cp,tp]]", 8, None), ("[[2,2],[fsdp,tp]]", 4, "mixtral")])
def test_the_samplers_log_probs_are_the_tempered_policy_scored_by_teacher_forcing(sums, mesh,
                                                                                    devices,
                                                                                    family):
    setup, maker, r, policy = rollouts_on(sums, mesh, devices,
                                          *FAMILY_MODELS.get(family, []))
    batch = maker.update_batch(r, "token-mean")
    scored = np.asarray(reference_scorer(setup, 0.7)(
        policy, on_devices(batch, setup.batch_sharding)))
    mask = batch["completion_mask"] > 0
    assert mask.sum() == r.counts.sum() > 0
    np.testing.assert_allclose(scored[mask], batch["old_logps"][mask], rtol=1e-4, atol=2e-5)


def gradients(setup: Setup, batch: dict, params) -> tuple:
    """GRPO's loss and gradients as the train step computes them (fsdp.accumulated_gradients)."""
    options = setup.options
    loss_fn = functools.partial(objective_lib.loss_sums,
                                objective_lib.Objective.of(setup.cfg.grpo),
                                setup.params.graphdef, vocab_chunks=options.vocab_chunks)

    @jax.jit
    def compute(params, batch):
        with activate(options.mesh, per_shard_rules(options.rules)):
            grads, loss, sums = fsdp.accumulated_gradients(
                options.sync, loss_fn, params, train_step.in_cp_order(batch, options.mesh))
        return jax.tree.map(lambda g: g / sums["tokens"], grads), loss / sums["tokens"], sums

    return jax.device_get(compute(params, batch))


def test_given_the_same_rollouts_loss_and_gradients_agree_on_every_mesh(sums):
    """One device against fsdp × tp and against sequences split over cp (the update step's
    per-token terms summed over each device's own tokens, the reference scored in cp order)."""
    one, maker, r, _ = rollouts_on(sums, "[[1,1],[fsdp,tp]]", 1)
    host = maker.update_batch(r, "sequence-mean-token-mean")
    # Fixed inputs that exercise every term: advantages of both signs (an untrained model earns
    # no reward) and old log-probabilities away from the policy's (ratios beyond the clip).
    rng = np.random.default_rng(0)
    mask = host["completion_mask"]
    host["advantages"] = np.broadcast_to(rng.normal(size=mask.shape[:2] + (1,)),
                                         mask.shape).astype(np.float32)
    host["old_logps"] = (host["old_logps"] + rng.normal(0, 0.4, mask.shape) * mask
                         ).astype(np.float32)
    results = []
    for mesh, devices in (("[[1,1],[fsdp,tp]]", 1), ("[[2,2],[fsdp,tp]]", 4),
                          ("[[1,4,2],[fsdp,cp,tp]]", 8)):
        setup = Setup.create(grpo_config(sums, mesh), jax.devices()[:devices])
        # Another policy than the one that sampled and a third as the reference (non-zero KL).
        params = starting_weights.initial_params(setup.params, 2)
        batch = on_devices(host, setup.batch_sharding)
        reference = starting_weights.initial_params(setup.params, 3)
        batch["ref_logps"] = reference_scorer(setup, 0.7)(reference, batch)
        results.append(gradients(setup, batch, params))
    (g1, loss1, sums1), *others = results
    assert sums1["clipped"] > 0 and sums1["kl"] > 0
    for g2, loss2, sums2 in others:
        np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
        for key in sums1:
            np.testing.assert_allclose(sums2[key], sums1[key], rtol=1e-5, err_msg=key)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):  # relative error of each
            assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a), \
                np.linalg.norm(b - a) / np.linalg.norm(a)


def test_parquet_prompts_equal_json_lines_and_the_chat_template_wraps_them(sums):
    tokenizer = tokenizer_lib.open_tokenizer("byte")
    cfg = grpo_config(sums, "[[1,1],[fsdp,tp]]")
    jsonl = read_prompts(cfg.data, tokenizer, 12, GEMMA_TURN)
    cfg.data.path = str(sums / "sums.parquet")
    parquet = read_prompts(cfg.data, tokenizer, 12, GEMMA_TURN)
    assert len(jsonl) == 100 and jsonl[7].fields == {"answer": str(int(jsonl[7].text[0]) +
                                                                  int(jsonl[7].text[2]))}
    assert [(p.text, p.ids, p.fields) for p in parquet] == [(p.text, p.ids, p.fields)
                                                            for p in jsonl]
    cfg.data.chat_template = True
    wrapped = read_prompts(cfg.data, tokenizer, 64, GEMMA_TURN)
    assert wrapped[0].ids[0] == tokenizer.bos_id and wrapped[0].text == jsonl[0].text
    assert tokenizer.decode(wrapped[0].ids[1:]) == (
        f"<start_of_turn>user\n{jsonl[0].text}<end_of_turn>\n<start_of_turn>model\n")
    # Each family's own: Llama 3's header tokens, Qwen 3's ChatML.
    assert families.FAMILIES["llama3"].chat_turn.format(prompt="1+2=") == (
        "<|start_header_id|>user<|end_header_id|>\n\n1+2=<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert families.FAMILIES["qwen3"].chat_turn.format(prompt="1+2=") == (
        "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n")


def test_reward_functions_by_name_weights_and_import_path(sums):
    cfg = grpo_config(sums, "[[1,1],[fsdp,tp]]", "grpo.rewards=[answer,format,length,"
                      "grpo_rewards:starts_with_a_digit]", "grpo.reward_weights=[1,0.5,1,2]",
                      "grpo.format_pattern='\\d+'", "grpo.answer_pattern='^(\\d+)'",
                      "grpo.length_buffer=2")
    sys.path.insert(0, str(REPO / "tests"))
    rewards = Rewards.create(cfg.grpo, {"answer": "7"})
    total, each = rewards(["3+4="] * 4, ["7", "7 apples", "x", "12"], [2, 4, 3, 4],
                          {"answer": ["7", "7", "7", "12.0"]})
    np.testing.assert_array_equal(each["answer"], [1, 1, 0, 1])
    np.testing.assert_array_equal(each["format"], [1, 0, 0, 1])
    np.testing.assert_array_equal(each["length"], [0, -1, -0.5, -1])  # ramp over tokens 2..4
    np.testing.assert_array_equal(each["grpo_rewards:starts_with_a_digit"], [1, 1, 0, 1])
    np.testing.assert_allclose(total, [1 + 0.5 + 0 + 2, 1 + 0 - 1 + 2, 0 + 0 - 0.5 + 0,
                                       1 + 0.5 - 1 + 2])


# ---------------------------------------------------------------------------------------------
# Through run_training.py: it learns, it resumes, it refuses bad input.

@pytest.fixture(scope="module")
def laptop(tmp_path_factory):
    """docs/grpo.md's laptop example up to its GRPO command, as typed from a fresh copy of the
    repository (tests/typed_docs.py): the demo data, then the SFT run into outputs/sums-sft."""
    from typed_docs import Typed, ok, page_commands

    demo_command, sft_command, grpo_command = page_commands("docs/grpo.md")[:3]
    typed = Typed(tmp_path_factory.mktemp("typed") / "tunix_train")
    ok(typed.run(demo_command))
    ok(typed.run(sft_command, many_steps=True))
    return typed, grpo_command


def grpo_words(grpo_command: str, *extra: str) -> list[str]:
    """The page's GRPO overrides (its relative paths hold in the typed copy) but its run dir (each
    test has its own), then `extra`."""
    from test_docs import split_command

    words = [w for w in split_command(grpo_command)[1] if not w.startswith("hydra.run.dir=")]
    return [*words, "logging.every_steps=1", *extra]


def metrics(run_dir: Path, key: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in lines if key in r}


def test_the_laptop_example_learns_and_beats_a_control_run_with_lr_0(laptop):
    """The page's GRPO command as typed, and again with optimizer.lr=0 appended, for as many
    steps as the window the two are compared over (with lr=0 the policy, and so the expected
    reward, stays where it started: any window of the control measures it)."""
    from typed_docs import ok

    from typed_docs import page_commands

    typed, grpo_command = laptop
    window = 12
    rewards, outputs = {}, {}
    for control in (False, True):  # the trained run exactly as typed: outputs/sums-grpo
        run_dir = "outputs/grpo-control" if control else "outputs/sums-grpo"
        outputs[control] = ok(typed.run(grpo_command, *(
            [f"training.steps={window}", "optimizer.lr=0", f"hydra.run.dir={run_dir}"]
            if control else []), many_steps=True))
        assert "reward" in outputs[control]  # the logged line shows it
        rewards[control] = np.array(list(metrics(typed.root / run_dir, "reward_mean").values()))
    # The figures the page shows are the ones its commands print.
    page = (REPO / "docs" / "grpo.md").read_text()
    shown_line = re.search(r"    (step 48/48 \| .*?) \| …", page).group(1)
    assert shown_line in outputs[False]
    [check] = page_commands("docs/grpo.md", "python -c")
    printed = ok(typed.run(check)).strip()
    assert f"prints `{printed}`" in " ".join(page.split())
    trained, control = rewards[False], rewards[True]
    assert len(trained) >= 4 * window and len(control) == window
    # Both runs see the same prompts in the same order and sample with the same keys: the first
    # step is the same policy's.
    assert trained[0] == control[0]
    first, last = trained[:window].mean(), trained[-window:].mean()
    assert last > first + 0.1, (first, last)
    assert last > control.mean() + 0.07, (last, control.mean())
    # Every step logged: each one's time covers its own rollouts and updates (the last one's
    # too, which is reported right after the one before it).
    times = {key: metrics(typed.root / "outputs/sums-grpo", key)
             for key in ("step_time_s", "rollout_s", "update_s")}
    assert all(times["step_time_s"][s] >= times["rollout_s"][s] + times["update_s"][s]
               for s in times["step_time_s"]), times


def test_sigterm_then_restart_gives_the_uninterrupted_runs_losses(laptop, tmp_path):
    typed, grpo_command = laptop
    steps = ["training.steps=5", "grpo.num_iterations=2", "training.gradient_accumulation_steps=2",
             "checkpoint.every_steps=0"]
    reference = tmp_path / "reference"
    args = lambda run_dir: grpo_words(grpo_command, *steps, f"hydra.run.dir={run_dir}")  # noqa: E731
    result = run_cli(args(reference), cwd=typed.root)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    sigterm_when_paused(args(run_dir), typed.root, 2)
    assert max(metrics(run_dir, "loss")) == 2
    result = run_cli(args(run_dir), cwd=typed.root)
    assert result.returncode == 0 and "resuming from step 2" in result.stdout + result.stderr
    for key in ("loss", "reward_mean", "kl", "clip_fraction"):
        got, want = metrics(run_dir, key), metrics(reference, key)
        assert [got[s] for s in (3, 4, 5)] == [want[s] for s in (3, 4, 5)], key


BAD = {
    "data.prompt_field=question": "data.prompt_field: ",
    "grpo.rewards=[nosuch]": "neither a built-in reward",
    "grpo.rewards=[grpo_rewards:raises]": "grpo_rewards:raises raised KeyError",
    "grpo.rewards=[grpo_rewards:one_value_too_few]": "returned 0 values for 1 completions",
    "grpo.num_generations=1": "grpo.num_generations=1 is out of range",
    "training.global_batch_size=60": "grpo.num_generations=8 does not divide the 60 completions",
}


def test_bad_input_is_one_sentence_and_a_nonzero_exit(sums, tmp_path):
    """Each through run_training.py's own entry point, in one process
    (tests/bad_values_worker.py), before anything compiles."""
    base = ["trainer=grpo", "data=prompts", f"data.path={sums / 'sums.jsonl'}",
            "grpo.num_generations=8", "training.global_batch_size=64"]
    runs = [[*base, override] for override in BAD]
    env = cli_env({"PYTHONPATH": os.pathsep.join([str(REPO / "tests"),
                                                  os.environ.get("PYTHONPATH", "")])})
    result = subprocess.run([sys.executable, str(REPO / "tests" / "bad_values_worker.py"),
                             json.dumps([str(tmp_path), runs])], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for (override, expected), line in zip(BAD.items(), result.stdout.splitlines()):
        run = json.loads(line)
        assert run["code"] == 2, (override, run["stderr"][-2000:])
        [message] = run["stderr"].strip().splitlines()
        assert expected in message, (override, message)
        # Refused before compiling anything: nothing on the console, no run dir left.
        assert "compil" not in run["stdout"] and not run["run_dir_left"]


def test_two_processes_through_the_launcher(laptop):
    """fsdp 2 × tp 2 over two processes of two devices: rollouts, rewards and updates agree
    across processes (process 0's rewards are everyone's), and the run finishes and saves,
    its communication profile traced."""
    from test_launch import devices_env, launch

    typed, grpo_command = laptop
    args = grpo_words(grpo_command, "training.steps=2", "model.mesh_shape=[[2,2],[fsdp,tp]]",
                      "training.profile_communication=true")
    proc = launch(args, typed.root, devices_env(2))
    output = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, output[-4000:]
    [run_dir] = [p for p in (typed.root / "outputs" / "tunix-grpo").glob("*/*") if p.is_dir()]
    assert "tunix-grpo" in str(run_dir)  # trainer=grpo's own experiment name
    rewards = metrics(run_dir, "reward_mean")
    assert sorted(rewards) == [1, 2] and all(np.isfinite(list(metrics(run_dir, "loss").values())))
    # training.profile_communication means under GRPO what it means for pre-training
    assert list((run_dir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert (run_dir / "checkpoints" / "2").is_dir()


def test_grpo_on_sequences_split_over_cp_follows_the_run_without_cp(sums, tmp_path):
    """fsdp 4 × tp 2 against fsdp 2 × cp 2 × tp 2 (ZeRO over fsdp × cp, 2 micro-batches), 3
    steps of the whole loop: the same rollouts (cp devices decode their group's rows whole), the
    reference scored and the policy updated on split sequences, so the same rewards, losses and
    KL."""
    from tunix_train.grpo import trainer as grpo_trainer

    def run(name: str, mesh: str) -> dict[str, np.ndarray]:
        grpo_trainer.run(grpo_config(sums, mesh, "training.steps=3", "logging.every_steps=1",
                                     "grpo.rewards=[grpo_rewards:odd_first_byte]"),
                         tmp_path / name)
        return {key: np.array(list(metrics(tmp_path / name, key).values()))
                for key in ("reward_mean", "loss", "kl", "clip_fraction")}

    fsdp, cp = run("fsdp", "[[4,1,2],[fsdp,cp,tp]]"), run("cp", "[[2,2,2],[fsdp,cp,tp]]")
    assert len(fsdp["loss"]) == 3 and fsdp["kl"][-1] > 0
    for key in fsdp:
        np.testing.assert_allclose(cp[key], fsdp[key], rtol=1e-4, atol=1e-6, err_msg=key)


# Gemma 3: the laptop example above. Qwen 3 with LoRA: GRPO trains adapters on the
# (whole-model) SFT run, its reference the base with the adapters off. (LoRA's own learning
# is test_lora's and test_dpo's.)
@pytest.mark.parametrize("family,lora", [("llama3", False), ("qwen3", True)])
def test_sft_then_grpo_learn_the_sums_on_each_familys_tiny_model(family, lora, sums, tmp_path):
    """docs/grpo.md's laptop recipe on another family: SFT's held-out loss falls far below the
    untrained model's, then GRPO's mean reward rises from its first dozen steps to its last."""
    from tunix_train.grpo import trainer as grpo_trainer
    from tunix_train.training import run as run_lib

    every = [*family_tiny(family), "model.mesh_shape=[[8,1],[fsdp,tp]]", "logging.every_steps=1"]
    adapters = ["lora.rank=16", "optimizer.lr=1e-2"] if lora else []
    sft = [*every, "data=sft", f"data.path={sums / 'sums_sft.jsonl'}", "data.seq_len=32",
           "training.steps=30", "training.global_batch_size=8"]
    run_lib.run(compose_config(*sft), tmp_path / "sft")
    held_out = list(metrics(tmp_path / "sft", "eval_loss").values())
    assert held_out[-1] < 0.3 * held_out[0], held_out
    grpo_trainer.run(compose_config(
        *every, *adapters, "trainer=grpo", "data=prompts", f"data.path={sums / 'sums.jsonl'}",
        "data.seq_len=16", "grpo.max_new_tokens=4", "grpo.rewards=[answer]",
        "grpo.answer_pattern='^(\\d+)'", "training.global_batch_size=64",
        "grpo.num_generations=8", "training.steps=48",
        f"checkpoint.init_params_from={tmp_path / 'sft'}"), tmp_path / "grpo")
    rewards = np.array(list(metrics(tmp_path / "grpo", "reward_mean").values()))
    assert len(rewards) == 48
    print(family, lora, "rewards", rewards[:12].mean(), rewards[-12:].mean())
    assert rewards[-12:].mean() > rewards[:12].mean() + 0.08, rewards
