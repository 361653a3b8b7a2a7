"""Where fp8 pays (utils/precision/fp8_advice.py): the measured table, the width it names, the warning of a slower fp8 run
and the help text."""

from __future__ import annotations

import logging

import pytest

from utils.precision.fp8_advice import MEASURED, Fp8Measurement, fp8_advice, measured, pays_from

H100 = "NVIDIA H100 80GB HBM3"


def rows(*ratios_by_width) -> tuple[Fp8Measurement, ...]:
    return tuple(Fp8Measurement(f"w{w}", w, 1, 100.0, 100.0 * r, "test") for w, r in ratios_by_width)


def test_the_h100_figures_are_the_measured_ones():
    key, h100 = measured(H100)
    assert key == "H100" and [(r.config, r.width) for r in h100] == [("short", 384), ("mp", 1024), ("vit_2b", 2560)]
    assert [round(r.ratio, 2) for r in h100] == [0.84, 0.91, 1.09]
    assert all(r.source for r in h100) and measured("NVIDIA A100-SXM4-40GB") is None


@pytest.mark.parametrize("table,width", [
    (rows((384, 0.84), (1024, 0.88), (2560, 1.09)), 2560),
    (rows((384, 0.9), (1024, 1.1), (2560, 1.2)), 1024),
    (rows((384, 1.0), (1024, 1.1)), 384),
    (rows((384, 1.1), (1024, 0.9), (2560, 1.2)), 2560),  # a dip: it pays only from where it always paid
    (rows((384, 0.9), (1024, 0.95)), None),
])
def test_fp8_pays_from_the_width_where_every_wider_one_paid(table, width):
    assert pays_from(table) == width


@pytest.mark.parametrize("width,slower,words", [
    (384, True, ["--amp_mode fp8 at width 384 is below 2560", "measured fp8/bf16 0.84 at width 384 (short)",
                 "--amp_mode bf16"]),
    (1024, True, ["below 2560", "0.91 at width 1024 (mp)"]),
    (768, True, ["0.91 at width 1024"]),  # the nearest measured width
    (2560, False, ["fp8 pays from width 2560 on this GPU (H100)", "1.09 at width 2560 (vit_2b)"]),
    (4096, False, ["fp8 pays from width 2560"]),
])
def test_advice_quotes_the_measured_ratio(width, slower, words):
    got_slower, line = fp8_advice(H100, width)
    assert got_slower == slower and "\n" not in line
    assert all(w in line for w in words), line


def test_no_advice_for_a_gpu_never_measured(monkeypatch):
    assert fp8_advice("NVIDIA GH200 480GB", 384) is None
    monkeypatch.setitem(MEASURED, "L40S", rows((384, 0.7), (1024, 0.8)))
    slower, line = fp8_advice("NVIDIA L40S", 4096)
    assert slower and "slower than bf16 at every width measured on an L40S (up to 1024" in line


def test_the_warning_is_one_line_once_per_process(caplog):
    from utils.precision.float8 import log_fp8_advice
    log_fp8_advice.cache_clear()
    with caplog.at_level(logging.INFO, logger="utils.precision.float8"):
        for _ in range(3):  # the batch tuner builds a model per trial
            log_fp8_advice(H100, 384)
        log_fp8_advice(H100, 2560)
        log_fp8_advice("NVIDIA A100-SXM4-40GB", 384)
    assert [(r.levelno, r.getMessage()[:30]) for r in caplog.records] == [
        (logging.WARNING, "--amp_mode fp8 at width 384 is"), (logging.INFO, "fp8 pays from width 2560 on th")]


def test_help_says_where_fp8_pays():
    from utils.config.command_line import key_help
    text = " ".join(key_help("amp_mode").split())
    assert "on an H100 fp8 pays from width 2560 (x0.84 at 384, x0.91 at 1024, x1.09 at 2560)" in text
    assert "bf16_pure" in text
