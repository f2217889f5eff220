"""Import and export of Hugging Face Gemma 3 checkpoints, against `transformers` itself."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_reference
from helpers import compose_config, mesh_arg
from tunix_train import cli
from tunix_train.config import ConfigError
from tunix_train.export import export
from tunix_train.inference.sampler import Sampler, SamplingOptions
from tunix_train.models import hf_weights
from tunix_train.training.setup import Setup

SEQ = 40  # > sliding_window (8): local layers really slide


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tiny")
    return path, hf_reference.build(path)


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
    return np.asarray(nnx.merge(setup.params.graphdef, params)(jax.numpy.asarray(tokens)))


@pytest.fixture(scope="module")
def single_device(reference):
    return imported(reference[0])


def test_imported_model_matches_transformers_logits(reference, single_device, tokens):
    setup, params = single_device
    expected = hf_reference.logits(reference[1], tokens)
    assert np.abs(expected).max() > 1.0  # far from uniform: a wrong weight would show
    np.testing.assert_allclose(our_logits(setup, params, tokens), expected, atol=1e-4, rtol=0)


def test_blockwise_attention_matches_transformers_logits(reference):
    """200 tokens in 4 blocks of 64 (the last one padded), windows of 8: the blockwise path
    against transformers' own (eager) attention."""
    setup, params = imported(reference[0], 1, 1, "model.attention_impl=blockwise")
    tokens = np.random.default_rng(1).integers(0, 320, (2, 200))
    np.testing.assert_allclose(our_logits(setup, params, tokens),
                               hf_reference.logits(reference[1], tokens), atol=1e-4, rtol=0)


def test_dimensions_come_from_config_json(single_device):
    model = single_device[0].cfg.model
    assert (model.num_layers, model.embed_dim, model.num_heads, model.num_kv_heads) == (7, 64, 4, 2)
    assert (model.global_every, model.sliding_window, model.query_pre_attn_scalar) == (3, 8, 24)
    assert (model.local_rope_base, model.global_rope_base, model.global_rope_scale) == \
        (100.0, 10_000.0, 2.0)


def test_import_onto_2x4_is_sharded_and_matches_1x1(reference, single_device, tokens):
    setup, params = imported(reference[0], 2, 4)
    q = params["local_layers"]["attention"]["q"]  # [layers, D, N, H]: D over fsdp, N over tp
    assert tuple(q.sharding.spec)[1:3] == ("fsdp", "tp")
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], 32, 1, 16)}
    embedding = params["embedder"]["embedding"]
    assert embedding.addressable_shards[0].data.size == embedding.size // 8
    # fp32 sums in another order: 1e-5 relative, as every mesh comparison (one logit of ~1.5
    # differed by 1.0e-5 on some x86 CPUs, just past an absolute 1e-5).
    np.testing.assert_allclose(our_logits(setup, params, tokens),
                               our_logits(*single_device, tokens), atol=1e-5, rtol=1e-5)


def test_export_round_trip_loads_in_transformers_with_identical_logits(
        reference, single_device, tokens, tmp_path):
    from transformers import Gemma3ForCausalLM

    path, original = reference
    cfg = cli.compose([f"model.init_from=hf:{path}", mesh_arg(2, 4), "export.dtype=float32",
                       f"export.path={tmp_path}", "export.max_shard_gb=0.0002"])
    files = export(cfg)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    reloaded = Gemma3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
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
