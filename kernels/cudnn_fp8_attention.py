"""FP8 attention on the packed QKV projection, through cuDNN's fp8 flash attention (``--amp_mode fp8``).

Forward: q, k and v are cast to float8 e4m3 with one scale each from their current amax, the softmax
probabilities P travel inside the kernel in e4m3, and the output O comes back in e4m3; backward: dO is cast to
e5m2 and dQ, dK, dV come back in e5m2 (the hybrid format of Micikevicius et al., "FP8 Formats for Deep
Learning", 2022: e4m3 forward, e5m2 gradients, as our float8 linears use). On Hopper cuDNN writes O and the
gradients only in fp8 (bf16 outputs need Blackwell), and it needs every scale before the kernel runs, while
only q, k, v and dO exist then. So the other scales come from bounds that always hold, and no state is
carried from step to step (resume stays exact and checkpoints stay plain):

* P: ``0 <= P <= 1``, scale ``2^8``;
* O: a convex combination of rows of V, ``|O| <= max|V|``: V's scale, halved;
* dP = dO V^T: ``|dP_ij| <= max_i |dO_i| max_j |V_j|`` (row 2-norms, Cauchy-Schwarz);
* dS = P * (dP - rowsum(P * dP)), so ``sum_j |dS_ij| <= 2 max|dP|`` and ``sum_i |dS_ij| <= 2 N max|dP|``;
  then ``|dQ| <= 2 s max|dP| max|K|``, ``|dK| <= 2 s N max|dP| max|Q|`` (s = 1/sqrt(D)) and
  ``|dV| <= N max|dO|``.

Each head's keys are centred first (their mean over the tokens subtracted): that moves every row of logits by a
constant, which softmax ignores, so output and gradients are those of the keys given, and it makes each row's
mean logit 0, so its largest is at least 0. Without it a query facing away from all keys (every logit of its
row below about -100, met in `vit_2b` after ten steps) got an output of zeros from cuDNN's fp8 forward and a
NaN gradient row from its backward, while the bf16 kernel and fp32 attention give finite values.

Every scale is a power of two (exact in any float format, so quantizing and its inverse add no rounding of
their own) at least one factor of two below the format's largest value over the bound. e5m2 spans 32 binades,
so the loose gradient bounds (up to a factor N) still leave the gradients about 20 binades.

The kernel reads q, k, v where the quantized projection lies, ``(B, N, 3, H, D)``, and writes dQ, dK, dV into
one packed gradient, as ``kernels/cudnn_attention.py`` does in bf16. Hopper's cuDNN (9.19) builds it only at
head dim 128; :func:`fp8_attention_unsupported` says why it cannot run elsewhere.

cuDNN docs: https://docs.nvidia.com/deeplearning/cudnn/frontend/latest/operations/Attention.html
"""

from __future__ import annotations

import importlib.util
import math
from functools import lru_cache

import torch

from kernels.cudnn_attention import (AttentionGraphs, attention_strides, build_graph, cudnn_handle, cudnn_module,
                                     execute_graph, packed_views)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
P_SCALE = 2.0 ** 8
# indices into the saved scales (forward -> backward): the three descales of q, k, v, O's descale, the amax of q
# and k, and the largest row 2-norm of V
DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_O, AMAX_Q, AMAX_K, VNORM = range(7)
GRADIENT_SCALES = ("scale_dO", "scale_dP", "scale_dQ", "scale_dK", "scale_dV")
_BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


def pow2_scale(bound: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """The largest power of two ``c`` with ``c * bound <= fmt_max``, at least one binade of headroom: ``bound``
    is any fp32 tensor of upper bounds (zeros allowed), returned elementwise as fp32."""
    exponent = torch.floor(torch.log2(fmt_max / bound.float().clamp_min(2.0 ** -100))) - 1
    return torch.exp2(exponent.clamp(-100, 100))


def center_keys(qkv: torch.Tensor) -> torch.Tensor:
    """``qkv`` ``(B, N, 3, H, D)`` with the keys ``qkv[:, :, 1]`` less their mean over the N tokens, per batch
    entry and head; q and v unchanged. The projection is symmetric, so the same function maps the centred keys'
    gradient to the given keys' gradient (it subtracts the gradient's token mean, zero in exact arithmetic since
    each row of the score gradient sums to zero)."""
    keys = qkv[:, :, 1:2]
    return torch.cat([qkv[:, :, :1], keys - keys.mean(dim=1, keepdim=True), qkv[:, :, 2:]], dim=2)


def forward_scales(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 scales of q, k, v ``(3,)`` and the saved scalars ``(7,)`` (see the module docstring), fp32,
    from a packed ``(B, N, 3, H, D)`` projection."""
    amax = qkv.abs().amax(dim=(0, 1, 3, 4)).float()
    scale = pow2_scale(amax, E4M3_MAX)
    vnorm = torch.linalg.vector_norm(qkv[:, :, 2].float(), dim=-1).amax()
    saved = torch.stack([1 / scale[0], 1 / scale[1], 1 / scale[2], 2 / scale[2], amax[0], amax[1], vnorm])
    return scale, saved


def backward_scales(grad_out: torch.Tensor, saved: torch.Tensor, n: int, head_dim: int) -> dict[str, torch.Tensor]:
    """The e5m2 scale of dO ``(B, N, H, D)`` and the bounds-derived scales of dP, dQ, dK, dV (fp32 scalars)."""
    amax_do = grad_out.abs().amax().float()
    dp_bound = torch.linalg.vector_norm(grad_out.float(), dim=-1).amax() * saved[VNORM]
    s = 1 / math.sqrt(head_dim)
    bounds = {"scale_dO": amax_do, "scale_dP": dp_bound, "scale_dQ": 2 * s * dp_bound * saved[AMAX_K],
              "scale_dK": 2 * s * n * dp_bound * saved[AMAX_Q], "scale_dV": n * amax_do}
    return {name: pow2_scale(b, E4M3_MAX if name == "scale_dP" else E5M2_MAX) for name, b in bounds.items()}


def _scalars(graph, names) -> dict:
    f32 = cudnn_module().data_type.FLOAT
    return {s: graph.tensor(name=s, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32) for s in names}


def _set(tensor, dims, stride, dtype) -> None:
    tensor.set_output(True).set_dim(dims).set_stride(stride).set_data_type(dtype)


@lru_cache(maxsize=None)
def _graphs(b: int, n: int, h: int, d: int, device_index: int) -> AttentionGraphs:
    """Build (once per shape and device) the fp8 forward and backward cuDNN SDPA graphs."""
    cudnn = cudnn_module()
    e4m3, e5m2, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FP8_E5M2, cudnn.data_type.FLOAT
    handle = cudnn_handle(device_index)
    packed, dense = attention_strides(n, h, d)
    dims, one, stats = (b, h, n, d), ((1, 1, 1, 1), (1, 1, 1, 1)), ((b, h, n, 1), (h * n, n, 1, 1))

    def graph():
        return cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    fwd = graph()
    f = {name: fwd.tensor(name=name, dim=dims, stride=packed, data_type=e4m3) for name in "qkv"}
    f.update(_scalars(fwd, ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")))
    f["o"], f["stats"], f["amax_s"], f["amax_o"] = fwd.sdpa_fp8(
        q=f["q"], k=f["k"], v=f["v"], descale_q=f["descale_q"], descale_k=f["descale_k"], descale_v=f["descale_v"],
        descale_s=f["descale_s"], scale_s=f["scale_s"], scale_o=f["scale_o"], generate_stats=True,
        attn_scale=1 / math.sqrt(d), use_causal_mask=False)
    _set(f["o"], dims, dense, e4m3)
    _set(f["stats"], *stats, f32)
    for name in ("amax_s", "amax_o"):
        _set(f[name], *one, f32)
    build_graph(fwd)

    bwd = graph()
    g = {name: bwd.tensor(name=name, dim=dims, stride=packed, data_type=e4m3) for name in "qkv"}
    g["o"] = bwd.tensor(name="o", dim=dims, stride=dense, data_type=e4m3)
    g["do"] = bwd.tensor(name="do", dim=dims, stride=dense, data_type=e5m2)
    g["stats"] = bwd.tensor(name="stats", dim=stats[0], stride=stats[1], data_type=f32)
    g.update(_scalars(bwd, _BWD_SCALARS))
    outs = bwd.sdpa_fp8_backward(q=g["q"], k=g["k"], v=g["v"], o=g["o"], dO=g["do"], stats=g["stats"],
                                 attn_scale=1 / math.sqrt(d), use_causal_mask=False,
                                 **{name: g[name] for name in _BWD_SCALARS})
    for name, t in zip(("dq", "dk", "dv"), outs[:3]):
        g[name] = t
        _set(t, dims, packed, e5m2)
    for name, t in zip(("amax_dq", "amax_dk", "amax_dv", "amax_dp"), outs[3:]):
        g[name] = t
        _set(t, *one, f32)
    build_graph(bwd)
    return AttentionGraphs(handle, fwd, bwd, f, g)


def _descales(saved: torch.Tensor, names: str) -> dict[str, torch.Tensor]:
    index = {"q": DESCALE_Q, "k": DESCALE_K, "v": DESCALE_V, "o": DESCALE_O}
    return {f"descale_{name}": saved[index[name]] for name in names}


def _probability_scales(saved: torch.Tensor) -> dict[str, torch.Tensor]:
    # filled on the device: a torch.tensor(...) here would copy from the host and wait for the GPU every call
    return {"descale_s": saved.new_full((), 1 / P_SCALE), "scale_s": saved.new_full((), P_SCALE)}


def _scalar(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, 1, 1, 1).contiguous()


@torch.library.custom_op("era5vit::cudnn_fp8_attention", mutates_args=(), device_types="cuda")
def _forward(qkv8: torch.Tensor, saved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, _, h, d = qkv8.shape
    gr = _graphs(b, n, h, d, qkv8.device.index)
    o8 = torch.empty(b, n, h, d, device=qkv8.device, dtype=E4M3)
    stats = torch.empty(b, h, n, 1, device=qkv8.device, dtype=torch.float32)
    q, k, v = packed_views(qkv8)
    values = {**_descales(saved, "qkv"), **_probability_scales(saved), "scale_o": 1 / saved[DESCALE_O]}
    f = gr.f
    pack = {f["q"]: q, f["k"]: k, f["v"]: v, f["o"]: o8.transpose(1, 2), f["stats"]: stats,
            **{f[name]: _scalar(x) for name, x in values.items()},
            **{f[name]: torch.empty(1, 1, 1, 1, device=qkv8.device) for name in ("amax_s", "amax_o")}}
    execute_graph(gr.fwd, gr.handle, pack, qkv8.device)
    return o8, stats


@_forward.register_fake
def _(qkv8, saved):
    b, n, _, h, d = qkv8.shape
    return qkv8.new_empty(b, n, h, d), qkv8.new_empty(b, h, n, 1, dtype=torch.float32)


@torch.library.custom_op("era5vit::cudnn_fp8_attention_backward", mutates_args=(), device_types="cuda")
def _backward(qkv8: torch.Tensor, o8: torch.Tensor, do8: torch.Tensor, stats: torch.Tensor, saved: torch.Tensor,
              grad_scales: torch.Tensor) -> torch.Tensor:
    b, n, _, h, d = qkv8.shape
    gr = _graphs(b, n, h, d, qkv8.device.index)
    dqkv8 = torch.empty(qkv8.shape, device=qkv8.device, dtype=E5M2)
    q, k, v = packed_views(qkv8)
    dq, dk, dv = packed_views(dqkv8)
    scales = dict(zip(GRADIENT_SCALES, grad_scales))
    values = {**_descales(saved, "qkvo"), **_probability_scales(saved),
              "descale_dO": 1 / scales["scale_dO"], "descale_dP": 1 / scales["scale_dP"],
              **{name: scales[name] for name in ("scale_dQ", "scale_dK", "scale_dV", "scale_dP")}}
    g = gr.b
    pack = {g["q"]: q, g["k"]: k, g["v"]: v, g["o"]: o8.transpose(1, 2), g["do"]: do8.transpose(1, 2),
            g["stats"]: stats, g["dq"]: dq, g["dk"]: dk, g["dv"]: dv,
            **{g[name]: _scalar(x) for name, x in values.items()},
            **{g[name]: torch.empty(1, 1, 1, 1, device=qkv8.device) for name in ("amax_dq", "amax_dk", "amax_dv",
                                                                               "amax_dp")}}
    execute_graph(gr.bwd, gr.handle, pack, qkv8.device)
    return dqkv8


@_backward.register_fake
def _(qkv8, o8, do8, stats, saved, grad_scales):
    return torch.empty(qkv8.shape, device=qkv8.device, dtype=E5M2)


class _Fp8Attention(torch.autograd.Function):
    """The casts and scales in plain torch ops around the two cuDNN calls, so that under ``torch.compile`` they
    fuse with each other and their neighbours (each is a full pass over q, k, v or dO)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor) -> torch.Tensor:
        qkv = center_keys(qkv)
        scale, saved = forward_scales(qkv)
        qkv8 = (qkv * scale.to(qkv.dtype).view(1, 1, 3, 1, 1)).to(E4M3)
        o8, stats = _forward(qkv8, saved)
        ctx.save_for_backward(qkv8, o8, stats, saved)
        return o8.to(qkv.dtype) * saved[DESCALE_O].to(qkv.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        qkv8, o8, stats, saved = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # the graph reads dO as a dense (B, N, H, D) buffer, like O
        scales = backward_scales(grad_out, saved, qkv8.shape[1], qkv8.shape[-1])
        do8 = (grad_out * scales["scale_dO"].to(grad_out.dtype)).to(E5M2)
        dqkv8 = _backward(qkv8, o8, do8, stats, saved, torch.stack([scales[name] for name in GRADIENT_SCALES]))
        descale = torch.stack([1 / scales["scale_dQ"], 1 / scales["scale_dK"], 1 / scales["scale_dV"]])
        return center_keys(dqkv8.to(grad_out.dtype) * descale.to(grad_out.dtype).view(1, 1, 3, 1, 1))


def fp8_packed_attention(qkv: torch.Tensor) -> torch.Tensor:
    """Self-attention in fp8 over a packed QKV projection.

    Args:
        qkv: ``(B, N, 3, H, D)`` bf16 CUDA tensor (the fused QKV projection's output viewed so; q, k, v
            are ``qkv[:, :, 0 / 1 / 2]``), on a GPU where :func:`fp8_attention_unsupported` returns None.

    Returns:
        ``(B, N, H, D)`` attention output ``softmax(q k^T / sqrt(D)) v`` per head, in ``qkv``'s dtype, computed
        from e4m3 operands (relative error a few percent: 3 mantissa bits); its gradient comes from e5m2 dO.

    Raises:
        ValueError: ``qkv`` is not a 5-d bf16 CUDA tensor with 3 in dim 2 (a power-of-two scale can overflow
            fp16).
        RuntimeError: cuDNN has no fp8 attention kernel for this shape on this GPU.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.dtype != torch.bfloat16 or not qkv.is_cuda:
        raise ValueError(f"fp8_packed_attention needs a (B, N, 3, H, D) bf16 CUDA tensor, got {tuple(qkv.shape)} "
                         f"{qkv.dtype} on {qkv.device}")
    return _Fp8Attention.apply(qkv.contiguous())


def fp8_attention_unsupported(device: torch.device, head_dim: int) -> str | None:
    """None when :func:`fp8_packed_attention` runs at ``head_dim`` on ``device``, else why not (one phrase)."""
    if device.type != "cuda":
        return "no CUDA GPU"
    if importlib.util.find_spec("cudnn") is None:
        return "cudnn-frontend is not installed (pip install -e '.[cudnn]')"
    try:
        _graphs(1, 64, 1, head_dim, device.index if device.index is not None else torch.cuda.current_device())
    except Exception:  # cudnn-frontend's declines share no base class with torch's errors
        return (f"cuDNN builds no fp8 attention for head dim {head_dim} on {torch.cuda.get_device_name(device)} "
                "(Hopper: head dim 128 only)")
    return None
