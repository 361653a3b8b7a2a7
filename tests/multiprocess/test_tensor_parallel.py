"""Tensor (TP) and context (CP) parallel mappings, layers and ViT against single-process references.

Distributed checks run on 4 CPU gloo ranks arranged as a 2x2 ("tp", "cp") DeviceMesh, so one
spawn covers tp=2 (cp off), cp=2 (tp off) and tp x cp = 2x2, plus the 4-rank world group.
Each spawned function groups many checks because spawning costs seconds. Tensor-parallel parameters are
DTensors on the "tp" mesh; a test sums a context-parallel layer's gradients over cp itself, as data
parallelism over the dp x cp mesh does in training (``distributed/parallelize.py``, checked at the end).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from distributed.checkpoint.export import full_model_state_dict
from distributed.layers import (
    DistributedAttention,
    DistributedLayerNorm,
    DistributedMatmul,
    DistributedMLP,
    DistributedPatchEmbed,
)
from distributed.mappings import (
    all_gather_uneven,
    compute_split_shapes,
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
)
from distributed.launch import LaunchEnv
from distributed.parallelize import gradient_factor, parallelize_model
from distributed.sequence_parallel import (region_pieces, sequence_parallel_column_linear,
                                           sequence_parallel_row_linear)
from distributed.tensor_parallel import apply_tensor_context_parallel, checkpoint_views
from distributed.world import World, build_meshes, local_tensor
from networks.vit import MLP, Attention, PatchEmbed, VisionTransformer
from tests.dist_utils import run_distributed
from utils.config.schema import ParallelConfig, PrecisionConfig

F64 = dict(atol=1e-10, rtol=1e-10)
F32 = dict(atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- helpers (all ranks)


def _rand(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _chunk(t, dim, group, rank=None):
    """Rank's chunk of t along dim with the library's split rule."""
    shapes = compute_split_shapes(t.shape[dim], group_size(group))
    rank = group_rank(group) if rank is None else rank
    return t.narrow(dim, sum(shapes[:rank]), shapes[rank])


def _mesh_configs():
    """(tag, tp mesh, cp group) of tp=2, cp=2 and tp x cp = 2x2 on a 2x2 ("tp", "cp") mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
    tp, cp = mesh["tp"], mesh["cp"].get_group()
    return [("tp2", tp, None), ("cp2", None, cp), ("tp2xcp2", tp, cp)]


def _group(tp):
    return None if tp is None else tp.get_group()


def _cp_sum(grad, cp):
    """A context-parallel gradient summed over the cp group (what data parallelism over dp x cp does)."""
    grad = local_tensor(grad).clone()
    if cp is not None:
        dist.all_reduce(grad, group=cp)
    return grad


def _dense_of(p, grad=None):
    """The dense (plain-shaped) tensor of a parameter (or of ``grad``, its gradient): DTensors gathered."""
    t = p if grad is None else grad
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(actual, expected, tol, what):
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------- mappings


def _check_mappings(group, shape, dim, tag):
    P, r = group_size(group), group_rank(group)
    shapes = compute_split_shapes(shape[dim], P)
    xs = _rand(shape, 0)

    # copy_to: y = x, dx = sum_q dy_q
    x = xs.clone().requires_grad_()
    y = copy_to_parallel_region(x, group)
    (y * _rand(shape, 100 + r)).sum().backward()
    _close(y, xs, F64, f"{tag} copy fwd")
    _close(x.grad, sum(_rand(shape, 100 + q) for q in range(P)), F64, f"{tag} copy bwd")

    # reduce_from: y = sum_q x_q, dx = dy
    x = _rand(shape, 200 + r).requires_grad_()
    y = reduce_from_parallel_region(x, group)
    (y * _rand(shape, 300)).sum().backward()
    _close(y, sum(_rand(shape, 200 + q) for q in range(P)), F64, f"{tag} reduce fwd")
    _close(x.grad, _rand(shape, 300), F64, f"{tag} reduce bwd")

    # scatter: y = chunk_r(x), dx = cat(dy)
    x = xs.clone().requires_grad_()
    y = scatter_to_parallel_region(x, dim, group)
    g = _rand(shape, 400)
    (y * _chunk(g, dim, group)).sum().backward()
    _close(y, _chunk(xs, dim, group), F64, f"{tag} scatter fwd")
    _close(x.grad, g, F64, f"{tag} scatter bwd")

    # gather_from: y = cat(x_q), dx = chunk_r(dy) (replicated consumer)
    x = _chunk(xs, dim, group).clone().requires_grad_()
    y = gather_from_parallel_region(x, dim, shapes, group)
    (y * _rand(shape, 500)).sum().backward()
    _close(y, xs, F64, f"{tag} gather fwd")
    _close(x.grad, _chunk(_rand(shape, 500), dim, group), F64, f"{tag} gather bwd")

    # gather_from_sequence: y = cat(x_q), dx = chunk_r(sum_q dy_q)
    x = _chunk(xs, dim, group).clone().requires_grad_()
    y = gather_from_sequence_parallel_region(x, dim, shapes, group)
    (y * _rand(shape, 600 + r)).sum().backward()
    _close(y, xs, F64, f"{tag} seq-gather fwd")
    _close(x.grad, _chunk(sum(_rand(shape, 600 + q) for q in range(P)), dim, group), F64, f"{tag} seq-gather bwd")

    # reduce_scatter_to_sequence: y = chunk_r(sum_q x_q), dx = cat(dy)
    x = _rand(shape, 700 + r).requires_grad_()
    y = reduce_scatter_to_sequence_parallel_region(x, dim, None, group)
    g = _rand(shape, 800)
    (y * _chunk(g, dim, group)).sum().backward()
    _close(y, _chunk(sum(_rand(shape, 700 + q) for q in range(P)), dim, group), F64, f"{tag} rs fwd")
    _close(x.grad, g, F64, f"{tag} rs bwd")

    # reduce-scatter with explicit, reversed (small-first) shapes round-trips through all-gather
    rev = shapes[::-1]
    x = _rand(shape, 900 + r)
    y = reduce_scatter_to_sequence_parallel_region(x, dim, rev, group)
    back = gather_from_parallel_region(y, dim, rev, group)
    _close(back, sum(_rand(shape, 900 + q) for q in range(P)), F64, f"{tag} rs explicit shapes")

    if P > 1:  # raised identically on every rank, before any collective
        with pytest.raises(ValueError):
            gather_from_parallel_region(x, dim, [1] * (P + 1), group)
        with pytest.raises(ValueError):
            reduce_scatter_to_sequence_parallel_region(x, dim, [0] * P, group)


def _check_sequence_parallel_linears(group, n, tag):
    """The sequence-parallel linears against ``F.linear`` on all ``n`` tokens (sequence-first ``(n, 2, .)``):
    column ``(n_r, 2, 5) -> (n, 2, 4_r)``, row ``(n, 2, 4_r) -> (n_r, 2, 3)``; outputs and every gradient."""
    P, r = group_size(group), group_rank(group)
    shapes = compute_split_shapes(n, P)
    x_full, w1, b1, w2 = _rand((n, 2, 5), 1), _rand((4, 5), 2), _rand(4, 3), _rand((3, 4), 4)
    g = _rand((n, 2, 3), 5)
    leaves = [t.clone().requires_grad_() for t in (x_full, w1, b1, w2)]
    F.linear(F.linear(leaves[0], leaves[1], leaves[2]), leaves[3]).mul(g).sum().backward()

    x = _chunk(x_full, 0, group).clone().requires_grad_()
    w1_r, b1_r = _chunk(w1, 0, group).clone().requires_grad_(), _chunk(b1, 0, group).clone().requires_grad_()
    w2_r = _chunk(w2, 1, group).clone().requires_grad_()
    h = sequence_parallel_column_linear(x, w1_r, b1_r, shapes, group)
    assert h.shape == (n, 2, w1_r.shape[0]), tag
    y = sequence_parallel_row_linear(h, w2_r, shapes, group)
    assert y.shape == (shapes[r], 2, 3), tag
    (y * _chunk(g, 0, group)).sum().backward()
    _close(y, _chunk(F.linear(F.linear(x_full, w1, b1), w2), 0, group), F64, f"{tag} sp output")
    _close(x.grad, _chunk(leaves[0].grad, 0, group), F64, f"{tag} sp input grad")
    _close(w1_r.grad, _chunk(leaves[1].grad, 0, group), F64, f"{tag} sp column weight grad")
    _close(b1_r.grad, _chunk(leaves[2].grad, 0, group), F64, f"{tag} sp column bias grad")
    _close(w2_r.grad, _chunk(leaves[3].grad, 1, group), F64, f"{tag} sp row weight grad")
    if P > 1:  # a split that disagrees with the local tokens is refused before any collective
        with pytest.raises(ValueError, match="tokens"):
            sequence_parallel_column_linear(x, w1_r, b1_r, [n] * P, group)
        with pytest.raises(ValueError, match="tokens"):
            sequence_parallel_row_linear(h, w2_r, [n + 1] + [0] * (P - 1), group)


def _mappings_worker(rank, world):
    _, (_, _, cp), (_, tp_mesh, _) = _mesh_configs()
    for tag, group in [("world4", dist.group.WORLD), ("tp", tp_mesh.get_group()), ("cp", cp), ("none", None)]:
        for shape, dim in [((2, 4050, 3), 1), ((3, 7), -1), ((3, 2), 0)]:
            _check_mappings(group, shape, dim, f"{tag} {shape} dim={dim}")
        # even (chunked reduce-scatter: 16 over 2 is 4 pieces of 2 tokens), uneven (7 over 2: 4 + 3; over 4:
        # 2, 2, 2, 1) and an empty rank (3 over 4: 1, 1, 1, 0)
        for n in (16, 8, 7, 3):
            _check_sequence_parallel_linears(group, n, f"{tag} {n} tokens")
    # 4050 tokens over 4 ranks -> [1013, 1013, 1013, 1011]; the gathered result keeps that order
    local = torch.full((1, compute_split_shapes(4050, 4)[rank], 2), float(rank))
    full = all_gather_uneven(local, 1, compute_split_shapes(4050, 4), dist.group.WORLD)
    assert full.shape == (1, 4050, 2)
    assert full[0, :, 0].tolist() == [0.0] * 1013 + [1.0] * 1013 + [2.0] * 1013 + [3.0] * 1011


def test_mappings_distributed():
    run_distributed(_mappings_worker, 4)


# ----------------------------------------------------------------------------- layers


def _feature_chunk(t, tp, heads=None):
    """This tp rank's part of the last dim of ``t``: a chunk of features, or with ``heads`` = (groups, heads,
    head_dim) the chunk of whole heads of each group (the fused QKV output)."""
    g = _group(tp)
    if heads is None:
        return _chunk(t, -1, g)
    groups, n, d = heads
    return _chunk(t.reshape(*t.shape[:-1], groups, n, d), -2, g).reshape(*t.shape[:-1], -1)


def _check_layer(dense, par, x_full, *, tp, cp, tol, tag, in_split=False, out_split=False, heads=None, seq_dim=1,
                 sp=False):
    """Compare par(x_local) with dense(x_full): outputs, input grads and parameter grads (cp-summed) and values.
    ``sp``: sequence parallel, the cp rank's tokens split over tp too."""
    dense.zero_grad(set_to_none=True)
    xr = x_full.clone().requires_grad_()
    yr = dense(xr)
    g = _rand(yr.shape, 1234, yr.dtype)
    (yr * g).sum().backward()

    def local(t, split):  # this rank's view of a dense activation
        if cp is not None and seq_dim is not None:
            t = _chunk(t, seq_dim, cp)
        if sp:
            t = _chunk(t, seq_dim, _group(tp))
        return _feature_chunk(t, tp, heads) if split else t

    x = local(x_full, in_split).clone().requires_grad_()
    y = par(x)
    (y * local(g, out_split)).sum().backward()

    _close(y, local(yr.detach(), out_split), tol, f"{tag} output")
    _close(x.grad, local(xr.grad, in_split), tol, f"{tag} input grad")
    dense_params = dict(dense.named_parameters())
    assert set(dense_params) == {n for n, _ in par.named_parameters()}, tag
    for name, p in par.named_parameters():
        want = dense_params[name]
        grad = _cp_sum(p.grad, cp)
        if isinstance(p, DTensor):
            grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        _close(_dense_of(p).reshape(want.shape), want.detach(), tol, f"{tag} {name} value")
        _close(grad.reshape(want.shape), want.grad, tol, f"{tag} {name} grad")


def _layers_worker(rank, world):
    for tag, tp, cp in _mesh_configs():
        P = group_size(_group(tp))
        for dtype, tol in [(torch.float64, F64), (torch.float32, F32)]:
            t = f"{tag} {dtype}"
            torch.manual_seed(0)
            x = _rand((2, 7, 6), 1, dtype)  # 7 tokens: uneven over cp=2 (4 + 3)

            lin = nn.Linear(6, 10).to(dtype)  # 10 features: 5 + 5
            _check_layer(lin, DistributedMatmul.from_dense(lin, tp, cp), x, tp=tp, cp=cp, tol=tol,
                         tag=f"{t} column", out_split=True)
            _check_layer(lin, DistributedMatmul.from_dense(lin, tp, cp, gather_output=True), x, tp=tp, cp=cp,
                         tol=tol, tag=f"{t} column gather")

            lin = nn.Linear(7, 6).to(dtype)  # 7 input features: 4 + 3
            _check_layer(lin, DistributedMatmul.from_dense(lin, tp, cp, parallel="row"), _rand((2, 7, 7), 2, dtype),
                         tp=tp, cp=cp, tol=tol, tag=f"{t} row", in_split=True)
            _check_layer(lin, DistributedMatmul.from_dense(lin, tp, cp, parallel="row", input_is_parallel=False),
                         _rand((2, 7, 7), 2, dtype), tp=tp, cp=cp, tol=tol, tag=f"{t} row scatter")

            qkv = nn.Linear(6, 18).to(dtype)  # (3, heads=3, head_dim=2): heads 2 + 1 per tp rank
            _check_layer(qkv, DistributedMatmul.from_dense(qkv, tp, cp, groups=3, unit_size=2), x, tp=tp, cp=cp,
                         tol=tol, tag=f"{t} qkv", out_split=True, heads=(3, 3, 2))

            mlp = MLP(6, 9).to(dtype)  # hidden 9: 5 + 4
            _check_layer(mlp, DistributedMLP(mlp, tp, cp), x, tp=tp, cp=cp, tol=tol, tag=f"{t} mlp")

            attn = Attention(6, 3).to(dtype)  # 3 heads over tp=2, 7 tokens over cp=2
            for seq_len in (7, None):
                par = DistributedAttention(attn, tp, cp, seq_len=seq_len)
                assert par.local_heads == compute_split_shapes(3, P)[group_rank(_group(tp))]
                _check_layer(attn, par, x, tp=tp, cp=cp, tol=tol, tag=f"{t} attn seq_len={seq_len}")

            ln = nn.LayerNorm(6).to(dtype)
            with torch.no_grad():
                ln.weight.copy_(_rand(6, 3, dtype))
                ln.bias.copy_(_rand(6, 4, dtype))
            _check_layer(ln, DistributedLayerNorm(ln, tp), x, tp=tp, cp=cp, tol=tol, tag=f"{t} layernorm")

            if tp is not None:  # sequence parallel: 7 tokens over cp (4 + 3), then over tp (2 + 2 or 2 + 1)
                seq = compute_split_shapes(_chunk(x, 1, cp).shape[1] if cp is not None else 7, P)
                _check_layer(mlp, DistributedMLP(mlp, tp, cp, seq_shapes=seq), x, tp=tp, cp=cp, tol=tol,
                             tag=f"{t} sp mlp", sp=True)
                _check_layer(attn, DistributedAttention(attn, tp, cp, seq_len=7, seq_shapes=seq), x, tp=tp, cp=cp,
                             tol=tol, tag=f"{t} sp attn", sp=True)
                _check_layer(ln, DistributedLayerNorm(ln, tp, sequence_parallel=True), x, tp=tp, cp=cp, tol=tol,
                             tag=f"{t} sp layernorm", sp=True)

        _check_autocast(tp, cp, tag)
        _check_placements(tp, tag)
        _check_patch_embed(tp, cp, tag)
        _check_attention_errors(tp, cp, tag)


def _check_autocast(tp, cp, tag):
    """Forward under bf16 autocast, backward outside it (as on a GPU, whose autograd thread runs without
    autocast): the TP linears cast before their collectives (a bf16 gradient meeting an fp32 weight would
    fail) and match the dense MLP within bf16 rounding (8 bits: a few 1e-3 relative, plus one rounding of
    each all-reduced partial sum)."""
    torch.manual_seed(0)
    mlp = MLP(6, 9)
    par = DistributedMLP(mlp, tp, cp)
    x, g = _rand((4, 7, 6), 8, torch.float32), _rand((4, 7, 6), 9, torch.float32)
    local = (lambda t: t) if cp is None else (lambda t: _chunk(t, 1, cp))
    xr, xp = x.clone().requires_grad_(), local(x).clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        yr, y = mlp(xr), par(xp)
    assert y.dtype == torch.bfloat16, tag
    (yr.float() * g).sum().backward()
    (y.float() * local(g)).sum().backward()
    tol = dict(atol=3e-2, rtol=3e-2)
    _close(y.float(), local(yr.float()).detach(), tol, f"{tag} autocast mlp output")
    _close(xp.grad, local(xr.grad), tol, f"{tag} autocast mlp input grad")


def _check_placements(tp, tag):
    """Parameters are DTensors on the tp mesh: whole heads of q, k and v per rank, the proj's input heads."""
    if tp is None:
        return
    attn = DistributedAttention(Attention(6, 3).double(), tp, None)
    assert attn.qkv.weight.shape == (3, 3, 2, 6) and attn.qkv.weight.placements == (Shard(1),), tag
    assert attn.proj.weight.shape == (6, 3, 2) and attn.proj.bias.placements == (Replicate(),), tag
    assert attn.qkv.plain_shapes == {"weight": (18, 6), "bias": (18,)}, tag


def _check_patch_embed(tp, cp, tag):
    """12x20 image, patch 4 -> 3x5 grid = 15 tokens; cp=2 splits them 8 + 7 mid patch-row, sequence
    parallelism each cp chunk over tp (8 -> 4 + 4, 7 -> 4 + 3; 15 -> 8 + 7 without cp)."""
    for sp in (False, True) if tp is not None else (False,):
        pe = PatchEmbed((12, 20), 4, 3, 6).double()
        par = DistributedPatchEmbed(pe, tp, cp, sequence_parallel=sp)
        img = _rand((2, 3, 12, 20), 5)
        xr = img.clone().requires_grad_()
        yr = pe(xr)
        g = _rand(yr.shape, 6)
        (yr * g).sum().backward()
        x = img.clone().requires_grad_()
        y = par(x)

        def local(t):
            t = t if cp is None else _chunk(t, 1, cp)
            return _chunk(t, 1, _group(tp)) if sp else t
        n_cp = compute_split_shapes(15, group_size(cp))[group_rank(cp)]
        assert y.shape[1] == (compute_split_shapes(n_cp, 2)[group_rank(_group(tp))] if sp else n_cp), tag
        (y * local(g)).sum().backward()
        t = f"{tag} sp={sp}"
        _close(y, local(yr.detach()), F64, f"{t} patch fwd")
        _close(_cp_sum(par.proj.weight.grad, cp), pe.proj.weight.grad, F64, f"{t} patch weight grad")
        _close(_cp_sum(par.proj.bias.grad, cp), pe.proj.bias.grad, F64, f"{t} patch bias grad")
        # the image gradient is partial per cp (and sp: tp) rank: its sum is the dense one
        grad = _cp_sum(x.grad, cp)
        if sp:
            dist.all_reduce(grad, group=_group(tp))
        _close(grad, xr.grad, F64, f"{t} patch input grad")


def _check_attention_errors(tp, cp, tag):
    if group_size(cp) > 1:  # wrong local token count for seq_len: raised before any collective
        par = DistributedAttention(Attention(6, 3), tp, cp, seq_len=9)
        with pytest.raises(ValueError, match="tokens"):
            par(torch.zeros(1, 3 + group_rank(cp) * 7, 6))
    if group_size(_group(tp)) > 1:
        with pytest.raises(ValueError, match="heads"):
            DistributedAttention(Attention(6, 1), tp, cp)


def test_layers_distributed():
    run_distributed(_layers_worker, 4)


# ----------------------------------------------------------------------------- whole model


def _full_grads(model, cp):
    """Dense gradients of a converted model (cp-summed, DTensors gathered), keyed and shaped like the plain model."""
    views = checkpoint_views(model)
    out = {}
    for name, p in model.named_parameters():
        g = _cp_sum(p.grad, cp)
        if isinstance(p, DTensor):
            g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        out[name] = g.reshape(views.get(name, g.shape))
    return out


def _set_grads(model, grads):
    """Put the cp-summed gradients back (this rank's shards), as data parallelism over cp leaves them."""
    for name, p in model.named_parameters():
        full = grads[name].reshape(p.shape)
        if isinstance(p, DTensor):
            full = DTensor.from_local(full, p.device_mesh, [Replicate()]).redistribute(placements=p.placements)
        p.grad.copy_(full)


def _vit(img, heads, dtype, seed=0):
    torch.manual_seed(seed)
    return VisionTransformer(img_size=img, patch_size=4, in_chans=3, out_chans=2, embed_dim=12, depth=2,
                             num_heads=heads, mlp_ratio=2.0).to(dtype)


def _tokens_per_rank(n, tp, cp, sp):
    """This rank's token count between the blocks: its cp chunk of ``n``, and with sequence parallelism its tp
    chunk of that."""
    n_cp = compute_split_shapes(n, group_size(cp))[group_rank(cp)]
    return compute_split_shapes(n_cp, 2)[group_rank(_group(tp))] if sp and tp is not None else n_cp


def _check_training(tag, tp, cp, img, heads, dtype, tol, steps, sp=True):
    """Adam training of the converted model vs the plain one; grads, clipped grads, norm, outputs, and the
    parameters after training through ``full_model_state_dict``. ``sp``: sequence parallelism, whose
    activations between the blocks must hold 1/tp of the cp rank's tokens."""
    ref = _vit(img, heads, dtype)
    model = apply_tensor_context_parallel(copy.deepcopy(ref), tp, cp, sequence_parallel=sp)
    seen = []  # the token count of every block's input and of the final norm's
    for module in [*model.blocks, model.norm]:
        module.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    assert isinstance(model, VisionTransformer) and type(model) is VisionTransformer  # no class swap
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    if tp is not None:
        assert all(isinstance(q, DTensor) and q.device_mesh == tp for q in model.parameters()), tag
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _rand((2, 3) + img, 10 + step, dtype), _rand((2, 2) + img, 20 + step, dtype)
        out_ref = ref(x)
        F.mse_loss(out_ref, y).backward()
        grads_ref = {n: q.grad.clone() for n, q in ref.named_parameters()}
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)

        seen.clear()
        out = model(x)
        assert out.shape == out_ref.shape
        n = ref.patch_embed.num_patches
        assert seen == [_tokens_per_rank(n, tp, cp, sp)] * (len(model.blocks) + 1), f"{tag} tokens per rank {seen}"
        F.mse_loss(out, y).backward()
        grads = _full_grads(model, cp)
        _set_grads(model, grads)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        clipped = _full_grads(model, None)

        _close(out, out_ref, tol, f"{tag} step {step} output")
        assert grads.keys() == grads_ref.keys()
        for name, q in ref.named_parameters():
            _close(grads[name], grads_ref[name], tol, f"{tag} step {step} {name} grad")
            _close(clipped[name], q.grad, tol, f"{tag} step {step} {name} clipped grad")
        _close(_dense_of(norm), norm_ref, tol, f"{tag} step {step} grad norm")
        # the output (hence the loss) is bitwise identical on all 4 ranks
        everyone = all_gather_uneven(out.detach().unsqueeze(0).contiguous(), 0, None, dist.group.WORLD)
        assert all(torch.equal(everyone[0], o) for o in everyone), f"{tag} outputs differ across ranks"
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()

    sd = full_model_state_dict(model)
    if dist.get_rank() == 0:
        assert list(sd) == list(ref.state_dict())
        for name, t in ref.state_dict().items():
            _close(sd[name], t, tol, f"{tag} {name} after {steps} Adam steps")
    sd = [sd]
    dist.broadcast_object_list(sd, src=0)
    sd = sd[0]

    # the gathered state dict loads into the plain model and predicts the same
    plain = _vit(img, heads, dtype, seed=1)
    plain.load_state_dict(sd)
    x = _rand((2, 3) + img, 99, dtype)
    with torch.no_grad():
        out = model(x)
        _close(plain(x), out, tol, f"{tag} plain model from full_model_state_dict")
        # ... and a converted copy of that plain model predicts the same
        other = apply_tensor_context_parallel(copy.deepcopy(plain), tp, cp, sequence_parallel=not sp)
        fresh = apply_tensor_context_parallel(plain, tp, cp, sequence_parallel=sp)
        assert torch.equal(fresh(x), out), f"{tag} converted from the loaded plain model"
        # the same weights with sequence parallelism switched: the same predictions (sums in another order)
        _close(other(x), out, tol, f"{tag} sequence_parallel={not sp} from the same weights")


def _model_worker(rank, world):
    configs = _mesh_configs()
    tp, cp = configs[2][1], configs[2][2]
    # tp=2 on an even 16x32 image (32 tokens, 4 heads), several Adam steps
    _check_training("tp2 16x32", tp, None, (16, 32), 4, torch.float64, F64, steps=3)
    # uneven: 12x20 -> 15 tokens (8 + 7 over cp), 3 heads (2 + 1 over tp)
    for tag, tp_m, cp_g in configs:
        _check_training(f"{tag} 12x20", tp_m, cp_g, (12, 20), 3, torch.float64, F64, steps=3)
    # without sequence parallelism the activations stay replicated over tp
    _check_training("tp2xcp2 12x20 no sp", tp, cp, (12, 20), 3, torch.float64, F64, steps=2, sp=False)
    _check_training("tp2xcp2 fp32", tp, cp, (12, 20), 3, torch.float32, F32, steps=2)
    # conversion errors leave nothing half-done
    with pytest.raises(ValueError, match="tokens"):
        apply_tensor_context_parallel(VisionTransformer((4, 4), 4, 1, 1, 4, 1, 1, 1.0), None, cp)
    m = VisionTransformer((8, 8), 4, 1, 1, 4, 1, 1, 1.0)
    with pytest.raises(ValueError, match="heads"):
        apply_tensor_context_parallel(m, tp, None)
    assert type(m) is VisionTransformer and isinstance(m.blocks[0].attn, Attention)
    # deepcopy (e.g. an EMA model) shares the meshes and predicts the same
    model = apply_tensor_context_parallel(_vit((12, 20), 3, torch.float64), tp, cp)
    ema = copy.deepcopy(model)
    x = _rand((2, 3, 12, 20), 7)
    with torch.no_grad():
        assert torch.equal(ema(x), model(x))


def test_vit_tensor_context_parallel_training():
    run_distributed(_model_worker, 4)


def _compile_worker(rank, world):
    """tp x cp under torch.compile traces into one graph (functional collectives) with exact gradients."""
    from torch._dynamo.utils import counters

    _, _, (_, tp, cp) = _mesh_configs()
    ref = _vit((12, 20), 3, torch.float64)
    model = apply_tensor_context_parallel(copy.deepcopy(ref), tp, cp)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, y = _rand((2, 3, 12, 20), 10), _rand((2, 2, 12, 20), 20)
    out_ref = ref(x)
    F.mse_loss(out_ref, y).backward()
    out = compiled(x)
    F.mse_loss(out, y).backward()
    _close(out, out_ref, F64, "compiled output")
    grads = _full_grads(model, cp)
    for name, q in ref.named_parameters():
        _close(grads[name], q.grad, F64, f"compiled {name} grad")
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_torch_compile_tp_cp():
    run_distributed(_compile_worker, 4)


# ----------------------------------------------------------------------------- data parallel on top


def _dp_worker(rank, world):
    """The library's data parallelism on top (``parallelize_model``): FSDP or replicate over dp x cp with tp or
    cp; each dp rank trains on its part of the global batch; equal to one process (float64, exact)."""
    for tp, cp, fsdp in [(2, 1, "zero3"), (1, 2, "zero3"), (1, 2, "none"), (2, 2, "none"), (2, 1, "none")]:
        meshes = build_meshes("cpu", 4, tp, cp, "tp-cp-dp", 0)
        dp = 4 // (tp * cp)
        w = World(LaunchEnv(rank, 4), torch.device("cpu"), dp, cp, tp, meshes["dp"].get_local_rank(), meshes, fsdp=fsdp)
        par = ParallelConfig(fsdp=fsdp, tensor_parallel=tp, context_parallel=cp, fsdp_reduce_dtype="param")
        ref = _vit((12, 20), 3, torch.float64)
        model = parallelize_model(copy.deepcopy(ref), par, PrecisionConfig(), w)
        opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        per = 4 // dp
        mine = slice(w.dp_rank * per, (w.dp_rank + 1) * per)
        for step in range(2):
            x, y = _rand((4, 3, 12, 20), 10 + step), _rand((4, 2, 12, 20), 20 + step)
            F.mse_loss(ref(x), y).backward()
            norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            (F.mse_loss(model(x[mine]), y[mine]) * gradient_factor(w)).backward()
            tag = f"tp={tp} cp={cp} fsdp={fsdp}"
            _close(_dense_of(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)), norm_ref, F64, f"{tag} norm")
            opt_ref.step(), opt.step()
            opt_ref.zero_grad(), opt.zero_grad()
        sd = full_model_state_dict(model)
        for name, t in (ref.state_dict().items() if rank == 0 else ()):
            _close(sd[name], t, F64, f"{tag} {name}")


def test_composes_with_fsdp_and_replicate():
    run_distributed(_dp_worker, 4)


# ----------------------------------------------------------------------------- single process


def test_compute_split_shapes():
    assert compute_split_shapes(4050, 4) == [1013, 1013, 1013, 1011]
    assert compute_split_shapes(15, 2) == [8, 7]
    assert compute_split_shapes(3, 4) == [1, 1, 1, 0]
    assert compute_split_shapes(5, 4) == [2, 2, 1, 0]
    assert compute_split_shapes(8, 1) == [8]
    # the rule of a DTensor Shard placement (torch.chunk)
    assert [len(c) for c in torch.arange(5).chunk(4)] + [0] == compute_split_shapes(5, 4)
    with pytest.raises(ValueError):
        compute_split_shapes(4, 0)
    with pytest.raises(ValueError):
        compute_split_shapes(-1, 2)


def test_region_pieces():
    """A sequence-parallel region's piece-major token order: each rank's tokens cut in ``chunks`` pieces."""
    assert region_pieces([5, 4], 2) == [[3, 2], [2, 2]]
    assert region_pieces([2025, 2025], 4) == [[507, 507]] * 3 + [[504, 504]]  # mp's 4050 tokens over tp 2
    assert region_pieces([2, 1, 0], 4) == [[1, 1, 0], [1, 0, 0]]  # pieces empty on every rank are dropped
    assert sum(map(sum, region_pieces([1013, 1013, 1013, 1011], 4))) == 4050


def test_single_process_identity_and_errors():
    """With no mesh and no group the converted model is the plain model: same outputs, grads and norms."""
    ref = _vit((12, 20), 3, torch.float64)
    model = apply_tensor_context_parallel(copy.deepcopy(ref), None, None)
    x = _rand((2, 3, 12, 20), 0)
    F.mse_loss(ref(x), x[:, :2]).backward()
    F.mse_loss(model(x), x[:, :2]).backward()
    for (name, q), r in zip(ref.named_parameters(), model.parameters()):
        _close(r.grad.reshape(q.shape), q.grad, F64, name)
    _close(model.forward_features(x), ref.forward_features(x), F64, "features")
    _close(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3),
           torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3), F64, "norm")

    with pytest.raises(ValueError, match="already"):
        apply_tensor_context_parallel(model, None, None)
    with pytest.raises(TypeError):
        apply_tensor_context_parallel(nn.Linear(2, 2), None, None)
    with pytest.raises(TypeError):
        DistributedMatmul.from_dense(nn.Conv2d(1, 1, 1), None)
    weight = torch.zeros(6, 4)
    with pytest.raises(ValueError):
        DistributedMatmul(weight, None, parallel="diagonal")
    with pytest.raises(ValueError):
        DistributedMatmul(weight, None, groups=4)
    with pytest.raises(ValueError):
        DistributedMatmul(weight, None, groups=3, gather_output=True)
    with pytest.raises(ValueError):
        DistributedMatmul(weight, None, parallel="column", input_is_parallel=False)
    with pytest.raises(ValueError, match="seq_shapes"):
        DistributedMatmul(weight, None, gather_output=True, seq_shapes=[3, 3])
    with pytest.raises(ValueError, match="seq_shapes"):
        DistributedMatmul(weight, None, parallel="row", input_is_parallel=False, seq_shapes=[3, 3])
