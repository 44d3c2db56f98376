"""Every figure of every chip in data/hardware/chips.json names its source (a datasheet line, or an
explicit assumption), and the cited lines carry the figure used."""

import re

import pytest

from pdd.sim.hardware import CHIP_FIGURES, get_chip, load_chips


@pytest.mark.parametrize("name", sorted(load_chips()))
def test_every_figure_is_cited(name):
    chip = get_chip(name)
    assert sorted(chip.cite) == sorted(CHIP_FIGURES), name
    for fig in CHIP_FIGURES:
        text = chip.cite[fig]
        assert text.strip() and (text.startswith("assumption: ") or "datasheet" in text or "product brief" in text
                                 or "data sheet" in text), (name, fig, text)


def _numbers(text: str) -> set[float]:
    return {float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


@pytest.mark.parametrize("name", sorted(load_chips()))
def test_cited_datasheet_lines_carry_the_figures(name):
    """HBM size, HBM bandwidth and the interconnect appear in their cited line (TB/s or GB/s);
    BF16 TFLOPS appears dense, or as twice the number ("with sparsity; dense = half")."""
    c = get_chip(name)
    assert c.hbm_gb in _numbers(c.cite["hbm_gb"])
    tb = _numbers(c.cite["hbm_tbps"])
    assert c.hbm_tbps in tb or round(c.hbm_tbps * 1000) in tb
    assert c.interconnect_gbps in _numbers(c.cite["interconnect_gbps"])
    tf = _numbers(c.cite["bf16_tflops"])
    assert c.bf16_tflops in tf or any(abs(x / 2 - c.bf16_tflops) <= 0.5 for x in tf)
    if not c.cite["nic_gbps"].startswith("assumption: "):
        assert c.nic_gbps in _numbers(c.cite["nic_gbps"])


def test_chips_without_citations_still_load_and_hash():
    from pdd.sim.hardware import Chip

    c = Chip("X", 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert c.cite == {} and hash(c) == hash(Chip("X", 1.0, 1.0, 1.0, 1.0, 1.0, 1.0))
    assert hash(get_chip("H20-96GB")) == hash(get_chip("H20-96GB"))
