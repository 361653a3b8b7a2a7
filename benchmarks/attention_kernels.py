"""Kernel-level timings behind the attention and precision choices, at one block's shapes (GPU only).

    python benchmarks/attention_kernels.py --out benchmarks/results/h100_attention_kernels.json

Times, for local batch B, N tokens, H heads of head dim D (default: the ``short`` config at local batch
16: 16 x 4050 tokens, 8 heads of 48):
- attention forward and forward+backward, with the backward writing the gradient of the packed
  ``(B, N, 3, H, D)`` QKV projection output, for PyTorch's cuDNN and flash SDPA backends and for our
  packed-QKV cuDNN kernel (``kernels/cudnn_attention.py``), with the largest difference from PyTorch's
  cuDNN backend;
- cuDNN's FP8 attention (cudnn-frontend ``sdpa_fp8``: e4m3 q, k, v and output, per-tensor scales):
  forward time, and whether cuDNN builds the FP8 backward for this head dim (on Hopper it declines
  unless D = 128);
- where it builds, our fp8 attention on the packed QKV (``kernels/cudnn_fp8_attention.py``, what
  ``--amp_mode fp8`` runs), forward and forward+backward, with its relative L2 error against cuDNN bf16;
- the block's four GEMMs (QKV, output projection, MLP in and out) in bf16 and in FP8 (``torch._scaled_mm``,
  e4m3, per-tensor scales), forward shape only.
Each time is the mean of ``--iters`` calls after 3 warm-ups. Prints a table and saves JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Results, add_attention_shape, mean_ms, table  # noqa: E402
from kernels.cudnn_attention import packed_attention  # noqa: E402
from kernels.cudnn_fp8_attention import fp8_attention_unsupported, fp8_packed_attention  # noqa: E402
from utils.core.errors import ArgumentParser, run_cli  # noqa: E402

COLUMNS = [("kernel", "kernel", "s"), ("fwd ms", "fwd_ms", ".3f"), ("fwd+bwd ms", "fwd_bwd_ms", ".3f"),
           ("TFLOP/s", "tflops", ".0f"), ("max |diff|", "max_diff", ".2e"), ("note", "note", "s")]


def sdpa_attend(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def attention_row(name: str, attend, qkv: torch.Tensor, grad: torch.Tensor, iters: int, ref=None) -> dict:
    """Time ``attend`` (packed (B, N, 3, H, D) -> (B, N, H, D)) forward and forward+backward."""
    x = qkv.detach().requires_grad_(True)

    def fwd_bwd():
        x.grad = None
        attend(x).backward(grad)

    with torch.no_grad():
        fwd = mean_ms(lambda: attend(x), iters)
    row = {"kernel": name, "fwd_ms": fwd, "fwd_bwd_ms": mean_ms(fwd_bwd, iters)}
    b, n, _, h, d = qkv.shape
    row["tflops"] = 4 * b * h * n * n * d * 3.5 / row["fwd_bwd_ms"] / 1e9  # fwd 4BHN^2D, bwd 2.5x fwd
    fwd_bwd()
    result = (attend(x).detach(), x.grad.detach())
    if ref is not None:
        row["max_diff"] = max((a.float() - r.float()).abs().max().item() for a, r in zip(result, ref))
    return row, result


def sdpa_with(backend):
    from torch.nn.attention import sdpa_kernel

    def attend(qkv):
        with sdpa_kernel(backend):
            return sdpa_attend(qkv)
    return attend


def fp8_attention_rows(b: int, n: int, h: int, d: int, iters: int) -> list[dict]:
    """cuDNN FP8 attention: time the forward; report whether the backward builds."""
    import cudnn
    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    packed, dense, dims = (n * 3 * h * d, d, 3 * h * d, 1), (n * h * d, d, h * d, 1), (b, h, n, d)
    handle = cudnn.create_handle()

    def graph():
        return cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def scalars(g, names):
        return {s: g.tensor(name=s, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32) for s in names}

    def build(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()

    g = graph()
    t = {s: g.tensor(name=s, dim=dims, stride=packed, data_type=fp8) for s in "qkv"}
    sc = scalars(g, ["dq", "dk", "dv", "ds", "ss", "so"])
    o, stats, amax_s, amax_o = g.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], descale_q=sc["dq"], descale_k=sc["dk"],
                                          descale_v=sc["dv"], descale_s=sc["ds"], scale_s=sc["ss"],
                                          scale_o=sc["so"], generate_stats=True, attn_scale=1 / math.sqrt(d),
                                          use_causal_mask=False)
    o.set_output(True).set_dim(dims).set_stride(dense).set_data_type(fp8)
    stats.set_output(True).set_dim((b, h, n, 1)).set_stride((h * n, n, 1, 1)).set_data_type(f32)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    row = {"kernel": "cudnn_fp8", "note": "e4m3 in/out, per-tensor scales"}
    try:
        build(g)
    except Exception as e:  # cudnn-frontend's own error types
        return [dict(row, note=f"forward not built: {str(e)[:200]}")]
    qkv = torch.randn(b, n, 3, h, d, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones(1, 1, 1, 1, device="cuda")
    pack = {t[s]: qkv[:, :, i].transpose(1, 2) for i, s in enumerate("qkv")}
    pack.update({sc[s]: one for s in sc})
    pack.update({o: torch.empty(b, n, h, d, device="cuda", dtype=torch.float8_e4m3fn).transpose(1, 2),
                 stats: torch.empty(b, h, n, 1, device="cuda"), amax_s: one.clone(), amax_o: one.clone()})
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    row["fwd_ms"] = mean_ms(lambda: g.execute(pack, ws, handle=handle), iters)
    row["tflops"] = 4 * b * h * n * n * d / row["fwd_ms"] / 1e9
    row["note"] += "; backward: " + fp8_backward_support(graph, scalars, build, dims, packed, dense, d)
    return [row]


def fp8_backward_support(graph, scalars, build, dims, packed, dense, d) -> str:
    import cudnn
    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    g = graph()
    t = {s: g.tensor(name=s, dim=dims, stride=packed, data_type=fp8) for s in "qkv"}
    o, do = (g.tensor(name=s, dim=dims, stride=dense, data_type=fp8) for s in ("o", "do"))
    stats = g.tensor(name="stats", dim=dims[:3] + (1,), stride=(dims[1] * dims[2], dims[2], 1, 1), data_type=f32)
    names = ["descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
             "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"]
    outs = g.sdpa_fp8_backward(q=t["q"], k=t["k"], v=t["v"], o=o, dO=do, stats=stats, attn_scale=1 / math.sqrt(d),
                               use_causal_mask=False, **scalars(g, names))
    for x in outs[:3]:
        x.set_output(True).set_dim(dims).set_stride(packed).set_data_type(fp8)
    for x in outs[3:]:
        x.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    try:
        build(g)
        return "builds"
    except Exception as e:  # cudnn-frontend's own error types
        return f"not built ({str(e)[:160]})"


def gemm_rows(tokens: int, dim: int, hidden: int, iters: int) -> list[dict]:
    """bf16 and FP8 (e4m3, per-tensor scales) forward GEMMs of one block's linear layers."""
    rows = []
    one = torch.ones((), device="cuda")
    for name, k, n in (("qkv", dim, 3 * dim), ("proj", dim, dim), ("fc1", dim, hidden), ("fc2", hidden, dim)):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        for prec, fn in (("bf16", lambda: x @ w.t()),
                         ("fp8", lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16))):
            ms = mean_ms(fn, iters)
            rows.append({"kernel": f"gemm_{name}_{prec}", "fwd_ms": ms, "tflops": 2 * tokens * k * n / ms / 1e9,
                         "note": f"({tokens} x {k}) @ ({k} x {n})"})
    return rows


def main(argv: list[str]) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_attention_shape(ap)
    ap.add_argument("--mlp_ratio", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/attention_kernels.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: benchmarks/attention_kernels.py times GPU kernels and no CUDA GPU is visible; run it on a GPU")
        return 2
    from torch.nn.attention import SDPBackend
    b, n, h, d = args.batch, args.tokens, args.heads, args.head_dim
    torch.manual_seed(0)
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    rows = Results(Path(args.out), shape={"batch": b, "tokens": n, "heads": h, "head_dim": d})
    ref_row, ref = attention_row("sdpa_cudnn", sdpa_with(SDPBackend.CUDNN_ATTENTION), qkv, grad, args.iters)
    rows.append(ref_row)
    rows.append(attention_row("sdpa_flash", sdpa_with(SDPBackend.FLASH_ATTENTION), qkv, grad, args.iters, ref)[0])
    rows.append(attention_row("cudnn_packed", packed_attention, qkv, grad, args.iters, ref)[0])
    why_not = fp8_attention_unsupported(qkv.device, d)
    if why_not is None:
        row, result = attention_row("cudnn_fp8_packed", fp8_packed_attention, qkv, grad, args.iters, ref)
        errors = [((a.float() - r.float()).norm() / r.float().norm()).item() for a, r in zip(result, ref)]
        rows.append(dict(row, note=f"relative error: output {errors[0]:.3f}, gradient {errors[1]:.3f}"))
    else:
        rows.append({"kernel": "cudnn_fp8_packed", "note": f"not run: {why_not}"})
    for row in fp8_attention_rows(b, n, h, d, args.iters) + gemm_rows(b * n, h * d, int(h * d * args.mlp_ratio),
                                                                       args.iters):
        rows.append(row)
    print(table(rows, COLUMNS))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
