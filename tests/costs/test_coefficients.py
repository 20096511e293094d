"""Cost model: coefficient validation and I/O, geometry from HF-style configs, cost formulas."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from types import SimpleNamespace

import pytest

from autobucket.costs.coefficients import (
    BENCH_QWEN2_GEOMETRY,
    CostCoefficients,
    ModelGeometry,
    attention_gflops,
    continuous_decode_cost_ms,
    kv_mib,
    load_costs,
    ordinary_cost_ms,
    prefill_cost_ms,
    prefill_row_ms,
)

QWEN25_3B = ModelGeometry(layers=36, query_heads=16, kv_heads=2, head_dim=128, element_bytes=4)


# ---- CostCoefficients ---------------------------------------------------------------------------------


def test_defaults_are_the_reference_values_plus_zero_extensions():
    assert CostCoefficients().to_dict() == {
        "fixed_ms": 25.0,
        "token_ms": 0.1,
        "attention_ms": 0.01,
        "kv_ms": 0.04,
        "decode_ms": 10.0,
        "ordinary_decode_ms": 0.0,
        "ordinary_decode_kv_ms": 0.0,
        "step_ms": 0.0,
        "step_row_ms": 0.0,
        "step_kv_ms": 0.0,
        "forward_sq_ms": 0.0,
        "packed_prompt_ms": 0.3,
    }


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -1, -0.5, True, False, "1", None])
@pytest.mark.parametrize("field", [f.name for f in fields(CostCoefficients)])
def test_bad_coefficient_is_rejected_naming_field_and_value(field, bad):
    with pytest.raises(ValueError) as info:
        CostCoefficients(**{field: bad})
    assert field in str(info.value)
    assert repr(bad) in str(info.value)
    assert ">= 0" in str(info.value)


def test_int_coefficients_are_stored_as_floats():
    costs = CostCoefficients(fixed_ms=3, token_ms=0)
    assert type(costs.fixed_ms) is float and costs.fixed_ms == 3.0
    assert type(costs.token_ms) is float


def test_coefficients_are_frozen():
    with pytest.raises(AttributeError):
        CostCoefficients().fixed_ms = 1.0  # type: ignore[misc]


def test_to_dict_from_dict_round_trip():
    costs = CostCoefficients(1.5, 0.2, 0.03, 0.4, 5.0, 0.25, 0.125)
    assert CostCoefficients.from_dict(costs.to_dict()) == costs
    assert CostCoefficients.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs


def test_reference_five_key_dict_is_accepted_with_zero_extensions():
    five = {"fixed_ms": 28.8, "token_ms": 0.093, "attention_ms": 0.0101, "kv_ms": 0.056, "decode_ms": 17.1}
    costs = CostCoefficients.from_dict(five)
    assert costs.fixed_ms == 28.8 and costs.decode_ms == 17.1
    assert costs.ordinary_decode_ms == 0.0 and costs.ordinary_decode_kv_ms == 0.0


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ValueError, match="prefill_fixed_cost_ms"):
        CostCoefficients.from_dict({"fixed_ms": 1.0, "prefill_fixed_cost_ms": 2.0})


def test_from_dict_rejects_non_dict():
    with pytest.raises(ValueError, match="list"):
        CostCoefficients.from_dict([1.0, 2.0])


def test_load_costs_plain_and_wrapped(tmp_path):
    costs = CostCoefficients(fixed_ms=7.0, decode_ms=2.5, ordinary_decode_kv_ms=0.5)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(costs.to_dict()))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(
        json.dumps({"schema_version": 1, "metadata": {"model": "x"}, "costs": costs.to_dict()})
    )
    assert load_costs(plain) == costs
    assert load_costs(str(wrapped)) == costs


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"costs": [1, 2]}', "JSON object"),
        ('{"fixed_ms": -1}', "fixed_ms"),
        ('{"fixed_ms": 1, "bogus": 2}', "bogus"),
    ],
)
def test_load_costs_rejects_corrupt_files_naming_the_path(tmp_path, content, problem):
    path = tmp_path / "costs.json"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        load_costs(path)
    assert str(path) in str(info.value)
    assert problem in str(info.value)


def test_load_costs_missing_file_names_the_path(tmp_path):
    path = tmp_path / "missing.json"
    with pytest.raises(ValueError, match="missing.json"):
        load_costs(path)


# ---- ModelGeometry ------------------------------------------------------------------------------------


def test_geometry_from_llama_style_config():
    config = SimpleNamespace(
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        max_position_embeddings=8192,
    )
    geometry = ModelGeometry.from_config(config, "bfloat16")
    assert geometry == ModelGeometry(32, 32, 8, 128, 2, 8192)


def test_geometry_from_gpt2_style_config_is_mha():
    config = SimpleNamespace(n_layer=12, n_head=12, n_embd=768, n_positions=1024, n_ctx=1024)
    assert ModelGeometry.from_config(config, "fp32") == ModelGeometry(12, 12, 12, 64, 4, 1024)


def test_geometry_from_opt_style_config():
    config = SimpleNamespace(
        num_hidden_layers=24, num_attention_heads=32, hidden_size=2048, max_position_embeddings=2048
    )
    assert ModelGeometry.from_config(config, "float16") == ModelGeometry(24, 32, 32, 64, 2, 2048)


def test_explicit_head_dim_wins_over_hidden_over_heads():
    # Qwen3-style: head_dim 128 although hidden_size / heads = 64.
    config = SimpleNamespace(
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        hidden_size=1024,
        head_dim=128,
        max_position_embeddings=40960,
    )
    assert ModelGeometry.from_config(config, "bf16").head_dim == 128


def test_null_kv_heads_and_head_dim_fall_back():
    config = SimpleNamespace(num_layers=2, n_head=4, d_model=256, num_key_value_heads=None, head_dim=None)
    geometry = ModelGeometry.from_config(config, "float32")
    assert (geometry.kv_heads, geometry.head_dim, geometry.max_positions) == (4, 64, None)


def test_text_config_is_used_when_it_holds_the_decoder():
    text = SimpleNamespace(num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, hidden_size=512)
    config = SimpleNamespace(text_config=text, vision_config=SimpleNamespace(num_hidden_layers=99))
    assert ModelGeometry.from_config(config, "fp16") == ModelGeometry(6, 8, 2, 64, 2, None)


def test_missing_field_names_the_variants():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelGeometry.from_config(SimpleNamespace(num_attention_heads=4, hidden_size=64), "fp32")


class _FakeTorchDtype:
    itemsize = 2

    def __repr__(self) -> str:
        return "torch.bfloat16"


@pytest.mark.parametrize(
    ("dtype", "element_bytes"),
    [
        ("float32", 4),
        ("fp32", 4),
        ("torch.float32", 4),
        ("bfloat16", 2),
        ("bf16", 2),
        ("torch.bfloat16", 2),
        ("float16", 2),
        ("fp16", 2),
        ("torch.float16", 2),
        ("float64", 8),
        (_FakeTorchDtype(), 2),
    ],
)
def test_dtype_variants(dtype, element_bytes):
    config = SimpleNamespace(n_layer=1, n_head=1, n_embd=8)
    assert ModelGeometry.from_config(config, dtype).element_bytes == element_bytes


@pytest.mark.parametrize("dtype", ["int4", "float8", "", None, 4])
def test_unknown_dtype_is_rejected(dtype):
    with pytest.raises(ValueError, match="dtype"):
        ModelGeometry.from_config(SimpleNamespace(n_layer=1, n_head=1, n_embd=8), dtype)


@pytest.mark.parametrize("field", ["layers", "query_heads", "kv_heads", "head_dim", "element_bytes"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_geometry_rejects_non_positive_or_non_int(field, bad):
    values = {"layers": 4, "query_heads": 4, "kv_heads": 2, "head_dim": 64, "element_bytes": 4}
    with pytest.raises(ValueError, match=field):
        ModelGeometry(**{**values, field: bad})


def test_geometry_rejects_bad_max_positions():
    with pytest.raises(ValueError, match="max_positions"):
        ModelGeometry(1, 1, 1, 1, 1, max_positions=0)


def test_bench_geometry_is_the_20m_qwen2():
    assert ModelGeometry(4, 4, 2, 64, 4, 32768) == BENCH_QWEN2_GEOMETRY


# ---- cost formulas --------------------------------------------------------------------------------------


def test_attention_and_kv_formulas_by_hand():
    # 4·B·L²·layers·heads·head_dim / 1e9 and 2·B·L·layers·kv_heads·head_dim·bytes / 2^20
    assert attention_gflops(2, 100, QWEN25_3B) == pytest.approx(4 * 2 * 100**2 * 36 * 16 * 128 / 1e9)
    assert kv_mib(2, 100, QWEN25_3B) == pytest.approx(2 * 2 * 100 * 36 * 2 * 128 * 4 / 2**20)


def test_prefill_cost_by_hand():
    costs = CostCoefficients(fixed_ms=25, token_ms=0.1, attention_ms=0.01, kv_ms=0.04)
    rows, width = 31, 16
    expected = 25 + 0.1 * rows * width + 0.01 * attention_gflops(rows, width, QWEN25_3B)
    assert prefill_cost_ms(rows, width, QWEN25_3B, costs, include_kv_copy=False) == pytest.approx(expected)
    expected += 0.04 * kv_mib(rows, width, QWEN25_3B)
    assert prefill_cost_ms(rows, width, QWEN25_3B, costs) == pytest.approx(expected)


def test_prefill_cost_is_fixed_plus_rows_times_row_cost():
    costs = CostCoefficients(fixed_ms=3.0, token_ms=0.2, attention_ms=0.7, kv_ms=0.3)
    for rows, width in [(1, 1), (7, 33), (128, 512)]:
        direct = prefill_cost_ms(rows, width, QWEN25_3B, costs)
        assert direct == pytest.approx(costs.fixed_ms + rows * prefill_row_ms(width, QWEN25_3B, costs))


def test_ordinary_cost_without_extensions_is_prefill_without_kv():
    costs = CostCoefficients(kv_ms=5.0, decode_ms=3.0)
    expected = prefill_cost_ms(32, 512, QWEN25_3B, costs, include_kv_copy=False)
    assert ordinary_cost_ms(32, 512, 16, QWEN25_3B, costs) == expected


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 16, 100])
def test_ordinary_decode_extension_matches_the_explicit_sum(max_new_tokens):
    costs = CostCoefficients(ordinary_decode_ms=1.25, ordinary_decode_kv_ms=0.5)
    rows, width = 5, 40
    explicit = sum(
        costs.ordinary_decode_ms + costs.ordinary_decode_kv_ms * kv_mib(rows, width + step, QWEN25_3B)
        for step in range(1, max_new_tokens)
    )
    prefill = prefill_cost_ms(rows, width, QWEN25_3B, costs, include_kv_copy=False)
    total = ordinary_cost_ms(rows, width, max_new_tokens, QWEN25_3B, costs)
    assert math.isclose(total - prefill, explicit, rel_tol=1e-12, abs_tol=1e-9)


def test_continuous_decode_cost():
    costs = CostCoefficients(decode_ms=10.0)
    assert continuous_decode_cost_ms(16, costs) == 150.0
    assert continuous_decode_cost_ms(1, costs) == 0.0
    assert continuous_decode_cost_ms(0, costs) == 0.0


def test_real_transformers_configs_and_torch_dtypes():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    qwen2 = transformers.Qwen2Config(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=256
    )
    assert ModelGeometry.from_config(qwen2, torch.float32) == BENCH_QWEN2_GEOMETRY
    gpt2 = ModelGeometry.from_config(transformers.GPT2Config(), torch.bfloat16)
    assert gpt2 == ModelGeometry(12, 12, 12, 64, 2, 1024)
    gemma3 = ModelGeometry.from_config(transformers.Gemma3Config(), torch.float16)  # decoder in text_config
    assert (gemma3.layers, gemma3.kv_heads, gemma3.head_dim) == (26, 4, 256)


# ---- the super-linear forward term and the planner's cap ------------------------------------------------


def test_forward_sq_term_is_zero_by_default_and_caps_planning_where_splitting_pays():
    from autobucket.costs.coefficients import planning_token_limit, split_forward_tokens

    assert split_forward_tokens(CostCoefficients()) is None
    assert planning_token_limit(4096, CostCoefficients(), 512) == 4096
    costs = CostCoefficients(fixed_ms=8.0, token_ms=0.05, attention_ms=0.0, forward_sq_ms=1.0)
    cap = split_forward_tokens(costs)
    assert cap == 4000  # 1.0·(T/1000)²/2 = 8 ms at T = 4000
    # Brute force: one forward of T tokens vs two of T/2, on either side of the cap.
    for tokens, split_pays in ((cap - 200, False), (cap + 200, True)):
        one = prefill_cost_ms(1, tokens, BENCH_QWEN2_GEOMETRY, costs, include_kv_copy=False)
        two = 2 * prefill_cost_ms(1, tokens // 2, BENCH_QWEN2_GEOMETRY, costs, include_kv_copy=False)
        assert (two < one) == split_pays
    assert planning_token_limit(65536, costs, 512) == 4000 and planning_token_limit(None, costs, 512) == 4000
    assert planning_token_limit(2048, costs, 512) == 2048 and planning_token_limit(None, costs, 9000) == 9000
