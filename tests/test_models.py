"""tunekit.problems.models: shapes derived from configs == the checked facts stored with each built-in."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tunekit.errors import UserError
from tunekit.problems.models import ModelSpec, list_models, load_model
from tunekit.problems.shapes import Problem

CONFIGS = Path(__file__).resolve().parents[1] / "tunekit" / "problems" / "models" / "configs"
BUILTIN_FILES = sorted(CONFIGS.glob("*.json"))
TPS = (1, 2, 4, 8)


def _doc(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _shapes(problems: list[Problem]) -> set[tuple[int, int, int]]:
    return {(p.n, p.k, p.count) for p in problems}


def _write(tmp_path: Path, config: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def _hf_qwen35_config(text: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3.5 checkpoint's config.json: VL wrapper, decoder fields in text_config."""
    text = copy.deepcopy(text)
    tie = text.pop("tie_word_embeddings")
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": tie,
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152},
        "image_token_id": 248056,
    }


# ------------------------------------------------------------ built-in facts


def test_builtins_listed_sorted() -> None:
    specs = list_models()
    names = [spec.name for spec in specs]
    assert names == sorted(names)
    assert names == sorted(json.loads(path.read_text())["name"] for path in BUILTIN_FILES)
    assert len(names) >= 9
    for spec in specs:
        doc = _doc(spec.name)
        assert spec.hf_id == doc["hf_id"]
        assert spec.config == doc["config"]
        assert spec.family == ("qwen3_5" if doc["config"]["model_type"].startswith("qwen3_5") else "dense")
        assert spec.num_layers == doc["config"]["num_hidden_layers"]
        assert spec.hidden_size == doc["config"]["hidden_size"]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("path", BUILTIN_FILES, ids=lambda p: p.stem)
def test_derived_linears_match_stored(path: Path, tp: int) -> None:
    doc = json.loads(path.read_text())
    spec = load_model(doc["name"])
    unsupported = doc["tp_unsupported"]
    if str(tp) in unsupported:
        assert tp not in doc["tp_supported"]
        with pytest.raises(UserError, match=re.escape(unsupported[str(tp)])):
            spec.check_tp(tp)
        with pytest.raises(UserError, match=re.escape(unsupported[str(tp)])):
            spec.linears(tp)
        return
    assert tp in doc["tp_supported"]
    spec.check_tp(tp)
    expected = [(lin["name"], *lin["tp"][str(tp)], lin["count"]) for lin in doc["decode_linears"]]
    assert spec.linears(tp) == expected


@pytest.mark.parametrize("path", BUILTIN_FILES, ids=lambda p: p.stem)
def test_summary_calls_and_bytes(path: Path) -> None:
    doc = json.loads(path.read_text())
    problems = load_model(doc["name"]).problems(tp=1)
    assert sum(p.count for p in problems) == doc["summary"]["gemv_launches_per_token_tp1"]
    weight = sum(p.weight_bytes * p.count for p in problems)
    assert weight == doc["summary"]["weight_bytes_per_token_bf16_tp1"]
    if "full_attention_layers" in doc["summary"]:
        spec = load_model(doc["name"])
        assert spec.num_full_attention_layers == doc["summary"]["full_attention_layers"]
        assert spec.num_linear_attention_layers == doc["summary"]["linear_attention_layers"]


# ------------------------------------------------------------ Qwen3.5-27B, the model


QWEN35_27B_TP1 = {
    (14336, 5120, 16),  # qkv_proj (query + output gate, 4 kv heads)
    (16384, 5120, 48),  # linear_attn.in_proj_qkvz
    (96, 5120, 48),  # linear_attn.in_proj_ba
    (34816, 5120, 64),  # mlp.gate_up_proj
    (5120, 17408, 64),  # mlp.down_proj
    (5120, 6144, 64),  # 48 linear_attn.out_proj + 16 o_proj, same shape
    (248320, 5120, 1),  # lm_head
}


def test_qwen35_27b_tp1_problems() -> None:
    problems = load_model("qwen3.5-27b").problems(tp=1, m_list=(1,))
    assert len(problems) == 7
    assert _shapes(problems) == QWEN35_27B_TP1
    assert all(p.op == "gemv" and p.dtype == "bf16" and p.m == 1 for p in problems)
    assert sum(p.count for p in problems) == 305
    assert sum(p.weight_bytes * p.count for p in problems) == 51_243_909_120
    merged = next(p for p in problems if (p.n, p.k) == (5120, 6144))
    assert set(merged.names) == {"o_proj", "linear_attn.out_proj"}


def test_qwen35_27b_tp4_sharding() -> None:
    got = {name: (n, k, count) for name, n, k, count in load_model("qwen3.5-27b").linears(tp=4)}
    assert got == {
        "qkv_proj": (3584, 5120, 16),  # (48/4 q+gate heads + 2 * 4/4 kv) * 256
        "o_proj": (5120, 1536, 16),
        "linear_attn.in_proj_qkvz": (4096, 5120, 48),
        "linear_attn.in_proj_ba": (24, 5120, 48),
        "linear_attn.out_proj": (5120, 1536, 48),
        "mlp.gate_up_proj": (8704, 5120, 64),
        "mlp.down_proj": (5120, 4352, 64),
        "lm_head": (62080, 5120, 1),
    }


def test_kv_heads_replicated_beyond_tp() -> None:
    # 4 kv heads at TP=8: one (replicated) kv head per rank, not half a head.
    qkv = {name: (n, k) for name, n, k, _ in load_model("qwen3.5-27b").linears(tp=8)}["qkv_proj"]
    assert qkv == ((48 // 8 + 2 * 1) * 256, 5120)


def test_qwen35_elementwise_facts() -> None:
    spec = load_model("qwen3.5-27b")
    assert spec.family == "qwen3_5"
    assert (spec.hidden_size, spec.intermediate_size, spec.rms_norm_eps) == (5120, 17408, 1e-6)
    assert spec.norm_style == "gemma"
    assert spec.gated_norm_groups == (48, 128)
    assert spec.head_dim == 256 and spec.attn_output_gate
    assert spec.linear_attention is not None and spec.linear_attention.value_dim == 6144


# ------------------------------------------------------------ dense


def test_dense_llama() -> None:
    spec = load_model("llama-3.1-8b")  # alias without "-instruct"
    assert spec.name == "llama-3.1-8b-instruct"
    assert spec.family == "dense"
    assert spec.norm_style == "plain" and spec.gated_norm_groups is None
    assert spec.rms_norm_eps == 1e-5
    problems = spec.problems()
    assert sum(p.count for p in problems) == 129
    assert _shapes(problems) == {
        (6144, 4096, 32),
        (4096, 4096, 32),
        (28672, 4096, 32),
        (4096, 14336, 32),
        (128256, 4096, 1),
    }


def test_lookup_case_insensitive_and_hf_id() -> None:
    assert load_model("Qwen3.5-27B").name == "qwen3.5-27b"
    assert load_model("Qwen/Qwen3.5-27B").name == "qwen3.5-27b"
    assert load_model("  QWEN3-8B ").name == "qwen3-8b"


def test_head_dim_derived_when_absent() -> None:
    spec = load_model("qwen2-7b-instruct")
    assert "head_dim" not in spec.config
    assert spec.head_dim == 3584 // 28


def test_lm_head_vocab_padded_to_64(tmp_path: Path) -> None:
    config = dict(_doc("llama-3.1-8b-instruct")["config"], vocab_size=32001, tie_word_embeddings=True)
    spec = load_model(str(_write(tmp_path, config)))
    assert spec.padded_vocab_size == 32064
    assert spec.linears(1)[-1] == ("lm_head", 32064, 4096, 1)  # tied: still executed
    assert spec.linears(2)[-1] == ("lm_head", 16032, 4096, 1)


def test_mistral_null_head_dim(tmp_path: Path) -> None:
    config = {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "vocab_size": 32768,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
    }
    spec = load_model(str(_write(tmp_path, config)))
    assert spec.head_dim == 128
    assert spec.linears(1)[0] == ("qkv_proj", 6144, 4096, 32)


# ------------------------------------------------------------ M list, dtype


def test_m_list_expansion() -> None:
    spec = load_model("qwen3.5-27b")
    one = spec.problems(m_list=(1,))
    many = spec.problems(m_list=(1, 2, 4, 8))
    assert len(many) == 4 * len(one) == 28
    for m in (1, 2, 4, 8):
        subset = [p for p in many if p.m == m]
        assert _shapes(subset) == _shapes(one)
    assert len({p.key for p in many}) == len(many)


def test_dtype_and_bad_arguments() -> None:
    spec = load_model("qwen3-8b")
    assert all(p.dtype == "fp16" for p in spec.problems(dtype="fp16"))
    with pytest.raises(UserError, match="dtype"):
        spec.problems(dtype="int3")
    with pytest.raises(UserError, match="m_list"):
        spec.problems(m_list=())
    with pytest.raises(UserError, match="m_list"):
        spec.problems(m_list=(0,))


@pytest.mark.parametrize("tp", [0, -2, 3, 64])
def test_bad_tp(tp: int) -> None:
    with pytest.raises(UserError, match=rf"tp={tp}") as info:
        load_model("llama-3.1-8b-instruct").check_tp(tp)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------ HF config.json files


def test_hf_dense_config_file(tmp_path: Path) -> None:
    config = dict(
        _doc("llama-3.1-8b-instruct")["config"],
        architectures=["LlamaForCausalLM"],
        torch_dtype="bfloat16",
        _name_or_path="meta-llama/Llama-3.1-8B-Instruct",
        transformers_version="4.43.0",
    )
    folder = tmp_path / "Llama-3.1-8B-Instruct"
    folder.mkdir()
    path = _write(folder, config)
    builtin = load_model("llama-3.1-8b-instruct")
    for arg in (str(path), str(folder), path):
        spec = load_model(arg)
        assert spec.hf_id == "meta-llama/Llama-3.1-8B-Instruct"
        assert spec.name == "Llama-3.1-8B-Instruct"
        for tp in TPS:
            assert spec.problems(tp, m_list=(1, 4)) == builtin.problems(tp, m_list=(1, 4))
            assert spec.linears(tp) == builtin.linears(tp)


@pytest.mark.parametrize("name", ["qwen3.5-27b", "qwen3.5-0.8b"])
def test_hf_qwen35_nested_text_config(tmp_path: Path, name: str) -> None:
    builtin = load_model(name)
    spec = load_model(str(_write(tmp_path, _hf_qwen35_config(_doc(name)["config"]))))
    assert spec.family == "qwen3_5"
    assert spec.config["tie_word_embeddings"] == builtin.config["tie_word_embeddings"]
    for tp in TPS:
        assert spec.linears(tp) == builtin.linears(tp)
        assert spec.problems(tp) == builtin.problems(tp)


def test_qwen35_full_attention_interval_without_layer_types(tmp_path: Path) -> None:
    text = dict(_doc("qwen3.5-27b")["config"])
    del text["layer_types"]
    text["model_type"] = "qwen3_next"  # same fields; accepted with a dense MLP
    spec = load_model(str(_write(tmp_path, text)))
    assert spec.layer_types == load_model("qwen3.5-27b").layer_types
    assert spec.problems() == load_model("qwen3.5-27b").problems()


def test_tunekit_model_file_path() -> None:
    spec = load_model(str(CONFIGS / "qwen3.5-9b.json"))
    assert spec.name == "qwen3.5-9b"
    assert spec.linears(2) == load_model("qwen3.5-9b").linears(2)


def test_specs_do_not_share_config() -> None:
    first = load_model("qwen3-8b")
    first.config["hidden_size"] = 1
    assert load_model("qwen3-8b").config["hidden_size"] == 4096


# ------------------------------------------------------------ errors: one clear line


def _error(tmp_path: Path, config: Any, filename: str = "config.json") -> str:
    path = _write(tmp_path, config, filename)
    with pytest.raises(UserError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    return message


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"])
def test_missing_field(tmp_path: Path, field: str) -> None:
    config = dict(_doc("qwen3-8b")["config"])
    del config[field]
    message = _error(tmp_path, config)
    assert "missing" in message and field in message


@pytest.mark.parametrize("value", ["4096", 4096.0, -1, 0, True, [4096]])
def test_non_integer_field(tmp_path: Path, value: Any) -> None:
    config = dict(_doc("qwen3-8b")["config"], hidden_size=value)
    message = _error(tmp_path, config)
    assert "hidden_size" in message and "integer" in message


def test_missing_nested_field_named(tmp_path: Path) -> None:
    text = dict(_doc("qwen3.5-27b")["config"])
    del text["linear_num_value_heads"]
    message = _error(tmp_path, _hf_qwen35_config(text))
    assert "text_config.'linear_num_value_heads'" in message


def test_qwen35_missing_layer_kinds(tmp_path: Path) -> None:
    text = dict(_doc("qwen3.5-9b")["config"])
    del text["layer_types"], text["full_attention_interval"]
    assert "layer_types" in _error(tmp_path, text)


def test_qwen35_bad_layer_types(tmp_path: Path) -> None:
    text = dict(_doc("qwen3.5-9b")["config"])
    text["layer_types"] = text["layer_types"][:-1]
    assert "layer_types" in _error(tmp_path, text)
    text["layer_types"] = ["sliding_attention"] * 32
    assert "sliding_attention" in _error(tmp_path, text)


def test_missing_model_type(tmp_path: Path) -> None:
    config = dict(_doc("qwen3-8b")["config"])
    del config["model_type"]
    assert "model_type" in _error(tmp_path, config)


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "gpt2", "n_embd": 768},
        {"model_type": "mixtral", "num_local_experts": 8, "hidden_size": 4096},
        {"model_type": "qwen3_5_moe", "text_config": {"num_experts": 256}},
    ],
    ids=["gpt2", "mixtral", "qwen3_5_moe"],
)
def test_unknown_model_type(tmp_path: Path, config: dict[str, Any]) -> None:
    message = _error(tmp_path, config)
    assert f"model_type {config['model_type']} is not supported yet (supported: " in message
    assert "qwen3_5" in message and "llama" in message


def test_moe_of_supported_type(tmp_path: Path) -> None:
    text = dict(_doc("qwen3.5-27b")["config"], model_type="qwen3_next", num_experts=512)
    message = _error(tmp_path, text)
    assert "model_type qwen3_next is not supported yet (supported: " in message
    assert "MoE" in message and "num_experts=512" in message


def test_unreadable_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 4096,')
    with pytest.raises(UserError, match="not valid JSON") as info:
        load_model(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert "expected a JSON object" in _error(tmp_path, [1, 2, 3], "list.json")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(UserError, match="not found") as info:
        load_model(str(path))
    assert str(path) in str(info.value)


def test_unknown_name() -> None:
    with pytest.raises(UserError, match="unknown model 'gpt-5'") as info:
        load_model("gpt-5")
    assert "qwen3.5-27b" in str(info.value)  # lists the built-ins
    with pytest.raises(UserError):
        load_model("")


def test_from_config_directly() -> None:
    spec = ModelSpec.from_config(_doc("qwen3-32b")["config"], name="mine")
    assert spec.name == "mine" and spec.hf_id is None
    assert spec.linears(8) == load_model("qwen3-32b").linears(8)
