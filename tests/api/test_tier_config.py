"""Per-tier engine blocks (``ClusterConfig.tiers``): inheritance from the top-level ``engine``,
the instance's block over its tier's, and bad input refused naming the field (pydantic, the
CLI's usage error)."""

import json

import pytest
from pydantic import ValidationError

from pdd.cli import main
from pdd.config import ClusterConfig, instance_tier, validation_summary

PROFILE = "data/profiles/this-machine.json"


def cfg(**data) -> ClusterConfig:
    return ClusterConfig.model_validate(data)


def test_unset_fields_inherit_the_top_level_engine_and_instances_their_tier():
    c = cfg(engine={"page_size": 16, "num_pages": 512, "torch_threads": 2},
            instances={"main_decode": 2},
            tiers={"main_decode": {"engine": {"dtype": "bfloat16", "page_size": 32, "min_step_ms": 20}},
                   "md1": {"engine": {"page_size": 64, "profile": PROFILE}}})
    md0, md1, p0, rld0 = (c.engine_for(n) for n in ("md0", "md1", "p0", "rld0"))
    assert (md0.dtype, md0.page_size, md0.num_pages, md0.min_step_ms, md0.torch_threads, md0.profile) == \
        ("bfloat16", 32, 512, 20.0, 2, None)
    assert (md1.dtype, md1.page_size, md1.min_step_ms, md1.profile) == ("bfloat16", 64, 20.0, PROFILE)
    assert p0 == rld0 == c.engine  # no block: the top-level engine itself
    assert c.engine_for("main_decode") == md0 and c.engine_for("d0") == md0  # same_dc_pd's decode tier
    assert c.hardware_profile("md1") == {"device": "cpu", "dtype": "bfloat16", "page_size": 64, "num_pages": 512,
                                         "max_batch_tokens": 512, "max_running": 64, "min_step_ms": 20.0,
                                         "profile": PROFILE, "torch_threads": 2}


def test_instance_names_map_to_tiers():
    assert [instance_tier(n) for n in ("p0", "rld3", "md1", "d0", "c2", "gateway", "mdx", "p")] == \
        ["prefill", "relay_decode", "main_decode", "main_decode", "colocated", None, None, None]


@pytest.mark.parametrize("data,message", [
    ({"tiers": {"decode": {}}}, "tiers.decode: unknown tier or instance name (tiers: prefill, relay_decode, "
                                "main_decode, colocated; instances: p0.., rld0.., md0.., d0.., c0..)"),
    ({"tiers": {"md1": {}}}, "tiers.md1: no such instance (instances.main_decode is 1)"),
    ({"tiers": {"main_decode": {"engine": {"page_size": 24}}}},
     "tiers.main_decode.engine.page_size: page_size must be a positive power of two, got 24"),
    ({"tiers": {"prefill": {"engine": {"page_size": 8192}}}},
     "tiers.prefill.engine: page_size 8192 does not fit max_model_len 4096"),
    ({"tiers": {"relay_decode": {"engine": {"dtype": "fp8"}}}},
     "tiers.relay_decode.engine.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    ({"tiers": {"prefill": {"engine": {"max_model_len": 8}}}},
     "tiers.prefill.engine.max_model_len: Extra inputs are not permitted"),
    ({"tiers": {"prefill": {"engine": {"profile": "/no/such.json"}}}},
     "tiers.prefill.engine.profile: profile /no/such.json: cannot read it (No such file or directory)"),
    ({"tiers": {"main_decode": {"engine": {"min_step_ms": -1}}}},
     "tiers.main_decode.engine.min_step_ms: Input should be greater than or equal to 0"),
    ({"engine": {"page_size": 12}}, "engine.page_size: page_size must be a positive power of two, got 12"),
])
def test_bad_tier_blocks_name_the_field(data, message):
    with pytest.raises(ValidationError) as e:
        ClusterConfig.model_validate(data)
    assert validation_summary(e.value) == message


def test_a_profile_that_is_not_one_is_refused(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"format": "pdd-profile/1", "prefill": [{"tokens": 16, "seconds": 0.01}]}))
    with pytest.raises(ValidationError) as e:
        cfg(tiers={"prefill": {"engine": {"profile": str(p)}}})
    assert validation_summary(e.value) == f"tiers.prefill.engine.profile: profile {p}: profile has 1 rows; need at least 6"


def test_the_cli_prints_the_field_not_a_traceback(capsys, tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"tiers": {"main_decode": {"engine": {"page_size": 48}}}}))
    with pytest.raises(SystemExit) as ex:
        main(["serve", "--config", str(p)])
    assert ex.value.code == 2
    assert capsys.readouterr().err == (f"pdd serve: error: --config {p}: invalid config: "
                                       "tiers.main_decode.engine.page_size: page_size must be a positive "
                                       "power of two, got 48\n")
