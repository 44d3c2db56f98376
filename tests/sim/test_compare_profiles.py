"""`pdd sim compare-profiles`: the step model against Vidur's operator profiles and the H200
calibration (docs/SIM.md, "The step model against published profiles")."""

import json

import pytest

from pdd.cli import main as pdd_main
from pdd.sim.compare import (DEFAULT_OP_PROFILE, compare_profiles, linear_params_per_layer, load_op_profile,
                             shape_model, vidur_rows)
from pdd.sim.hardware import Efficiency
from pdd.sim.models import get_model

LLAMA3_8B = {"layers": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096, "n_expanded_embd": 14336, "gated_mlp": True}


def _prof(**over):
    p = {"chip": "H100-SXM5-80GB", "model": "x/tiny", "tp": 1, "gpu": "h100", "shape": dict(LLAMA3_8B),
         "rows": [{"tokens": 1, "ops_ms": {"mlp_up_proj": 0.1, "add": 0.05}},
                  {"tokens": 4096, "ops_ms": {"mlp_up_proj": 2.0, "add": 0.5}}]}
    p.update(over)
    return {"format": "pdd-op-profile/1", "profiles": [p]}


def test_shape_model_matches_the_calibration_models_decoder_layers():
    assert linear_params_per_layer(LLAMA3_8B) == 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 == 218_103_808
    m = shape_model("llama3", LLAMA3_8B, 1)
    calib = get_model("llama3-8b-calib")
    assert m.weight_bytes == calib.weight_bytes == 13_958_643_712
    assert m.flops_per_token == 2 * 218_103_808 * 32
    assert m.kv_bytes_per_token == calib.kv_bytes_per_token == 131072


def test_vidur_rows_sum_the_ops_over_layers_and_apply_the_roofline_without_attention():
    rows = vidur_rows(_prof())
    e = Efficiency()
    w = 13_958_643_712
    dec, pre = rows
    assert dec["phase"] == "decode (no attn)" and dec["batch"] == 1 and dec["tokens"] == 1
    assert dec["source_s"] == pytest.approx(0.15 * 32 / 1e3, rel=1e-12)
    # one token: the weight read binds (989.4 TFLOP/s x 0.65 vs 3.35 TB/s x 0.92)
    assert dec["predicted_s"] == pytest.approx(e.overhead_s + w / (3.35e12 * e.mem), rel=1e-12)
    assert dec["roofline_s"] == pytest.approx(w / (3.35e12 * e.mem), rel=1e-12)
    assert dec["err"] == pytest.approx(dec["predicted_s"] / dec["source_s"] - 1, rel=1e-12)
    assert pre["phase"] == "prefill (no attn)" and pre["batch"] == 1
    # 4096 tokens: the matmul FLOPs bind (2 FLOPs per parameter = the bf16 weight bytes)
    assert pre["predicted_s"] == pytest.approx(e.overhead_s + w * 4096 / (989.4e12 * e.compute), rel=1e-12)
    assert pre["source_s"] == pytest.approx(2.5 * 32 / 1e3, rel=1e-12)


def test_tensor_parallel_rows_use_the_instances_gpus():
    (row,) = vidur_rows(_prof(tp=4, rows=[{"tokens": 1, "ops_ms": {"a": 1.0}}]))
    e = Efficiency()
    assert row["predicted_s"] == pytest.approx(e.overhead_s + 13_958_643_712 / (3.35e12 * e.mem * 4 * e.tp_eff),
                                               rel=1e-12)


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.update(format="other"), "format must be 'pdd-op-profile/1'"),
    (lambda d: d.update(profiles=[]), "profiles must be a non-empty list"),
    (lambda d: d["profiles"][0].pop("tp"), "profiles[0].tp is missing"),
    (lambda d: d["profiles"][0]["shape"].pop("n_kv_head"), "profiles[0].shape.n_kv_head is missing"),
    (lambda d: d["profiles"][0]["rows"][1].update(tokens=0), "profiles[0].rows[1].tokens must be a positive integer"),
    (lambda d: d["profiles"][0]["rows"][0].update(ops_ms={}), "profiles[0].rows[0].ops_ms must be a non-empty"),
])
def test_malformed_op_profile_names_the_field(tmp_path, mutate, msg):
    d = _prof()
    mutate(d)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        load_op_profile(f)


def test_unknown_chip_names_the_field():
    with pytest.raises(ValueError, match=r"profiles\[0\]\.chip: unknown chip 'B200'"):
        vidur_rows(_prof(chip="B200"))


def test_committed_vidur_profile_keeps_its_attribution_and_the_documented_numbers():
    prof = load_op_profile(DEFAULT_OP_PROFILE)
    assert prof["source"] == {"repository": "microsoft/vidur", "commit": "7d47513363ec447a741ac5e47241580b47724fbf",
                              "licence": "MIT", "copyright": "Copyright (c) Microsoft Corporation."}
    assert [(p["model"], p["tp"], len(p["rows"])) for p in prof["profiles"]] == [
        ("meta-llama/Meta-Llama-3-8B", 1, 16), ("meta-llama/Llama-2-7b-hf", 1, 13),
        ("meta-llama/Meta-Llama-3-70B", 4, 16), ("meta-llama/Llama-2-70b-hf", 4, 13)]
    res = compare_profiles()
    assert len(res["rows"]) == 58 + 14
    by = {(r["shape"], r["tp"], r["phase"], r["tokens"], r["context"]): r for r in res["rows"]}
    a100_b1 = by[("Meta-Llama-3-8B", 1, "decode (no attn)", 1, None)]
    assert round(a100_b1["source_s"] * 1e3, 3) == 9.696
    assert round(a100_b1["err"] * 100, 1) == -10.4
    assert round(by[("Llama-2-7b-hf", 1, "prefill (no attn)", 4096, None)]["err"] * 100, 1) == 0.6
    assert round(by[("Llama-3-8B", 1, "decode", 64, 16384)]["err"] * 100, 1) == 2.8
    summ = {s["group"]: s for s in res["summary"]}
    assert round(summ["vidur a100 Meta-Llama-3-8B TP1 decode"]["mean_err"] * 100, 1) == -14.4
    assert round(summ["vidur h100 Llama-2-7b-hf TP1 prefill"]["mean_abs_err"] * 100, 1) == 3.3


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert pdd_main(["sim", "compare-profiles", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| vidur a100 | A100-SXM4-80GB | Meta-Llama-3-8B | 1 | decode (no attn) | 1 | 1 | - | 8.69 | 9.70 | -10.4% | -23.3% |" in text
    assert len(json.loads(out.read_text())["rows"]) == 72


@pytest.mark.parametrize("flag,content,msg", [
    ("--op-profile", {"format": "x"}, "format must be 'pdd-op-profile/1'"),
    ("--calibration", {"format": "x"}, "no prefill, decode or extend rows"),
    ("--calibration", {"prefill": [{"tokens": 5}]}, "not a measured step profile (KeyError: 'seconds')"),
])
def test_cli_refuses_malformed_inputs(tmp_path, capsys, flag, content, msg):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(content))
    with pytest.raises(SystemExit) as ex:
        pdd_main(["sim", "compare-profiles", flag, str(f)])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(f) in err and msg in err
