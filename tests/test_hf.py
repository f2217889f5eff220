"""Import and export of Hugging Face checkpoints of every family, against `transformers`
itself: tiny random Gemma 3, Llama 3, Qwen 3, Qwen 3 MoE and Mixtral models
(tests/hf_reference.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_reference
from helpers import compose_config, jitted_forward, mesh_arg
from tunix_train import cli
from tunix_train.config import ConfigError
from tunix_train.export import export
from tunix_train.inference.sampler import Sampler, SamplingOptions
from tunix_train.models import hf_weights
from tunix_train.training.setup import Setup

SEQ = 40  # > Gemma's sliding_window (8) and Llama's original RoPE context (64) / 4 (16)
FAMILIES = list(hf_reference.FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def reference(tmp_path_factory, family):
    path = tmp_path_factory.mktemp(f"hf_{family}")
    return path, hf_reference.build(path, family=family)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 320, (2, SEQ))


def imported(path, fsdp=1, tp=1, *extra):
    """(setup, params) of the checkpoint at `path` on the first fsdp × tp devices."""
    cfg = cli.compose([f"model.init_from=hf:{path}", mesh_arg(fsdp, tp),
                       "training.mixed_precision=fp32", *extra])
    setup = Setup.create(cfg, jax.devices()[: fsdp * tp])
    params = hf_weights.load_init_from(cfg.model, setup.params.abstract,
                                       setup.params.shardings)
    return setup, params


def our_logits(setup, params, tokens):
    return np.asarray(jitted_forward(setup.params.graphdef, params)(jax.numpy.asarray(tokens)))


@pytest.fixture(scope="module")
def single_device(reference):
    return imported(reference[0])


def assert_logits_equal(ours, theirs):
    """fp32 logits of the same weights: 1e-5 relative to the largest logit (a sum of dozens of
    products in another order differs by a few ulps of it)."""
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, atol=1e-5 * scale, rtol=1e-5)


def test_imported_model_matches_transformers_logits(reference, single_device, tokens):
    setup, params = single_device
    expected = hf_reference.logits(reference[1], tokens)
    assert np.abs(expected).max() > 1.0  # far from uniform: a wrong weight would show
    assert_logits_equal(our_logits(setup, params, tokens), expected)


def test_blockwise_attention_matches_transformers_logits(reference):
    """200 tokens in 4 blocks of 64 (the last one padded; Gemma's windows of 8): the blockwise
    path against transformers' own (eager) attention."""
    setup, params = imported(reference[0], 1, 1, "model.attention_impl=blockwise")
    tokens = np.random.default_rng(1).integers(0, 320, (2, 200))
    assert_logits_equal(our_logits(setup, params, tokens),
                        hf_reference.logits(reference[1], tokens))


def test_dimensions_come_from_config_json(family, single_device):
    model = single_device[0].cfg.model
    assert model.family == family
    assert (model.embed_dim, model.num_heads, model.num_kv_heads, model.head_dim) == (64, 4, 2, 16)
    if family == "gemma3":
        assert (model.num_layers, model.global_every, model.sliding_window,
                model.query_pre_attn_scalar) == (7, 3, 8, 24)
        assert (model.local_rope_base, model.global_rope_base, model.global_rope_scale) == \
            (100.0, 10_000.0, 2.0)
    elif family == "llama3":
        assert (model.num_layers, model.tie_embeddings, model.rms_norm_eps) == (3, False, 1e-5)
        assert (model.global_rope_base, model.global_rope_scale, model.rope_type,
                model.rope_low_freq_factor, model.rope_high_freq_factor,
                model.rope_original_context) == (500_000.0, 8.0, "llama3", 1.0, 4.0, 64)
    elif family == "qwen3":
        assert (model.num_layers, model.tie_embeddings, model.global_rope_base) == \
            (3, True, 1_000_000.0)
    elif family == "qwen3_moe":
        assert (model.num_layers, model.tie_embeddings, model.num_experts,
                model.experts_per_token, model.expert_hidden_dim, model.normalize_top_k,
                model.moe_every, model.router_aux_loss_coef) == \
            (3, False, 5, 2, 48, False, 2, 0.01)
    else:
        assert (model.num_layers, model.tie_embeddings, model.rms_norm_eps, model.num_experts,
                model.experts_per_token, model.expert_hidden_dim, model.normalize_top_k,
                model.moe_every, model.router_aux_loss_coef) == \
            (3, False, 1e-5, 5, 2, 48, True, 1, 0.02)


def test_import_onto_2x4_is_sharded_and_matches_1x1(family, reference, single_device, tokens):
    setup, params = imported(reference[0], 2, 4)
    stack = "local_layers" if "local_layers" in params else "layers"
    q = params[stack]["attention"]["q"]  # [layers, D, N, H]: D over fsdp, N over tp
    assert tuple(q.sharding.spec)[1:3] == ("fsdp", "tp")
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], 32, 1, 16)}
    embedding = params["embedder"]["embedding"]
    assert embedding.addressable_shards[0].data.size == embedding.size // 8
    if family in ("qwen3_moe", "mixtral"):  # [layers, experts, D, F]: D over fsdp, F over tp
        gate = params["layers"]["mlp"]["gate"]
        assert tuple(gate.sharding.spec) == (None, None, "fsdp", "tp")
        assert {s.data.shape for s in gate.addressable_shards} == {(gate.shape[0], 5, 32, 12)}
    # fp32 sums in another order: 1e-5 relative, as every mesh comparison (one logit of ~1.5
    # differed by 1.0e-5 on some x86 CPUs, just past an absolute 1e-5).
    np.testing.assert_allclose(our_logits(setup, params, tokens),
                               our_logits(*single_device, tokens), atol=1e-5, rtol=1e-5)


def test_export_round_trip_loads_in_transformers_with_identical_logits(
        family, reference, single_device, tokens, tmp_path):
    path, original = reference
    cfg = cli.compose([f"model.init_from=hf:{path}", mesh_arg(2, 4), "export.dtype=float32",
                       f"export.path={tmp_path}", "export.max_shard_gb=0.0002"])
    files = export(cfg)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    reloaded = hf_reference.model_class(family).from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_reference.logits(reloaded, tokens),
                                  hf_reference.logits(original, tokens))
    # The exported folder imports again as the same model.
    again, params = imported(tmp_path)
    np.testing.assert_allclose(our_logits(again, params, tokens),
                               our_logits(*single_device, tokens), atol=1e-6, rtol=0)


def _write_config(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_legacy_new_and_multimodal_config_styles_agree(reference, tmp_path):
    new_style = json.loads((reference[0] / "config.json").read_text())
    assert "rope_parameters" in new_style and "layer_types" in new_style
    legacy = {k: v for k, v in new_style.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=10_000.0, rope_local_base_freq=100.0, sliding_window_pattern=3,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    multimodal = {"model_type": "gemma3", "text_config": legacy}
    models = [cli.compose([f"model.init_from=hf:{_write_config(tmp_path / name, config)}"]).model
              for name, config in (("new", new_style), ("legacy", legacy),
                                   ("multimodal", multimodal))]
    fields = [{k: v for k, v in vars(m).items() if k not in ("name", "init_from")} for m in models]
    assert fields[0] == fields[1] == fields[2]


def test_released_4b_config_fills_gemma3_defaults(tmp_path):
    # What google/gemma-3-4b-pt's config.json says about its text model; the rest is default.
    released = {"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}}
    model = cli.compose([f"model.init_from=hf:{_write_config(tmp_path / 'g4b', released)}"]).model
    expected = compose_config("model=gemma3_4b").model
    for key in ("num_layers", "embed_dim", "hidden_dim", "num_heads", "num_kv_heads", "head_dim",
                "sliding_window", "global_every", "global_rope_scale", "global_rope_base"):
        assert getattr(model, key) == getattr(expected, key), key
    assert model.vocab_size == 262_208


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
@pytest.mark.parametrize("override,message", [
    ("model.num_layers=4", "model.num_layers=4 contradicts"),
    ("model=gemma3_1b", "model.embed_dim=1152 contradicts"),
])
def test_contradicting_override_is_a_clear_error(reference, override, message):
    with pytest.raises(ConfigError, match=message):
        cli.compose([f"model.init_from=hf:{reference[0]}", override])
    # Agreeing with the checkpoint is fine.
    cli.compose([f"model.init_from=hf:{reference[0]}", "model.num_layers=7"])


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json does not exist"):
        cli.compose([f"model.init_from=hf:{tmp_path}"])
    with pytest.raises(ConfigError, match="use hf:<folder"):
        cli.compose([f"model.init_from={tmp_path}"])


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_training_starts_from_the_imported_weights(reference, single_device):
    cfg = cli.compose([f"model.init_from=hf:{reference[0]}", mesh_arg(8, 1), "data.seq_len=32",
                       "training.mixed_precision=fp32"])
    setup = Setup.create(cfg)
    state = setup.fresh_state()
    expected = single_device[1]
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(state["step"]) == 0


def test_cached_greedy_generation_equals_transformers_generate(reference, single_device):
    setup, params = single_device
    sampler = Sampler(setup.params.graphdef, setup.params.shardings, SamplingOptions(20),
                      jnp.float32, setup.mesh, setup.params.rules.params)
    prompts = [[5, 6, 7, 100, 200, 33, 2, 9, 10, 11, 12], [300, 1]]  # one longer than the window
    got = sampler(params, prompts)
    assert len(set(got[0])) > 4  # not a degenerate repetition
    for prompt, row in zip(prompts, got):
        assert row == hf_reference.greedy(reference[1], prompt, 20)


def test_llama_legacy_and_new_rope_styles_agree(tmp_path):
    """`rope_theta` + `rope_scaling` (released Llama 3.1/3.2 checkpoints) and `rope_parameters`
    (newer transformers) describe the same model."""
    new_style = {"model_type": "llama", **{k: v for k, v in hf_reference.LLAMA.items()
                                           if k not in ("rope_theta", "rope_scaling")},
                 "rope_parameters": {"rope_theta": 500_000.0, **hf_reference.LLAMA["rope_scaling"]}}
    legacy = {"model_type": "llama", **hf_reference.LLAMA}
    models = [cli.compose([f"model.init_from=hf:{_write_config(tmp_path / name, config)}"]).model
              for name, config in (("new", new_style), ("legacy", legacy))]
    fields = [{k: v for k, v in vars(m).items() if k not in ("name", "init_from")} for m in models]
    assert fields[0] == fields[1] and fields[0]["rope_type"] == "llama3"


@pytest.mark.parametrize("config,message", [
    ({"model_type": "llama", "attention_bias": True}, "config.json has attention_bias=True, "
                                                      "which this Llama 3 implementation"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window=True, which this "
                                                          "Qwen 3 implementation"),
    ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0},
     "final_logit_softcapping=30.0, which this Gemma 3 implementation"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0]}, "mlp_only_layers=\\[0\\], which this "
                                                         "Qwen 3 MoE implementation"),
    ({"model_type": "mixtral", "router_jitter_noise": 0.01}, "router_jitter_noise=0.01, which "
                                                             "this Mixtral implementation"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "RoPE type 'yarn' is not supported"),
    ({"model_type": "mistral"}, "describes model_type 'mistral'; the supported ones are "
                                "gemma3_text, gemma3, llama, qwen3, qwen3_moe, mixtral"),
])
def test_an_unsupported_checkpoint_option_is_refused_by_name(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        cli.compose([f"model.init_from=hf:{_write_config(tmp_path / 'ckpt', config)}"])
