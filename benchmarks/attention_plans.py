"""Every cuDNN plan of the packed attention graphs at one shape, timed: is there a kernel faster than the one
cuDNN's heuristics pick? (GPU only)

    python benchmarks/attention_plans.py --out benchmarks/results/attention_plans.json
    python benchmarks/attention_plans.py --batch 16 --heads 8 --head_dim 128 --out ...   # mp's blocks

Default shape: the ``short`` config's blocks at local batch 16 (16 x 4050 tokens, 8 heads of 48). For the
forward and the backward graph of ``kernels/cudnn_attention.py`` (what ``--attention_backend cudnn_packed``
runs; PyTorch's cuDNN backend asks the same cuDNN), the script

1. asks cuDNN's heuristics (modes A and B, and the fallback list) for their ranked plans and builds them all;
   the first one that builds is the kernel that training runs;
2. for each engine among those plans, builds one plan for every value of each knob the engine exposes
   (``get_knobs_for_engine``; with several knobs, every combination, each knob also left unset), and keeps the
   plans cuDNN finalizes;
3. times each built plan (mean of ``--iters`` runs after 3 warm-ups) and compares its output
   (forward: O; backward: the packed dQKV) with the training kernel's on the same inputs.

Prints the built plans, fastest first within each graph, with their time, TFLOP/s (forward 4BHN^2D, backward
2.5 times that; Dao 2023), workspace and largest difference. A plan whose output differs by more than
``--tolerance`` is marked ``wrong``: it computes something else, and a plan search has to check results too.
The JSON holds every plan tried, declined ones with cuDNN's reason. Needs the ``cudnn`` extra
(``nvidia-cudnn-frontend`` with the plan-enumeration API: ``create_execution_plan(engine, knobs)``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, add_attention_shape, mean_ms, table  # noqa: E402
from kernels.cudnn_attention import (backward_pack, cudnn_handle, cudnn_module, declare_graphs,  # noqa: E402
                                     forward_pack)
from utils.core.errors import ArgumentParser, UserError, run_cli  # noqa: E402

COLUMNS = [("graph", "graph", "s"), ("engine", "engine", "d"), ("knobs", "knobs", "s"), ("ms", "ms", ".3f"),
           ("TFLOP/s", "tflops", ".0f"), ("workspace MiB", "workspace_mib", ".1f"), ("max |diff|", "max_diff", ".2e"),
           ("note", "note", "s")]
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5}  # the backward's matmuls are 2.5x the forward's (Dao 2023)


class Problem:
    """The tensors of one shape, the training kernel's results on them (the reference), and per graph
    (``fwd``/``bwd``) a fresh declared graph with its variant pack."""

    def __init__(self, b: int, n: int, h: int, d: int):
        self.shape, self.handle = (b, n, h, d), cudnn_handle(torch.cuda.current_device())
        torch.manual_seed(0)
        make = dict(device="cuda", dtype=torch.bfloat16)
        self.qkv = torch.randn(b, n, 3, h, d, **make)
        self.grad_out = torch.randn(b, n, h, d, **make)
        self.out, self.stats = torch.ops.era5vit.cudnn_packed_attention(self.qkv)
        self.reference = {"fwd": self.out, "bwd": torch.ops.era5vit.cudnn_packed_attention_backward(
            self.qkv, self.out, self.stats, self.grad_out)}
        # the plans write here, so every backward plan reads the training kernel's O and stats
        self.output = {"fwd": torch.empty_like(self.out), "bwd": torch.empty_like(self.qkv)}
        self.plan_stats = torch.empty_like(self.stats)
        cudnn_module().set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)

    def graph(self, kind: str):
        """A fresh graph of ``kind``, validated and with its operation graph built (ready for plans), and its
        variant pack."""
        gr = declare_graphs(*self.shape, torch.bfloat16, self.handle)
        if kind == "fwd":
            graph, pack = gr.fwd, forward_pack(gr, self.qkv, self.output["fwd"], self.plan_stats)
        else:
            graph, pack = gr.bwd, backward_pack(gr, self.qkv, self.out, self.stats, self.grad_out, self.output["bwd"])
        graph.validate()
        graph.build_operation_graph()
        return graph, pack

    def flop(self, kind: str) -> float:
        b, n, h, d = self.shape
        return 4 * b * h * n * n * d * FLOP_FACTOR[kind]

    def max_diff(self, kind: str) -> float:
        return (self.output[kind].float() - self.reference[kind].float()).abs().max().item()


def plan_row(kind: str, engine: int, knobs: dict, note: str) -> dict:
    """The row of one plan: its graph, engine and knob values (by knob name)."""
    values = {str(k).split(".")[-1]: v for k, v in knobs.items()}
    return {"graph": kind, "engine": engine, "knobs": " ".join(f"{k}={v}" for k, v in sorted(values.items())) or "-",
            "knob_values": values, "note": note}


def heuristic_plans(problem: Problem, kind: str, iters: int, tolerance: float) -> tuple[list[dict], object]:
    """Rows for every plan of heuristics A, B and the fallback list, in their rank order, and the planned graph
    (it answers which knobs an engine has)."""
    cudnn = cudnn_module()
    graph, pack = problem.graph(kind)
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    rows = []
    for index in range(graph.get_execution_plan_count()):
        row = plan_row(kind, *graph.get_engine_and_knobs_at_index(index),
                       f"heuristics' #{index}" + (" (training's)" if index == 0 else ""))
        rows.append(timed(row, problem, kind, lambda: (graph, pack, index), iters, tolerance))
    return rows, graph


def knob_plans(problem: Problem, kind: str, engine: int, knobs_info, seen: set, iters: int,
               tolerance: float) -> list[dict]:
    """Rows for one plan of ``engine`` per combination of its knobs' values, but those whose (engine, knobs) are in
    ``seen`` (the heuristics' plans, timed already)."""
    axes = [[None] * (len(knobs_info) > 1) + list(range(k.min_value, k.max_value + 1, max(k.stride, 1)))
            for k in knobs_info]
    rows = []
    for values in itertools.product(*axes):
        knobs = {k.type: v for k, v in zip(knobs_info, values) if v is not None}
        row = plan_row(kind, engine, knobs, "knob sweep")
        if (engine, row["knobs"]) in seen:
            continue

        def build():
            graph, pack = problem.graph(kind)
            graph.create_execution_plan(engine, knobs)
            graph.check_support()
            graph.build_plan_at_index(0)
            return graph, pack, 0

        rows.append(timed(row, problem, kind, build, iters, tolerance))
    return rows


def timed(row: dict, problem: Problem, kind: str, build, iters: int, tolerance: float) -> dict:
    """Build, time and check one plan; a plan cuDNN declines keeps its reason in ``declined``, one whose output
    differs from the training kernel's by more than ``tolerance`` (or is NaN) is marked wrong."""
    try:
        graph, pack, index = build()
        workspace = torch.empty(graph.get_workspace_size_plan_at_index(index), device="cuda", dtype=torch.uint8)
        row["ms"] = mean_ms(lambda: graph.execute_plan_at_index(pack, workspace, index, handle=problem.handle), iters)
    except Exception as e:  # cudnn-frontend's error types share no base class
        row["declined"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        return row
    row["workspace_mib"] = workspace.numel() / 2**20
    row["tflops"] = problem.flop(kind) / row["ms"] / 1e9
    row["max_diff"] = problem.max_diff(kind)
    if not row["max_diff"] <= tolerance:  # NaN too
        row["note"] += "; wrong"
    return row


def survey(problem: Problem, kind: str, iters: int, tolerance: float) -> list[dict]:
    """The heuristics' plans of graph ``kind``, then the knob sweep of each of their engines (plans not seen)."""
    rows, graph = heuristic_plans(problem, kind, iters, tolerance)
    seen = {(r["engine"], r["knobs"]) for r in rows}
    for engine in dict.fromkeys(r["engine"] for r in rows):
        rows += knob_plans(problem, kind, engine, graph.get_knobs_for_engine(engine), seen, iters, tolerance)
    return rows


def check_frontend() -> None:
    try:
        cudnn = cudnn_module()
    except ImportError:
        raise UserError("benchmarks/attention_plans.py needs cudnn-frontend: pip install -e '.[cudnn]'") from None
    if not all(hasattr(cudnn.pygraph, name) for name in ("create_execution_plan", "get_engine_and_knobs_at_index")):
        raise UserError(f"cudnn-frontend {cudnn.__version__} cannot enumerate plans and knobs; "
                        "install a newer one: pip install -U nvidia-cudnn-frontend")


def check_arguments(args) -> None:
    """Refuse a shape or setting that cannot be measured, before any GPU work."""
    for name in ("batch", "tokens", "heads", "head_dim", "iters"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.head_dim % 8:
        raise UserError(f"--head_dim {args.head_dim} is not a multiple of 8, which cuDNN's attention needs; "
                        "use e.g. 48, 64 or 128")
    if not args.tolerance >= 0:
        raise UserError(f"--tolerance must be 0 or more, got {args.tolerance}")


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_attention_shape(ap)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="largest difference from the training kernel's result that still counts as the same")
    ap.add_argument("--out", default="benchmarks/results/attention_plans.json")
    args = ap.parse_args(argv)
    check_arguments(args)
    if not torch.cuda.is_available():
        raise UserError("benchmarks/attention_plans.py times GPU kernels and no CUDA GPU is visible; run it on a GPU")
    check_frontend()
    shape = (args.batch, args.tokens, args.heads, args.head_dim)
    problem = Problem(*shape)
    rows = Results(Path(args.out), shape=dict(zip(("batch", "tokens", "heads", "head_dim"), shape)),
                   cudnn_backend=torch.backends.cudnn.version(), cudnn_frontend=cudnn_module().__version__)
    for kind in ("fwd", "bwd"):
        for row in survey(problem, kind, args.iters, args.tolerance):
            rows.append(row)  # Results.append saves each row
    built = sorted((r for r in rows if "ms" in r), key=lambda r: (r["graph"] == "bwd", r["ms"]))
    print(table(built, COLUMNS))
    print(f"{len(built)} plans built of {len(rows)} tried; saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
