"""Performance presets against published measurements (smetric.calibration)."""

from __future__ import annotations

import json

import pytest

from smetric.calibration import CHECKS, run_checks
from smetric.perf import PRESETS, Profile, load_profile


def test_every_preset_has_a_published_check():
    assert {c.preset for c in CHECKS} == {
        "llama-3.1-8b-h100",
        "qwen2.5-7b-h200",
        "qwen3-30b-a3b-h20",
    }


@pytest.mark.parametrize("check_index", range(len(CHECKS)))
def test_presets_stay_within_ten_percent_of_published_figures(check_index):
    check, model, err = run_checks()[check_index]
    assert abs(err) <= 0.10, (check.preset, check.what, model, check.published)


def test_kv_bytes_and_pool_follow_the_architecture():
    p = PRESETS["llama-3.1-8b-h100"]
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, dim, bf16
    assert p.kv_pool_tokens == int((80e9 * 0.88 - 8.03e9 * 2) // p.kv_bytes_per_token)


def test_moe_decode_reads_only_the_experts_the_batch_touches():
    m = PRESETS["qwen3-30b-a3b-h20"].model
    assert m.weight_bytes_read(1) < 0.15 * m.weight_bytes
    assert m.weight_bytes_read(10_000) == pytest.approx(m.weight_bytes, rel=1e-6)


def test_iteration_time_is_the_roofline_of_compute_and_memory():
    p = PRESETS["qwen2.5-7b-h200"]
    prefill = p.prefill_time_s(8192)
    decode = p.decode_step_s(1, 1000)
    m = p.model
    flops = 2 * m.active_params * 8192 + 4 * m.layers * m.q_heads * m.head_dim * 8192 * 8193 / 2
    assert prefill == pytest.approx(p.overhead_s + flops / (p.gpu.bf16_flops * p.mfu))
    hbm = m.weight_bytes + 1000 * p.kv_bytes_per_token
    assert decode == pytest.approx(p.overhead_s + hbm / (p.gpu.hbm_bytes_per_s * p.mbu))
    assert p.iteration_time_s() == 0.0


def test_profiles_round_trip_through_json_files(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(PRESETS["qwen3-30b-a3b-h20"].to_json())
    assert load_profile(str(path)) == PRESETS["qwen3-30b-a3b-h20"]
    assert load_profile("qwen2.5-7b") is PRESETS["qwen2.5-7b-h200"]
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("nope")
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="not a profile"):
        load_profile(str(path))
    with pytest.raises(ValueError):
        Profile.from_dict({**json.loads(PRESETS["qwen2.5-7b-h200"].to_json()), "mfu": 2.0})
