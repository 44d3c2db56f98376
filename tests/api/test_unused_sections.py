"""A config's ``tiers`` blocks and instance counts that name nothing of the mode served
(``tiers.prefill`` in colocated mode, whose one tier is ``colocated``; ``tiers.md0`` in
same_dc_pd, whose decoders are ``d0``..; ``instances.relay_decode`` outside pdd) were ignored
silently: ``pdd serve`` notes them in one line before it starts anything (a config may be shared
by modes, as ``pdd bench --config`` runs several, so it is served all the same)."""

import pytest

from pdd.cli import main
from pdd.config import ClusterConfig

ENGINE = {"engine": {"min_step_ms": 5}}


@pytest.mark.parametrize("mode,tiers,instances,unused", [
    ("colocated", {"prefill": ENGINE, "colocated": ENGINE}, {}, ["tiers.prefill"]),
    ("colocated", {"main_decode": ENGINE, "c0": ENGINE, "md0": ENGINE}, {"main_decode": 2},
     ["tiers.main_decode", "tiers.md0", "instances.main_decode"]),
    ("same_dc_pd", {"md0": ENGINE, "d0": ENGINE, "relay_decode": ENGINE}, {"relay_decode": 2},
     ["tiers.md0", "tiers.relay_decode", "instances.relay_decode"]),
    ("cross_dc_pd", {"colocated": ENGINE, "prefill": ENGINE}, {}, ["tiers.colocated"]),
    ("pdd", {"prefill": ENGINE, "relay_decode": ENGINE, "main_decode": ENGINE, "rld0": ENGINE}, {"relay_decode": 2},
     []),
    ("pdd", {"d0": ENGINE}, {}, ["tiers.d0"]),
])
def test_the_sections_a_mode_does_not_use_are_listed(mode, tiers, instances, unused):
    cfg = ClusterConfig.model_validate({"mode": mode, "tiers": tiers, "instances": instances})
    assert cfg.unused_sections() == unused


def test_defaults_are_not_the_user_s_sections():
    assert ClusterConfig(mode="colocated").unused_sections() == []


def test_serve_notes_a_tier_block_colocated_mode_ignores(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mode: colocated\ntiers: {prefill: {engine: {min_step_ms: 5}}}\ninstances: {relay_decode: 2}\n")
    with pytest.raises(SystemExit):  # --autoscale without roles stops it right after the note
        main(["serve", "--config", str(cfg), "--autoscale"])
    assert capsys.readouterr().err.splitlines()[0] == (
        "pdd: note: mode colocated runs c0 (tier colocated); no instance of it uses tiers.prefill, "
        "instances.relay_decode")
