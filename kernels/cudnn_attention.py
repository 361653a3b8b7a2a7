"""cuDNN flash attention on the packed QKV projection, through cudnn-frontend graphs.

``F.scaled_dot_product_attention`` takes q, k and v as three tensors. Its backward returns three
separate gradients, which autograd then copies into the ``(B, N, 3, H, D)`` gradient of the fused
QKV projection: about 0.6 ms per layer at local batch 16 on an H100 for this model's shapes
(``benchmarks/attention_kernels.py``). Here the cuDNN graphs read q, k and v in place from the packed
projection output (the ``BS3HD`` layout of the cuDNN support matrix) and the backward graph writes
dQ, dK and dV straight into one packed gradient, so nothing is assembled. The output is written as
``(B, N, H, D)``, which the output projection reads without a transpose copy. The kernels and the
math are cuDNN's flash attention (softmax(QK^T / sqrt(D)) V, Dao 2023), the same that PyTorch's cuDNN
backend runs.

Registered as a ``torch.library`` custom op with an autograd formula and a fake (meta) kernel, so
``torch.compile`` keeps it as one opaque call. Needs a CUDA GPU, bf16 or fp16 inputs and the
``nvidia-cudnn-frontend`` package (the ``cudnn`` extra); cudnn-frontend is imported on first use.

cuDNN docs: https://docs.nvidia.com/deeplearning/cudnn/frontend/latest/operations/Attention.html
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

# the input dtypes cuDNN flash attention supports
_SUPPORTED = (torch.bfloat16, torch.float16)


@dataclass
class AttentionGraphs:
    """The built forward and backward cuDNN graphs of one shape, and their tensor handles."""

    handle: object
    fwd: object
    bwd: object
    f: dict  # name -> forward graph tensor
    b: dict  # name -> backward graph tensor


def attention_strides(n: int, h: int, d: int) -> tuple[tuple, tuple]:
    """Strides of q/k/v viewed as (B, H, N, D) inside a packed (B, N, 3, H, D) buffer, and of a (B, N, H, D)
    buffer viewed as (B, H, N, D)."""
    return (n * 3 * h * d, d, 3 * h * d, 1), (n * h * d, d, h * d, 1)


def build_graph(graph) -> None:
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn_module().heur_mode.A, cudnn_module().heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as e:  # cudnn-frontend's error types share no base class with torch's
        raise RuntimeError(f"cuDNN has no attention kernel for this graph: {e}") from e


@lru_cache(maxsize=None)
def cudnn_module():
    import cudnn
    return cudnn


@lru_cache(maxsize=None)
def cudnn_handle(device_index: int):
    with torch.cuda.device(device_index):
        return cudnn_module().create_handle()


def declare_graphs(b: int, n: int, h: int, d: int, dtype: torch.dtype, handle) -> AttentionGraphs:
    """Declare the forward and backward cuDNN SDPA graphs of one shape, not yet planned or built.

    ``_graphs`` builds them with cuDNN's heuristics; ``benchmarks/attention_plans.py`` times every plan instead.
    """
    cudnn = cudnn_module()
    io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
    f32 = cudnn.data_type.FLOAT
    packed, dense = attention_strides(n, h, d)
    dims, scale = (b, h, n, d), 1.0 / math.sqrt(d)

    def graph():
        return cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    fwd = graph()
    f = {name: fwd.tensor(name=name, dim=dims, stride=packed, data_type=io) for name in "qkv"}
    f["o"], f["stats"] = fwd.sdpa(q=f["q"], k=f["k"], v=f["v"], generate_stats=True, attn_scale=scale,
                                  use_causal_mask=False)
    f["o"].set_output(True).set_dim(dims).set_stride(dense).set_data_type(io)
    f["stats"].set_output(True).set_dim((b, h, n, 1)).set_stride((h * n, n, 1, 1)).set_data_type(f32)

    bwd = graph()
    g = {name: bwd.tensor(name=name, dim=dims, stride=packed, data_type=io) for name in "qkv"}
    g["o"] = bwd.tensor(name="o", dim=dims, stride=dense, data_type=io)
    g["do"] = bwd.tensor(name="do", dim=dims, stride=dense, data_type=io)
    g["stats"] = bwd.tensor(name="stats", dim=(b, h, n, 1), stride=(h * n, n, 1, 1), data_type=f32)
    g["dq"], g["dk"], g["dv"] = bwd.sdpa_backward(q=g["q"], k=g["k"], v=g["v"], o=g["o"], dO=g["do"],
                                                  stats=g["stats"], attn_scale=scale, use_causal_mask=False)
    for name in ("dq", "dk", "dv"):
        g[name].set_output(True).set_dim(dims).set_stride(packed).set_data_type(io)
    return AttentionGraphs(handle, fwd, bwd, f, g)


@lru_cache(maxsize=None)
def _graphs(b: int, n: int, h: int, d: int, dtype: torch.dtype, device_index: int) -> AttentionGraphs:
    """Build (once per shape, dtype and device) the forward and backward cuDNN SDPA graphs."""
    gr = declare_graphs(b, n, h, d, dtype, cudnn_handle(device_index))
    build_graph(gr.fwd)
    build_graph(gr.bwd)
    return gr


def forward_pack(gr: AttentionGraphs, qkv: torch.Tensor, out: torch.Tensor, stats: torch.Tensor) -> dict:
    """The forward graph's tensors: packed ``qkv`` (B, N, 3, H, D) in, ``out`` (B, N, H, D) and ``stats``
    (B, H, N, 1) float32 written."""
    q, k, v = packed_views(qkv)
    return {gr.f["q"]: q, gr.f["k"]: k, gr.f["v"]: v, gr.f["o"]: out.transpose(1, 2), gr.f["stats"]: stats}


def backward_pack(gr: AttentionGraphs, qkv, out, stats, grad_out, grad_qkv) -> dict:
    """The backward graph's tensors: the forward's and ``grad_out`` (B, N, H, D, dense) in, ``grad_qkv``
    (B, N, 3, H, D) written."""
    q, k, v = packed_views(qkv)
    dq, dk, dv = packed_views(grad_qkv)
    return {gr.b["q"]: q, gr.b["k"]: k, gr.b["v"]: v, gr.b["o"]: out.transpose(1, 2),
            gr.b["do"]: grad_out.transpose(1, 2), gr.b["stats"]: stats, gr.b["dq"]: dq, gr.b["dk"]: dk,
            gr.b["dv"]: dv}


def packed_views(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as (B, H, N, D) views of a packed (B, N, 3, H, D) tensor."""
    return tuple(packed[:, :, i].transpose(1, 2) for i in range(3))


def execute_graph(graph, handle, pack: dict, device: torch.device) -> None:
    # cuDNN runs on the handle's stream: follow the caller's current stream (compile, NCCL overlap)
    cudnn_module().set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
    graph.execute(pack, workspace, handle=handle)


@torch.library.custom_op("era5vit::cudnn_packed_attention", mutates_args=(), device_types="cuda")
def _forward(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, _, h, d = qkv.shape
    gr = _graphs(b, n, h, d, qkv.dtype, qkv.device.index)
    out = qkv.new_empty(b, n, h, d)
    stats = qkv.new_empty(b, h, n, 1, dtype=torch.float32)
    execute_graph(gr.fwd, gr.handle, forward_pack(gr, qkv, out, stats), qkv.device)
    return out, stats


@_forward.register_fake
def _(qkv):
    b, n, _, h, d = qkv.shape
    return qkv.new_empty(b, n, h, d), qkv.new_empty(b, h, n, 1, dtype=torch.float32)


@torch.library.custom_op("era5vit::cudnn_packed_attention_backward", mutates_args=(), device_types="cuda")
def _backward(qkv: torch.Tensor, out: torch.Tensor, stats: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    b, n, _, h, d = qkv.shape
    gr = _graphs(b, n, h, d, qkv.dtype, qkv.device.index)
    grad_qkv = torch.empty_like(qkv)
    execute_graph(gr.bwd, gr.handle, backward_pack(gr, qkv, out, stats, grad_out, grad_qkv), qkv.device)
    return grad_qkv


@_backward.register_fake
def _(qkv, out, stats, grad_out):
    return torch.empty_like(qkv)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], *output)


def _autograd_backward(ctx, grad_out, grad_stats):
    qkv, out, stats = ctx.saved_tensors
    # the graphs read dO as a dense (B, N, H, D) buffer, like O
    return _backward(qkv, out, stats, grad_out.contiguous())


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def packed_attention(qkv: torch.Tensor) -> torch.Tensor:
    """Self-attention over a packed QKV projection.

    Args:
        qkv: ``(B, N, 3, H, D)`` bf16 or fp16 CUDA tensor, contiguous (the fused QKV projection's
            output viewed so; q, k, v are ``qkv[:, :, 0 / 1 / 2]``).

    Returns:
        ``(B, N, H, D)`` attention output, ``softmax(q k^T / sqrt(D)) v`` per head, same dtype.

    Raises:
        ValueError: ``qkv`` is not a contiguous 5-d bf16/fp16 CUDA tensor with 3 in dim 2.
        RuntimeError: cuDNN has no kernel for this shape and dtype on this GPU.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.dtype not in _SUPPORTED or not qkv.is_cuda:
        raise ValueError(f"packed_attention needs a (B, N, 3, H, D) bf16/fp16 CUDA tensor, got "
                         f"{tuple(qkv.shape)} {qkv.dtype} on {qkv.device}")
    return _forward(qkv.contiguous())[0]
