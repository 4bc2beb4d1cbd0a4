"""Finding checkpoints and reading config.json (nanoserve.common.checkpoint, torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.checkpoint import (
    DEMO_MODEL_DIR,
    DEMO_MODEL_NAME,
    ModelLoadError,
    load_generation_config_eos,
    load_generation_defaults,
    load_model_config,
    make_dummy_model_dir,
    resolve_checkpoint,
    resolve_tokenizer,
)
from nanoserve.common.config import ModelConfig


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ("qwen3", "qwen2", "llama")}


def copy_checkpoint(source: Path, target: Path, config_edit=None) -> Path:
    """A copy of `source` whose config.json is passed through `config_edit` first."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    if config_edit is not None:
        raw = json.loads((source / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(config_edit(raw)))
    return target


def to_transformers_4x(raw: dict) -> dict:
    """The same config as transformers 4.x writes it: rope_theta/rope_scaling, torch_dtype."""
    raw = dict(raw)
    rope = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    raw["torch_dtype"] = raw.pop("dtype")
    return raw


# --- config.json -----------------------------------------------------------------------------


def test_llama_config_values(checkpoints):
    config = load_model_config(checkpoints["llama"])
    assert config == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        torch_dtype="float32",
        eos_token_ids=(258,),
    )


def test_qwen_switches(checkpoints):
    qwen3 = load_model_config(checkpoints["qwen3"])
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.tie_word_embeddings) == (True, False, True)
    assert (qwen3.head_dim, qwen3.rope_scaling, qwen3.rope_theta) == (32, None, 10000.0)
    qwen2 = load_model_config(checkpoints["qwen2"])  # its config.json has no attention_bias key
    assert (qwen2.qk_norm, qwen2.attention_bias) == (False, True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_transformers_4x_and_5x_configs_agree(checkpoints, tmp_path, arch):
    old_style = copy_checkpoint(checkpoints[arch], tmp_path / "4x", to_transformers_4x)
    assert "rope_parameters" not in json.loads((old_style / "config.json").read_text())
    assert load_model_config(old_style) == load_model_config(checkpoints[arch])


def test_legacy_rope_type_key_head_dim_default_and_eos_list(checkpoints, tmp_path):
    def edit(raw):
        raw = to_transformers_4x(raw)
        raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
        raw["eos_token_id"] = [258, 256]
        del raw["head_dim"]
        return raw

    config = load_model_config(copy_checkpoint(checkpoints["llama"], tmp_path / "m", edit))
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_ids == (258, 256)
    assert config.head_dim == 64 // 4


def test_generation_config_eos(checkpoints, tmp_path):
    assert load_generation_config_eos(checkpoints["qwen3"]) == {258}
    model_dir = copy_checkpoint(checkpoints["qwen3"], tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 258]}))
    assert load_generation_config_eos(model_dir) == {1, 258}
    (model_dir / "generation_config.json").unlink()
    assert load_generation_config_eos(model_dir) == set()


def test_generation_defaults_are_the_sampling_fields_of_generation_config(checkpoints, tmp_path):
    assert load_generation_defaults(checkpoints["qwen3"]) == {}  # eos only: nothing to default
    model_dir = copy_checkpoint(checkpoints["qwen3"], tmp_path / "m")
    config = {
        "eos_token_id": 258,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "repetition_penalty": 1.3,
        "max_new_tokens": 7,
        "min_p": None,
    }
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    assert load_generation_defaults(model_dir) == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "repetition_penalty": 1.3,
        "max_tokens": 7,  # HF's max_new_tokens
    }
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        load_generation_defaults(model_dir)
    (model_dir / "generation_config.json").unlink()
    assert load_generation_defaults(model_dir) == {}


def test_unsupported_architecture_lists_supported(checkpoints, tmp_path):
    def edit(raw):
        return {**raw, "architectures": ["GPT2LMHeadModel"]}

    model_dir = copy_checkpoint(checkpoints["qwen3"], tmp_path / "m", edit)
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported") as error:
        load_model_config(model_dir)
    for name in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"):
        assert name in str(error.value)


def test_unsupported_rope_type_lists_supported(checkpoints, tmp_path):
    def edit(raw):
        return {**raw, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}

    model_dir = copy_checkpoint(checkpoints["qwen3"], tmp_path / "m", edit)
    with pytest.raises(ModelLoadError, match="'yarn' is not supported; supported: default"):
        load_model_config(model_dir)


def test_mistral_sliding_window_caps_context(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=128)
    assert load_model_config(model_dir).max_position_embeddings == 128


# --- finding the checkpoint ------------------------------------------------------------------


def test_missing_directory_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="no-such-model.*does not exist"):
        resolve_checkpoint(missing)


def test_directory_without_config_or_weights(checkpoints, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_checkpoint(str(empty))
    model_dir = copy_checkpoint(checkpoints["qwen3"], tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"'.*m'.*no \*\.safetensors"):
        resolve_checkpoint(str(model_dir))
    assert resolve_checkpoint(str(model_dir), "dummy") == model_dir  # dummy needs no weights


def test_pickle_only_checkpoint_is_refused(checkpoints, tmp_path):
    model_dir = copy_checkpoint(checkpoints["qwen3"], tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=r"only PyTorch pickle weights \(pytorch_model.bin\)"):
        resolve_checkpoint(str(model_dir))


def test_hub_failure_names_the_model(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError, match="could not fetch model 'someone/missing-model'"):
        resolve_checkpoint("someone/missing-model")


def test_front_resolution_skips_weights(checkpoints, tmp_path, monkeypatch):
    """The front asks the hub for config and tokenizer files only; the worker adds weights."""
    import huggingface_hub

    asked = []

    def fake_download(repo_id, allow_patterns, revision, cache_dir):
        asked.append(list(allow_patterns))
        return str(checkpoints["qwen3"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_checkpoint("org/model", with_weights=False) == checkpoints["qwen3"]
    assert resolve_checkpoint("org/model") == checkpoints["qwen3"]
    assert "*.safetensors" not in asked[0] and "*.safetensors" in asked[1]
    assert "*.json" in asked[0] and "tokenizer*" in asked[0]


def test_revision_and_download_dir_reach_the_hub(checkpoints, tmp_path, monkeypatch):
    """--revision and --download-dir are passed to snapshot_download as vLLM passes them."""
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["revision"], kwargs["cache_dir"]))
        return str(checkpoints["qwen3"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    resolve_checkpoint("org/model", revision="v1.0", download_dir=str(tmp_path))
    assert resolve_tokenizer("org/tokenizer", download_dir=str(tmp_path)) == checkpoints["qwen3"]
    assert calls == [("org/model", "v1.0", str(tmp_path)), ("org/tokenizer", None, str(tmp_path))]


def test_the_demo_model_has_a_short_name():
    assert resolve_checkpoint(DEMO_MODEL_NAME) == DEMO_MODEL_DIR
    assert resolve_tokenizer(DEMO_MODEL_NAME) == DEMO_MODEL_DIR
    assert load_model_config(DEMO_MODEL_DIR).architecture == "Qwen3ForCausalLM"


def test_missing_tokenizer_directory_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer directory .*nope.* does not exist"):
        resolve_tokenizer(str(tmp_path / "nope"))


def test_dummy_checkpoints_decode_every_id_to_visible_text(tmp_path):
    """Random weights sample ids all over a real vocabulary; each must read as text."""
    from transformers import AutoTokenizer

    model_dir = make_dummy_model_dir("Qwen/Qwen3-0.6B", cache_dir=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = load_model_config(model_dir).vocab_size
    assert len(tokenizer) == vocab_size
    sampled_ids = [259, 1000, 70_000, vocab_size - 1]
    text = tokenizer.decode(sampled_ids)
    assert len(text.split()) == len(sampled_ids) and text.replace(" ", "").isalpha(), text
    assert tokenizer.encode("héllo ✓") == list("héllo ✓".encode())  # bytes, never filler words
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 258


def test_a_hub_miss_is_one_line_and_names_a_known_model_it_resembles(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):  # huggingface_hub's own messages may span lines
        raise OSError("Cannot find an appropriate cached snapshot folder.\nTo enable look-ups...")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    mistyped = {"nanoserve-dmo": "nanoserve-demo", "Qwen/Qwen3-06B": "Qwen/Qwen3-0.6B"}
    for typed, meant in mistyped.items():
        with pytest.raises(ModelLoadError) as raised:
            resolve_checkpoint(typed)
        message = str(raised.value)
        assert "\n" not in message and message.endswith(f"; did you mean {meant!r}?"), message
    with pytest.raises(ModelLoadError) as raised:
        resolve_checkpoint("someone/missing-model")
    assert "\n" not in str(raised.value) and "did you mean" not in str(raised.value)
    with pytest.raises(ModelLoadError) as raised:  # a preset's own id: not "did you mean" itself
        resolve_checkpoint("Qwen/Qwen3-0.6B")
    message = str(raised.value)
    assert "did you mean" not in message and message.endswith("random weights, no download")


def moe_config(edit) -> dict:
    """A Qwen3-MoE config.json as the hub has it (`num_experts`), edited."""
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    return edit(raw)


@pytest.mark.parametrize("experts_key", ["num_experts", "num_local_experts"])
def test_qwen3_moe_config_names_its_experts_and_sparse_layers(tmp_path, experts_key):
    raw = moe_config(lambda r: {k: v for k, v in r.items() if k != "num_experts"})
    raw[experts_key] = 8
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert config.qk_norm and config.moe is not None
    moe = config.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
    assert moe.norm_topk_prob is False
    # (i + 1) % 2 == 0 and i not in [3]: only layer 1 routes to experts.
    assert [moe.is_sparse(i) for i in range(4)] == [False, True, False, False]


def test_mixtral_config_renormalizes_top_2_over_experts_as_wide_as_its_mlp(tmp_path):
    raw = moe_config(lambda r: {**r, "architectures": ["MixtralForCausalLM"]})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    moe = load_model_config(tmp_path).moe
    assert moe is not None and moe.moe_intermediate_size == 128  # intermediate_size
    assert moe.norm_topk_prob and all(moe.is_sparse(i) for i in range(4))


def test_a_moe_config_without_experts_is_refused(tmp_path):
    raw = moe_config(lambda r: {k: v for k, v in r.items() if k != "num_experts"})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="names no experts"):
        load_model_config(tmp_path)
    raw = moe_config(lambda r: {**r, "num_experts_per_tok": 9})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ModelLoadError, match=r"num_experts_per_tok \(9\) must be in 1..num_experts"
    ):
        load_model_config(tmp_path)
