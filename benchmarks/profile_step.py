"""Where a training step's GPU time goes: torch.profiler over a few steps, top kernels by CUDA time.

    python benchmarks/profile_step.py --config short_opt --data_loader_config synthetic --attention_backend cudnn

Takes the same ``--<key> <value>`` overrides as train.py (plus ``--rows N``, default 30). Prints the step time and a table of
the most expensive kernels; writes a Chrome trace (open in chrome://tracing or Perfetto) with
``--trace FILE``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from distributed.world import init_distributed
    from utils.config.loading import load_config, parse_overrides
    from utils.train.trainer import Trainer

    overrides = parse_overrides(argv)
    trace = overrides.pop("trace", None)
    warmup, steps = int(overrides.pop("warmup_steps", 8)), int(overrides.pop("profile_steps_n", 5))
    rows = int(overrides.pop("rows", 30))
    cfg = load_config(overrides.pop("yaml_config", "config/ViT.yaml"), overrides.pop("config", "short_opt"),
                      {"expdir": "/tmp/profile_runs", "save_checkpoint": "false", **overrides})
    world = init_distributed(cfg.parallel)
    trainer = Trainer(cfg, world)
    trainer.model.train()

    def batches():
        while True:
            yield from trainer.data.train

    it = batches()
    for _ in range(warmup):
        trainer.train_step(it)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(it)
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"step {plain_ms:.1f} ms (not profiled), {trainer.global_bs / plain_ms * 1e3:.1f} samples/s")
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step(it)
        torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"step {step_ms:.1f} ms (profiled), {trainer.global_bs / step_ms * 1e3:.1f} samples/s")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))
    if trace:
        prof.export_chrome_trace(trace)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
