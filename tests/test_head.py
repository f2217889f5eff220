"""The fused, chunked output head + cross-entropy (models/head.py) against the unchunked formula:
losses and gradients, on their own and through the real train step with packed documents, and
the memory it saves in the compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import ONE_STACK, compose_config, mesh_arg
from tunix_train.models.head import VocabChunks, token_losses
from tunix_train.training.setup import Setup


def reference_losses(x_TxD, table_VxD, targets_T):
    """log Σ exp(x·tableᵀ) − x·table[target], the whole fp32 logits at once."""
    logits = x_TxD @ table_VxD.T
    return jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(
        logits, targets_T[:, None], axis=1)[:, 0]


@pytest.mark.parametrize("count,shards", [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (3, 4)])
def test_chunked_losses_and_gradients_equal_the_whole_logits(count, shards):
    vocab, dim, tokens = 96, 16, 40
    kx, kt, ky, kw = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (tokens, dim), jnp.float32)
    table = jax.random.normal(kt, (vocab, dim), jnp.float32)
    targets = jax.random.randint(ky, (tokens,), 0, vocab)
    weights = (jax.random.uniform(kw, (tokens,)) > 0.3).astype(jnp.float32)  # masked tokens

    def loss(fn, x, table):
        return jnp.sum(fn(x, table) * weights)

    chunks = VocabChunks(count, shards)
    ours = lambda a, b: token_losses(a, b, targets, chunks)  # noqa: E731
    theirs = lambda a, b: reference_losses(a, b, targets)  # noqa: E731

    def value_and_grads(fn):  # one program, as in a train step, not op by op
        return jax.jit(jax.value_and_grad(lambda x, t: loss(fn, x, t), argnums=(0, 1)))(x, table)

    got, want = value_and_grads(ours), value_and_grads(theirs)
    np.testing.assert_allclose(jax.jit(ours)(x, table), jax.jit(theirs)(x, table), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):  # 1e-5 relative to the gradient's scale
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def first_step(*overrides: str):
    """Loss and parameter gradient norm of the real step on packed, padded documents."""
    cfg = compose_config(*ONE_STACK, "data.packing=first_fit", "training.micro_batch_size=2",
                         *overrides)
    setup = Setup.create(cfg)
    data = setup.open_data()
    batch = next(data.train)
    assert float(jnp.min(batch["weights"])) == 0.0  # padding and document ends are masked
    state, metrics = setup.train_step()(setup.fresh_state(), batch)
    data.close()
    return float(metrics["loss"]), float(metrics["grad_norm"]), state


def test_the_train_step_gives_the_same_loss_and_update_for_any_chunking():
    """On fsdp 2 × tp 4, where the vocabulary is also split over tp (chunks of each shard)."""
    mesh = (2, 4)
    whole = first_step(mesh_arg(*mesh), "training.loss_vocab_chunk=512")
    for chunk in (128,):  # 4 chunks of each tp shard's 128 rows (several sizes: see above)
        got = first_step(mesh_arg(*mesh), f"training.loss_vocab_chunk={chunk}")
        np.testing.assert_allclose(got[:2], whole[:2], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(got[2]["params"]), jax.tree.leaves(whole[2]["params"])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_chunking_saves_at_least_the_fp32_logits_in_compiled_temporaries():
    def temporaries(chunk: int) -> int:
        cfg = compose_config(*ONE_STACK, mesh_arg(1, 1), "model.vocab_size=4096",
                             "training.micro_batch_size=8", f"training.loss_vocab_chunk={chunk}")
        setup = Setup.create(cfg, jax.devices()[:1])
        memory = setup.compile_train_step().memory_analysis()
        return memory.temp_size_in_bytes

    tokens, vocab = 8 * 32, 4096
    logits_fp32 = tokens * vocab * 4
    assert temporaries(4096) - temporaries(512) >= logits_fp32


def test_the_attention_path_is_logged_once_and_a_refusal_is_a_warning(caplog, monkeypatch):
    from tunix_train.models import attention as attention_lib
    from tunix_train.models import gemma3

    cfg = compose_config(*ONE_STACK)
    setup = Setup.create(cfg, jax.devices()[:1])
    batch = setup.random_batch()
    monkeypatch.setattr(attention_lib, "_REPORTED", set())
    with caplog.at_level("INFO", logger="tunix_train"):
        for _ in range(2):  # two traces, one line
            jax.jit(setup.train_step()).lower(setup.fresh_state(), batch)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")]
    assert lines == ["attention: XLA, [B, N, L, L] scores (model.attention_impl=auto on cpu: "
                     "cuDNN needs a GPU; 32 tokens < 256 at head dim 16)"]

    # What a GPU whose cuDNN refuses the call sees: here cuDNN refuses on the CPU itself.
    caplog.clear()
    monkeypatch.setattr(attention_lib.jax, "default_backend", lambda: "gpu")
    attention = attention_lib.Attention(cfg.model, nnx.Rngs(0), gemma3.FAMILY.architecture)
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with caplog.at_level("INFO", logger="tunix_train"):
        out = attention._attention(q, q, q, None, None)
    assert out.shape == q.shape
    [warning] = [r for r in caplog.records if r.getMessage().startswith("attention:")]
    assert warning.levelname == "WARNING" and "cuDNN refused this call (" in warning.getMessage()
    assert warning.getMessage().endswith("using the xla attention")  # 8 tokens: dense


def test_a_cudnn_failure_at_compile_time_makes_auto_compile_again_without_it(caplog,
                                                                             monkeypatch):
    """On a GPU cuDNN can accept a call while tracing and fail when XLA compiles its kernel.
    Here a GPU's choice (cuDNN, taken while tracing, stood in for by the dense computation)
    meets an injected cuDNN error from the first compile: the step is traced and compiled
    again without cuDNN, with one warning, and later traces keep away from it; any other
    compile error is raised as it is."""
    from tunix_train.models import attention as attention_lib

    setup = Setup.create(compose_config(*ONE_STACK, "training.mixed_precision=bf16"),
                         jax.devices()[:1])
    monkeypatch.setattr(attention_lib.backend, "is_gpu", lambda: True)
    monkeypatch.setattr(attention_lib, "_CUDNN_FAILED", [])
    monkeypatch.setattr(attention_lib, "_REPORTED", set())
    traced = []  # cudnn=True/False, per attention call traced
    library = attention_lib.Attention._library

    def stand_in(self, q, k, v, segment_ids, window, cudnn):
        traced.append(cudnn)
        return library(self, q, k, v, segment_ids, window, cudnn=False)

    compile_, failed_after = jax.stages.Lowered.compile, []

    def failing_once(self, *args, **kwargs):
        if not failed_after:
            failed_after.append(len(traced))
            raise RuntimeError("INTERNAL: cuDNN: no valid execution plan for the fused attention "
                               "(injected)\nmore detail")
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(attention_lib.Attention, "_library", stand_in)
    monkeypatch.setattr(jax.stages.Lowered, "compile", failing_once)
    with caplog.at_level("INFO", logger="tunix_train"):
        compiled = setup.compile_train_step()
    first = failed_after[0]
    assert first and all(traced[:first]) and traced[first:] and not any(traced[first:])
    said = [r for r in caplog.records if r.getMessage().startswith("attention:")]
    assert [r.levelname for r in said].count("WARNING") == 1
    assert ("attention: cuDNN's fused attention failed to compile (INTERNAL: cuDNN: no valid "
            "execution plan for the fused attention (injected)); compiling again without it") in \
        [r.getMessage() for r in said if r.levelname == "WARNING"][0]
    assert any("cuDNN's attention failed to compile in this process" in r.getMessage()
               for r in said)
    batch = {k: jnp.ones(x.shape, x.dtype) for k, x in setup.abstract_batch().items()}
    _, metrics = compiled(setup.fresh_state(), batch)
    assert np.isfinite(float(metrics["loss"]))

    monkeypatch.setattr(attention_lib, "_CUDNN_FAILED", [])
    failed_after.clear()
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: (_ for _ in ()).throw(
        RuntimeError("INTERNAL: out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        setup.compile_train_step()
    assert not attention_lib._CUDNN_FAILED
