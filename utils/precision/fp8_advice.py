"""Where ``--amp_mode fp8`` pays: this project's measured fp8 / bf16 training throughput per GPU and model width.

float8 speeds up the linears' GEMMs but adds cast and amax passes over their operands; at small widths the
GEMMs are too small a share of the step (attention dominates at 4050 tokens) for the gain to cover the
casts. Each row is one measurement of compute only (``--data_loader_config synthetic``, compiled, PDL), bf16
and fp8 in the same lease; a GPU that is not listed has no claim made for it. ``--help amp_mode``, the
start of an fp8 run and the batch tuner quote this table (:func:`fp8_advice`). ``benchmarks/check.py``
re-measures the ``short`` row.

No torch here: ``--help`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8Measurement:
    """One config on one GPU: samples/s with bf16 autocast and with fp8, and where the figures are kept."""

    config: str
    width: int  # embed_dim
    local_batch: int
    bf16: float  # samples/s
    fp8: float
    source: str

    @property
    def ratio(self) -> float:
        return self.fp8 / self.bf16


# issue 29's table (H100, torch 2.11, 2026-11-25, third epoch; bf16 with --attention_backend cudnn_packed for
# short); no JSON of that lease is in benchmarks/results (its short pair repeats h100_round2_compute.json's
# synthetic_packed / synthetic_fp8_packed, 182.8 / 151.5 on 2026-11-24)
_ISSUE_29 = "issue 29 and ../shared/GPU.md (H100, 2026-11-25)"
# with fp8 attention (kernels/cudnn_fp8_attention.py; head dim 128) against bf16_pure, the best bf16 mode
_FP8_ATTENTION = ("benchmarks/results/fp8_attention/profile_mp_bf16_pure.json and profile_mp_fp8_attention.json "
                  "(H100, 2026-11-25, fp8 attention)")
MEASURED: dict[str, tuple[Fp8Measurement, ...]] = {
    "H100": (Fp8Measurement("short", 384, 16, 179.1, 150.2, _ISSUE_29),
             Fp8Measurement("mp", 1024, 16, 77.5, 70.7, _FP8_ATTENTION),
             Fp8Measurement("vit_2b", 2560, 4, 7.4, 8.1, _ISSUE_29 + ", full activation checkpointing")),
}


def measured(gpu_name: str) -> tuple[str, tuple[Fp8Measurement, ...]] | None:
    """The table key that ``gpu_name`` (``torch.cuda.get_device_name``, e.g. ``NVIDIA H100 80GB HBM3``) names,
    and its rows by width; None for a GPU that was not measured."""
    for key, rows in MEASURED.items():
        if key in gpu_name:
            return key, tuple(sorted(rows, key=lambda r: r.width))
    return None


def pays_from(rows: tuple[Fp8Measurement, ...]) -> int | None:
    """The smallest measured width from which fp8 was at least as fast as bf16 at every measured width;
    None when it was slower at the widest one."""
    width = None
    for row in reversed(rows):
        if row.ratio < 1:
            break
        width = row.width
    return width


def fp8_advice(gpu_name: str, width: int) -> tuple[bool, str] | None:
    """``(slower, line)``: whether fp8 measured slower than bf16 near ``width`` on this GPU, and one line
    saying so with the measured ratio and the width from which fp8 pays; None for an unmeasured GPU."""
    found = measured(gpu_name)
    if found is None:
        return None
    key, rows = found
    start = pays_from(rows)
    near = min(rows, key=lambda r: abs(r.width - width))
    ratio = f"measured fp8/bf16 {near.ratio:.2f} at width {near.width} ({near.config})"
    if start is None:
        return True, (f"--amp_mode fp8 was slower than bf16 at every width measured on an {key} (up to "
                      f"{rows[-1].width}; {ratio}); use --amp_mode bf16 for speed")
    if width >= start:
        return False, f"fp8 pays from width {start} on this GPU ({key}); {ratio}"
    return True, (f"--amp_mode fp8 at width {width} is below {start}, from where fp8 pays on this GPU ({key}): "
                  f"{ratio}; use --amp_mode bf16 for speed")


def help_note() -> str:
    """The sentence of ``--help amp_mode`` on where fp8 pays, per measured GPU."""
    notes = []
    for key in MEASURED:
        rows = measured(key)[1]
        start = pays_from(rows)
        ratios = ", ".join(f"x{r.ratio:.2f} at {r.width}" for r in rows)
        notes.append(f"on an {key} fp8 pays from width {start} ({ratios})" if start else
                     f"on an {key} fp8 was slower at every measured width ({ratios})")
    return "measured speed of fp8 against bf16: " + "; ".join(notes)
