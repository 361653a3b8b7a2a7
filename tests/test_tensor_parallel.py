"""Tensor (TP) and context (CP) parallel mappings, layers and ViT against single-process references.

Distributed checks run on 4 CPU gloo ranks arranged as a 2x2 ("tp", "cp") DeviceMesh, so one
spawn covers tp=2 (cp off), cp=2 (tp off) and tp x cp = 2x2, plus the 4-rank world group.
Each spawned function groups many checks because spawning costs seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed.layers import (
    DistributedAttention,
    DistributedLayerNorm,
    DistributedMatmul,
    DistributedMLP,
    DistributedPatchEmbed,
    ShardLayout,
    reduce_replicated_gradients,
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
from distributed.tensor_parallel import (
    TensorContextParallelViT,
    apply_tensor_context_parallel,
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
)
from networks.vit import MLP, Attention, PatchEmbed, VisionTransformer
from tests.dist_utils import run_distributed

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
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
    tp, cp = mesh["tp"].get_group(), mesh["cp"].get_group()
    return [("tp2", tp, None), ("cp2", None, cp), ("tp2xcp2", tp, cp)]


def _layout_of(module, name):
    mod_name, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(mod_name), "tp_layouts", {}).get(leaf)


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


def _mappings_worker(rank, world):
    _, (_, _, cp), (_, tp, _) = _mesh_configs()
    for tag, group in [("world4", dist.group.WORLD), ("tp", tp), ("cp", cp), ("none", None)]:
        for shape, dim in [((2, 4050, 3), 1), ((3, 7), -1), ((3, 2), 0)]:
            _check_mappings(group, shape, dim, f"{tag} {shape} dim={dim}")
    # 4050 tokens over 4 ranks -> [1013, 1013, 1012, 1012]; the gathered result keeps that order
    local = torch.full((1, compute_split_shapes(4050, 4)[rank], 2), float(rank))
    full = all_gather_uneven(local, 1, compute_split_shapes(4050, 4), dist.group.WORLD)
    assert full.shape == (1, 4050, 2)
    assert full[0, :, 0].tolist() == [0.0] * 1013 + [1.0] * 1013 + [2.0] * 1012 + [3.0] * 1012


def test_mappings_distributed():
    run_distributed(_mappings_worker, 4)


# ----------------------------------------------------------------------------- layers


def _check_layer(dense, par, x_full, *, tp, cp, tol, tag, in_layout=None, out_layout=None, seq_dim=1):
    """Compare par(x_local) with dense(x_full): outputs, input grads and parameter grads (sliced)."""
    dense.zero_grad(set_to_none=True)
    xr = x_full.clone().requires_grad_()
    yr = dense(xr)
    g = _rand(yr.shape, 1234, yr.dtype)
    (yr * g).sum().backward()

    def local(t, layout):  # this rank's view of a dense activation
        if cp is not None and seq_dim is not None:
            t = _chunk(t, seq_dim, cp)
        if layout is not None:
            t = layout.shard(t, group_rank(tp), group_size(tp))
        return t

    x = local(x_full, in_layout).clone().requires_grad_()
    y = par(x)
    (y * local(g, out_layout)).sum().backward()
    reduce_replicated_gradients(par)

    _close(y, local(yr.detach(), out_layout), tol, f"{tag} output")
    _close(x.grad, local(xr.grad, in_layout), tol, f"{tag} input grad")
    dense_params = dict(dense.named_parameters())
    assert set(dense_params) == {n for n, _ in par.named_parameters()}, tag
    for name, p in par.named_parameters():
        expected = dense_params[name].grad
        layout = _layout_of(par, name)
        if layout is not None:
            expected = layout.shard(expected, group_rank(tp), group_size(tp))
            _close(p.detach(), layout.shard(dense_params[name].detach(), group_rank(tp), group_size(tp)), tol,
                   f"{tag} {name} value")
        _close(p.grad, expected, tol, f"{tag} {name} grad")


def _layers_worker(rank, world):
    for tag, tp, cp in _mesh_configs():
        P = group_size(tp)
        for dtype, tol in [(torch.float64, F64), (torch.float32, F32)]:
            t = f"{tag} {dtype}"
            torch.manual_seed(0)
            x = _rand((2, 7, 6), 1, dtype)  # 7 tokens: uneven over cp=2 (4 + 3)

            lin = nn.Linear(6, 10).to(dtype)  # 10 features: 5 + 5
            feat = ShardLayout(-1, 1, 10, 1)
            _check_layer(lin, DistributedMatmul.from_dense(lin, tp, cp), x, tp=tp, cp=cp, tol=tol,
                         tag=f"{t} column", out_layout=feat)
            _check_layer(lin, DistributedMatmul.from_dense(lin, tp, cp, gather_output=True), x, tp=tp, cp=cp,
                         tol=tol, tag=f"{t} column gather")

            lin = nn.Linear(7, 6).to(dtype)  # 7 input features: 4 + 3
            _check_layer(lin, DistributedMatmul.from_dense(lin, tp, cp, parallel="row"), _rand((2, 7, 7), 2, dtype),
                         tp=tp, cp=cp, tol=tol, tag=f"{t} row", in_layout=ShardLayout(-1, 1, 7, 1))
            _check_layer(lin, DistributedMatmul.from_dense(lin, tp, cp, parallel="row", input_is_parallel=False),
                         _rand((2, 7, 7), 2, dtype), tp=tp, cp=cp, tol=tol, tag=f"{t} row scatter")

            qkv = nn.Linear(6, 18).to(dtype)  # (3, heads=3, head_dim=2): heads 2 + 1 per tp rank
            _check_layer(qkv, DistributedMatmul.from_dense(qkv, tp, cp, groups=3, unit_size=2), x, tp=tp, cp=cp,
                         tol=tol, tag=f"{t} qkv", out_layout=ShardLayout(-1, 3, 3, 2))

            mlp = MLP(6, 9).to(dtype)  # hidden 9: 5 + 4
            _check_layer(mlp, DistributedMLP.from_dense(mlp, tp, cp), x, tp=tp, cp=cp, tol=tol, tag=f"{t} mlp")

            attn = Attention(6, 3).to(dtype)  # 3 heads over tp=2, 7 tokens over cp=2
            for seq_len in (7, None):
                par = DistributedAttention.from_dense(attn, tp, cp, seq_len=seq_len)
                assert par.local_heads == compute_split_shapes(3, P)[group_rank(tp)]
                _check_layer(attn, par, x, tp=tp, cp=cp, tol=tol, tag=f"{t} attn seq_len={seq_len}")

            ln = nn.LayerNorm(6).to(dtype)
            with torch.no_grad():
                ln.weight.copy_(_rand(6, 3, dtype))
                ln.bias.copy_(_rand(6, 4, dtype))
            par = DistributedLayerNorm.from_dense(ln, tp, cp)
            assert isinstance(par, nn.LayerNorm)
            _check_layer(ln, par, x, tp=tp, cp=cp, tol=tol, tag=f"{t} layernorm")

        _check_patch_embed(tp, cp, tag)
        _check_attention_errors(tp, cp, tag)


def _check_patch_embed(tp, cp, tag):
    """12x20 image, patch 4 -> 3x5 grid = 15 tokens; cp=2 splits them 8 + 7 mid patch-row."""
    pe = PatchEmbed((12, 20), 4, 3, 6).double()
    par = DistributedPatchEmbed.from_dense(pe, tp, cp)
    img = _rand((2, 3, 12, 20), 5)
    xr = img.clone().requires_grad_()
    yr = pe(xr)
    g = _rand(yr.shape, 6)
    (yr * g).sum().backward()
    x = img.clone().requires_grad_()
    y = par(x)
    assert y.shape[1] == compute_split_shapes(15, group_size(cp))[group_rank(cp)]
    (y * (g if cp is None else _chunk(g, 1, cp))).sum().backward()
    reduce_replicated_gradients(par)
    _close(y, yr.detach() if cp is None else _chunk(yr.detach(), 1, cp), F64, f"{tag} patch fwd")
    _close(par.proj.weight.grad, pe.proj.weight.grad, F64, f"{tag} patch weight grad")
    _close(par.proj.bias.grad, pe.proj.bias.grad, F64, f"{tag} patch bias grad")
    # the image gradient is partial per cp rank: its cp-sum is the dense one
    dx = x.grad.clone()
    if cp is not None:
        dist.all_reduce(dx, group=cp)
    _close(dx, xr.grad, F64, f"{tag} patch input grad")


def _check_attention_errors(tp, cp, tag):
    if group_size(cp) > 1:  # wrong local token count for seq_len: raised before any collective
        par = DistributedAttention.from_dense(Attention(6, 3), tp, cp, seq_len=9)
        with pytest.raises(ValueError, match="tokens"):
            par(torch.zeros(1, 3 + group_rank(cp) * 7, 6))
    if group_size(tp) > 1:
        with pytest.raises(ValueError, match="heads"):
            DistributedAttention.from_dense(Attention(6, 1), tp, cp)


def test_layers_distributed():
    run_distributed(_layers_worker, 4)


# ----------------------------------------------------------------------------- whole model


def _full_grads(model):
    """Dense gradients of a converted model (all-gathered over tp), keyed like the plain model."""
    out = {}
    for name, p in model.named_parameters():
        layout, g = _layout_of(model, name), p.grad
        if layout is not None:
            tp = model.tp_group
            shapes = [layout.local_size(r, group_size(tp)) for r in range(group_size(tp))]
            g = layout.unshard(list(torch.split(all_gather_uneven(g, layout.dim, shapes, tp), shapes, layout.dim)))
        out[name] = g.clone()
    return out


def _vit(img, heads, dtype, seed=0):
    torch.manual_seed(seed)
    return VisionTransformer(img_size=img, patch_size=4, in_chans=3, out_chans=2, embed_dim=12, depth=2,
                             num_heads=heads, mlp_ratio=2.0).to(dtype)


def _check_training(tag, tp, cp, img, heads, dtype, tol, steps):
    """Adam training of the converted model vs the plain one; grads, outputs, params via full_state_dict."""
    ref = _vit(img, heads, dtype)
    model = apply_tensor_context_parallel(copy.deepcopy(ref), tp, cp)
    assert isinstance(model, TensorContextParallelViT) and isinstance(model, VisionTransformer)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _rand((2, 3) + img, 10 + step, dtype), _rand((2, 2) + img, 20 + step, dtype)
        out_ref = ref(x)
        F.mse_loss(out_ref, y).backward()
        grads_ref = {n: p.grad.clone() for n, p in ref.named_parameters()}
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)

        out = model(x)
        assert out.shape == out_ref.shape
        F.mse_loss(out, y).backward()
        reduce_replicated_gradients(model, sync_tp_replicas=step % 2 == 1)
        grads = _full_grads(model)
        norm = clip_grad_norm_(model, 0.05)
        clipped = _full_grads(model)

        _close(out, out_ref, tol, f"{tag} step {step} output")
        assert grads.keys() == grads_ref.keys()
        for name, p in ref.named_parameters():
            _close(grads[name], grads_ref[name], tol, f"{tag} step {step} {name} grad")
            _close(clipped[name], p.grad, tol, f"{tag} step {step} {name} clipped grad")
        _close(norm, norm_ref, tol, f"{tag} step {step} grad norm")
        # the output (hence the loss) is bitwise identical on all 4 ranks
        everyone = all_gather_uneven(out.detach().unsqueeze(0).contiguous(), 0, None, dist.group.WORLD)
        assert all(torch.equal(everyone[0], o) for o in everyone), f"{tag} outputs differ across ranks"
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()

    sd = full_state_dict(model)
    assert list(sd) == list(ref.state_dict())
    for name, t in ref.state_dict().items():
        _close(sd[name], t, tol, f"{tag} {name} after {steps} Adam steps")

    # the gathered checkpoint loads into the plain model and predicts the same
    plain = _vit(img, heads, dtype, seed=1)
    plain.load_state_dict(sd)
    x = _rand((2, 3) + img, 99, dtype)
    with torch.no_grad():
        out = model(x)
        _close(plain(x), out, tol, f"{tag} plain model from full_state_dict")
        # ... and slices back into a fresh converted model
        fresh = apply_tensor_context_parallel(_vit(img, heads, dtype, seed=2), tp, cp)
        load_full_state_dict(fresh, {"module." + k: v for k, v in sd.items()})
        assert torch.equal(fresh(x), out), f"{tag} load_full_state_dict"
    with pytest.raises(KeyError):
        load_full_state_dict(fresh, {k: v for k, v in sd.items() if k != "head.bias"})


def _model_worker(rank, world):
    configs = _mesh_configs()
    tp, cp = configs[2][1], configs[2][2]
    # tp=2 on an even 16x32 image (32 tokens, 4 heads), several Adam steps
    _check_training("tp2 16x32", tp, None, (16, 32), 4, torch.float64, F64, steps=3)
    # uneven: 12x20 -> 15 tokens (8 + 7 over cp), 3 heads (2 + 1 over tp)
    for tag, tp_g, cp_g in configs:
        _check_training(f"{tag} 12x20", tp_g, cp_g, (12, 20), 3, torch.float64, F64, steps=3)
    _check_training("tp2xcp2 fp32", tp, cp, (12, 20), 3, torch.float32, F32, steps=2)
    # conversion errors leave nothing half-done
    with pytest.raises(ValueError, match="tokens"):
        apply_tensor_context_parallel(VisionTransformer((4, 4), 4, 1, 1, 4, 1, 1, 1.0), None, cp)
    m = VisionTransformer((8, 8), 4, 1, 1, 4, 1, 1, 1.0)
    with pytest.raises(ValueError, match="heads"):
        apply_tensor_context_parallel(m, tp, None)
    assert type(m) is VisionTransformer and isinstance(m.blocks[0].attn, Attention)
    # deepcopy (e.g. an EMA model) shares the process groups instead of failing
    ema = copy.deepcopy(apply_tensor_context_parallel(_vit((12, 20), 3, torch.float64), tp, cp))
    assert ema.tp_group is tp and ema.cp_group is cp


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
    reduce_replicated_gradients(model)
    _close(out, out_ref, F64, "compiled output")
    grads = _full_grads(model)
    for name, p in ref.named_parameters():
        _close(grads[name], p.grad, F64, f"compiled {name} grad")
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_torch_compile_tp_cp():
    run_distributed(_compile_worker, 4)


# ----------------------------------------------------------------------------- data parallel on top


def _dp_worker(rank, world):
    """FSDP2 over dp with tp or cp, DDP over dp with cp: each dp rank trains on half of the global batch."""
    for wrap, inner in [("fsdp", "tp"), ("fsdp", "cp"), ("ddp", "cp")]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", inner))
        group = mesh[inner].get_group()
        ref = _vit((12, 20), 3, torch.float64)
        model = apply_tensor_context_parallel(copy.deepcopy(ref), *((group, None) if inner == "tp" else (None, group)))
        if wrap == "fsdp":
            for blk in model.blocks:
                fully_shard(blk, mesh=mesh["dp"])
            fwd = fully_shard(model, mesh=mesh["dp"])
        else:
            fwd = DDP(model, process_group=mesh["dp"].get_group())
        opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        mine = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
        for step in range(2):
            x, y = _rand((4, 3, 12, 20), 10 + step), _rand((4, 2, 12, 20), 20 + step)
            F.mse_loss(ref(x), y).backward()
            norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            F.mse_loss(fwd(x[mine]), y[mine]).backward()  # DDP / FSDP average over dp
            reduce_replicated_gradients(model)  # then sum over cp
            _close(clip_grad_norm_(model, 0.05), norm_ref, F64, f"{wrap} x {inner} grad norm")
            opt_ref.step(), opt.step()
            opt_ref.zero_grad(), opt.zero_grad()
        sd = full_state_dict(model)
        for name, t in ref.state_dict().items():
            _close(sd[name], t, F64, f"{wrap} x {inner} {name}")


def test_composes_with_fsdp_and_ddp():
    run_distributed(_dp_worker, 4)


# ----------------------------------------------------------------------------- single process


def test_compute_split_shapes():
    assert compute_split_shapes(4050, 4) == [1013, 1013, 1012, 1012]
    assert compute_split_shapes(15, 2) == [8, 7]
    assert compute_split_shapes(3, 4) == [1, 1, 1, 0]
    assert compute_split_shapes(8, 1) == [8]
    with pytest.raises(ValueError):
        compute_split_shapes(4, 0)
    with pytest.raises(ValueError):
        compute_split_shapes(-1, 2)


def test_shard_layout_roundtrip():
    full = torch.arange(3 * 5 * 2 * 4.0).view(30, 4)  # (3, heads=5, head_dim=2) rows
    layout = ShardLayout(0, 3, 5, 2)
    shards = [layout.shard(full, r, 2) for r in range(2)]
    assert [s.shape[0] for s in shards] == [3 * 3 * 2, 3 * 2 * 2]
    # rank 0 holds heads 0-2 of q, then of k, then of v
    assert torch.equal(shards[0][:6], full[:6]) and torch.equal(shards[0][6:12], full[10:16])
    assert torch.equal(layout.unshard(shards), full)
    col = ShardLayout(1, 1, 4, 1)
    assert torch.equal(col.unshard([col.shard(full, r, 3) for r in range(3)]), full)
    with pytest.raises(ValueError):
        layout.shard(full[:29], 0, 2)


def test_single_process_identity_and_errors():
    """With no groups the converted model is the plain model: same outputs, grads and training."""
    ref = _vit((12, 20), 3, torch.float64)
    model = apply_tensor_context_parallel(copy.deepcopy(ref), None, None)
    x = _rand((2, 3, 12, 20), 0)
    F.mse_loss(ref(x), x[:, :2]).backward()
    F.mse_loss(model(x), x[:, :2]).backward()
    reduce_replicated_gradients(model)  # no-op
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        _close(q.grad, p.grad, F64, name)
    _close(model.forward_features(x), ref.forward_features(x), F64, "features")
    _close(clip_grad_norm_(model, 1e-3), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3), F64, "norm")

    with pytest.raises(ValueError, match="already"):
        apply_tensor_context_parallel(model, None, None)
    with pytest.raises(TypeError):
        apply_tensor_context_parallel(nn.Linear(2, 2), None, None)
    with pytest.raises(TypeError):
        DistributedMatmul.from_dense(nn.Conv2d(1, 1, 1), None)
    with pytest.raises(ValueError):
        DistributedMatmul(4, 6, parallel="diagonal")
    with pytest.raises(ValueError):
        DistributedMatmul(4, 6, groups=4)
    with pytest.raises(ValueError):
        DistributedMatmul(4, 6, groups=3, gather_output=True)
    with pytest.raises(ValueError):
        DistributedMatmul(4, 6, parallel="column", input_is_parallel=False)
    sd = full_state_dict(model)
    sd["head.weight"] = sd["head.weight"][:, :3]
    with pytest.raises(ValueError, match="shape"):
        load_full_state_dict(model, sd)
