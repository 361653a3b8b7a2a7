"""Single-GPU throughput of the training loop: samples/s, MFU, data-wait share, memory, cudaMalloc retries.

Runs ``train.py`` once per variant (fp32 baseline, loader workers, DALI, bf16, fused Adam,
torch.compile, attention backends, the synthetic loader for the compute ceiling) for two epochs of
the chosen config and reports the second epoch. Prints a table and saves JSON.

    python benchmarks/throughput.py --data_path /data/full --config short --out benchmarks/results/h100.json
    python benchmarks/throughput.py --variants fp32_w0,opt_w8 --data_path data/tiny --config tiny   # quick check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, run_variant, table  # noqa: E402
from utils.core.errors import ArgumentParser, UserError, closest, run_cli  # noqa: E402

OPT = ["--amp_mode", "bf16", "--enable_fused", "true", "--enable_jit", "true"]
# our fastest settings (config short_opt): OPT + cuDNN attention + Programmatic Dependent Launch. On the
# H100 the default compile mode equalled CUDA graphs (reduce-overhead) and max-autotune did not finish
# compiling in 8 minutes.
FAST = OPT + ["--attention_backend", "cudnn", "--compile_pdl", "true"]
# FAST with attention on the packed QKV (kernels/cudnn_attention.py); a later argument overrides an earlier one
PACKED = FAST + ["--attention_backend", "cudnn_packed"]
FP8 = ["--amp_mode", "fp8"]
PURE = ["--amp_mode", "bf16_pure"]
SYNTH = ["--data_loader_config", "synthetic"]
VARIANTS = {
    # the reference code's three setups (native loader)
    "fp32_w0": ["--amp_mode", "none", "--num_data_workers", "0"],
    "fp32_w8": ["--amp_mode", "none", "--num_data_workers", "8"],
    "opt_w8": OPT + ["--num_data_workers", "8"],
    # loaders under our fastest compute settings
    "fast_w8": FAST + ["--num_data_workers", "8"],
    "fast_w12": FAST + ["--num_data_workers", "12"],
    "fast_dali_w8": FAST + ["--data_loader_config", "dali", "--num_data_workers", "8"],
    # one lever at a time, compute only (synthetic batches made on the GPU)
    "synthetic_fp32": SYNTH + ["--amp_mode", "none"],
    "synthetic_bf16": SYNTH + ["--amp_mode", "bf16"],
    "synthetic_bf16_fused": SYNTH + ["--amp_mode", "bf16", "--enable_fused", "true"],
    "synthetic_opt": SYNTH + OPT,
    "synthetic_opt_flash": SYNTH + OPT + ["--attention_backend", "flash"],
    "synthetic_fast": SYNTH + FAST,
    "synthetic_fast_autotune": SYNTH + FAST + ["--compile_mode", "max-autotune-no-cudagraphs"],
    "synthetic_fast_cudagraphs": SYNTH + FAST + ["--compile_mode", "reduce-overhead"],
    # round 2: packed-QKV attention, float8 linears (torchao), and their loaders
    "synthetic_packed": SYNTH + PACKED,
    "packed_w8": PACKED + ["--num_data_workers", "8"],
    "packed_w12": PACKED + ["--num_data_workers", "12"],
    "packed_dali_w8": PACKED + ["--data_loader_config", "dali", "--num_data_workers", "8"],
    "synthetic_fp8": SYNTH + FAST + FP8,
    "synthetic_fp8_rowwise": SYNTH + FAST + FP8 + ["--fp8_recipe", "rowwise"],
    "synthetic_fp8_packed": SYNTH + PACKED + FP8,
    "fp8_packed_w8": PACKED + FP8 + ["--num_data_workers", "8"],
    "fp8_packed_dali_w8": PACKED + FP8 + ["--data_loader_config", "dali", "--num_data_workers", "8"],
    # round 3: a bf16 residual stream (--amp_mode bf16_pure)
    "synthetic_pure": SYNTH + FAST + PURE,
    "synthetic_pure_packed": SYNTH + PACKED + PURE,
    "pure_packed_w8": PACKED + PURE + ["--num_data_workers", "8"],
    "pure_packed_dali_w8": PACKED + PURE + ["--data_loader_config", "dali", "--num_data_workers", "8"],
}
DEFAULT = ("fp32_w0,fp32_w8,opt_w8,fast_w8,fast_dali_w8,synthetic_fp32,synthetic_bf16,synthetic_opt,"
           "synthetic_fast")
COLUMNS = [("variant", "variant", "s"), ("samples/s", "samples_per_s", ".1f"), ("MFU", "mfu", ".1%"),
           ("data wait", "data_wait_share", ".0%"), ("peak alloc GiB", "memory/peak_allocated", ".2f"),
           ("peak reserved GiB", "memory/peak_reserved", ".2f"), ("retries", "memory/alloc_retries", "d"),
           ("wall s", "wall_s", ".0f")]


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="short")
    ap.add_argument("--data_path", required=True)
    ap.add_argument("--variants", default=DEFAULT, help=f"comma list from: {', '.join(VARIANTS)}")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per variant; the last one is reported")
    ap.add_argument("--extra", default="", help="extra train.py arguments for every variant")
    ap.add_argument("--expdir", default="/tmp/throughput_runs")
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise UserError(f"--variants: no variant {', '.join(unknown)}{closest(unknown[0], VARIANTS)}; pick from "
                        f"{', '.join(VARIANTS)}")

    from utils.config.loading import load_config, parse_overrides
    # the epoch length the runs will see, --extra included (e.g. --limit_nsamples)
    cfg = load_config("config/ViT.yaml", args.config, parse_overrides(args.extra.split()))
    steps = (cfg.data.limit_nsamples or 512) // cfg.optim.global_batch_size
    rows = Results(Path(args.out), config=args.config)
    for name in args.variants.split(","):
        common = ["--config", args.config, "--data_path", args.data_path, "--num_iters", str(args.epochs * steps),
                  "--valid_every", str(args.epochs), "--log_every", "1000"] + args.extra.split()
        rows.append(run_variant(name, common + VARIANTS[name], Path(args.expdir)))
    print(table(rows, COLUMNS))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
