"""A YAML alias bomb ("billion laughs") well within the 64-level depth cap loads at once (PyYAML
shares an alias's object) but expands, for pydantic's validation and every later walk, into
millions of values: a config file is refused once its values, aliases expanded, pass
``MAX_CONFIG_NODES``, in one line naming the file. Asserted on the error, not on time."""

import pytest

from pdd.cli import main
from pdd.config import MAX_CONFIG_NODES, ClusterConfig, ConfigFileError
from tests.cli_usage import usage_error


def _bomb(path, levels: int = 7, fan: int = 10, field: str = "security: {api_keys: *l%d}"):
    """``levels`` lists of ``fan`` aliases of the one below: fan ** levels strings once expanded
    (10 ** 7 here), in a file of a few hundred bytes."""
    lines = ["l0: &l0 [" + ", ".join(['"k"'] * fan) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]" for i in range(1, levels)]
    path.write_text("\n".join(lines) + "\n" + field % (levels - 1) + "\n")
    return path


TOO_MANY = (f"holds more than {MAX_CONFIG_NODES:,} values once its YAML aliases are expanded (lists, mappings and "
            "scalars); no config is that large (an alias bomb?)")


@pytest.mark.parametrize("field", ["engine: {page_size: *l%d}", "link: {wan_cross_traffic: *l%d}",
                                   "policy: {cutoff: *l%d}", "security: {api_keys: *l%d}"])
def test_an_alias_bomb_is_refused_naming_the_file(tmp_path, field):
    """Under ``engine.page_size`` a bomb of 10 ** 7 values took 8.5 s to refuse, 10 ** 8 ten times
    that (``pdd serve --config``, before this check)."""
    cfg = _bomb(tmp_path / "bomb.yaml", field=field)
    assert cfg.stat().st_size < 1000
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(cfg)
    assert str(ex.value) == f"{cfg}: {TOO_MANY}"


def test_a_bomb_under_a_field_the_config_lacks_is_refused_too(tmp_path):
    cfg = _bomb(tmp_path / "bomb.yaml", field="engine: {nosuch: *l%d}")
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(cfg)
    assert str(ex.value) == f"{cfg}: {TOO_MANY}"


def test_serve_refuses_an_alias_bomb_in_one_line(tmp_path, capsys):
    cfg = _bomb(tmp_path / "bomb.yaml")
    assert usage_error(capsys, main, ["serve", "--config", str(cfg)]) == f"pdd serve: error: --config {cfg}: {TOO_MANY}\n"


def test_aliases_that_expand_to_a_few_values_stay_accepted(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine: &e {page_size: 16}\ntiers: {prefill: {engine: *e}, main_decode: {engine: *e}}\n")
    c = ClusterConfig.load(cfg)
    assert c.tiers["prefill"].engine.page_size == c.tiers["main_decode"].engine.page_size == 16
