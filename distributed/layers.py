"""Tensor-parallel (TP) and context-parallel (CP) layers of the ViT.

Layout of the parallelism (Megatron-LM style, Shoeybi et al. 2019; CP by all-gathering keys/values along
the sequence as in Llama 3's context parallelism):

* **TP** splits weights: column-parallel linears own a block of output features, row-parallel ones the
  matching block of input features; activations between them are feature-split, everything else
  (residual stream, LayerNorms, patch embedding, head) is replicated over the TP group.
* **CP** splits tokens: every CP rank holds a contiguous chunk of the ``N`` tokens and all weights.
  Token-wise layers need no communication; attention all-gathers K/V so local queries see every token.
* **Sequence parallelism** (``seq_shapes``, Korthikanti et al. 2022; ``distributed/sequence_parallel.py``)
  splits the CP rank's tokens over TP as well outside the GEMM regions: the residual stream, LayerNorms,
  patch embedding and head hold ``seq_shapes[r]`` tokens on TP rank ``r``; ``qkv``/``fc1`` all-gather them
  and ``proj``/``fc2`` reduce-scatter back (instead of all-reducing). Inside the attention and MLP the tokens
  are then dim 0 (``(n, B, features)``), where those collectives cut contiguous blocks, in the piece-major
  order of the overlapped collectives (attention and MLP do not depend on the order). A replicated parameter
  is then used on different tokens by each TP rank, so its gradient is summed over TP in backward
  (:func:`replicated_param`).

Parameters are DTensors on the TP mesh: ``Shard`` where TP splits them, ``Replicate`` elsewhere. A split
in units of heads is a split of a head axis, so DTensor's ``torch.chunk`` rule gives each rank whole heads,
also unevenly (3 heads over 2 ranks: 2 + 1): the fused QKV weight is held as ``(3, heads, head_dim, D)``
(the plain ``(3 * D, D)`` rows are ordered q, k, v, head-major within each), the output projection as
``(D, heads, head_dim)``. Such parameters list their plain shape in ``plain_shapes``, which checkpoints
keep (``distributed/checkpoint/views.py``). The forward runs our autograd mappings
(``distributed/mappings.py``) on the local shards (``to_local()``), so DCP, ``clip_grad_norm_``, Adam and the
GradScaler see ordinary DTensors.

Gradient contract: after backward every parameter holds its TP shard of the single-process gradient
restricted to this CP rank's tokens (with sequence parallelism too: the TP sum restores every token of the CP
rank). Summing over the CP ranks (and averaging over the data-parallel ones)
is data parallelism's job: FSDP or ``replicate`` over the joint data x context mesh with a gradient divide
factor of the data-parallel size (``distributed/parallelize.py``).

Without a mesh (``tp_mesh=None``) parameters are plain tensors and the layers compute exactly like their
dense twins, so the same code runs in one process and under context parallelism alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from distributed.mappings import (all_gather_uneven, column_parallel_linear, compute_split_shapes,
                                  copy_to_parallel_region, gather_from_parallel_region,
                                  gather_from_sequence_parallel_region, group_rank, group_size, row_parallel_linear,
                                  scatter_to_parallel_region)
from distributed.ring_attention import ring_attention
from distributed.sequence_parallel import CHUNKS, sequence_parallel_column_linear, sequence_parallel_row_linear
from distributed.world import local_tensor


def parallel_param(dense: torch.Tensor, mesh: DeviceMesh | None, placement: Placement) -> nn.Parameter:
    """``dense`` (the same tensor on every rank) as a parameter: this rank's DTensor shard on ``mesh`` (no
    communication: each rank cuts its own), or a copy of ``dense`` without a mesh."""
    dense = dense.detach()
    if mesh is None:
        return nn.Parameter(dense.clone())
    return nn.Parameter(distribute_tensor(dense, mesh, [placement], src_data_rank=None))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` runs ``x`` in: autocast's where it is on for ``x``'s device, else ``x``'s own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def tp_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The process group of the TP mesh, None without one."""
    return None if mesh is None else mesh.get_group()


class Groups:
    """A layer's TP mesh and group, CP group and, under sequence parallelism, whether tokens are split over TP.
    Process groups cannot be deep-copied, so layers keep them behind this holder, whose copies are itself:
    ``copy.deepcopy(model)`` (an EMA model, say) shares them."""

    def __init__(self, tp_mesh: DeviceMesh | None, cp_group: dist.ProcessGroup | None,
                 sequence_parallel: bool = False):
        self.tp_mesh, self.tp, self.cp = tp_mesh, tp_group(tp_mesh), cp_group
        self.sequence_parallel = sequence_parallel and group_size(self.tp) > 1

    def __deepcopy__(self, memo) -> Groups:
        return self


def replicated_param(param: torch.Tensor, groups: Groups) -> torch.Tensor:
    """The local tensor of a parameter replicated over TP. Under sequence parallelism each TP rank applies it to
    its own tokens, so its gradient is the sum over TP (``copy_to_parallel_region``'s backward all-reduce);
    otherwise every rank already computes the full gradient."""
    local = local_tensor(param)
    return copy_to_parallel_region(local, groups.tp) if groups.sequence_parallel else local


class DistributedMatmul(nn.Module):
    """Tensor-parallel ``y = x W^T + b`` of a dense ``nn.Linear`` ``W`` ``(out_features, in_features)``.

    ``parallel="column"``: this rank owns a block of output features ``W_r`` and ``b_r``. The input ``x``
        ``(..., in)`` is replicated over TP (:func:`column_parallel_linear`: backward all-reduce of ``dx``
        overlapped with ``dW_r``'s GEMM); the output
        ``y_r = x W_r^T + b_r`` is ``(..., out_r)`` (feature-split), or the dense ``(..., out)`` with
        ``gather_output=True``. Backward: ``dW_r = dy_r^T x``, ``db_r = sum dy_r``, ``dx = sum_r dy_r W_r``.
    ``parallel="row"``: this rank owns the matching block of input features; the bias is replicated. The input
        ``x_r`` ``(..., in_r)`` is feature-split (or dense with ``input_is_parallel=False``, then scattered);
        ``y = sum_r x_r W_r^T + b`` is all-reduced (:func:`row_parallel_linear`: in chunks of the batch, each
        overlapping the next chunk's GEMM), the bias added once.
    ``seq_shapes`` (sequence parallelism, module docstring): the TP split of the tokens, which are dim 0. A
        column layer takes ``(seq_shapes[r], ..., in)`` and returns all ``(sum(seq_shapes), ..., out_r)``
        (:func:`sequence_parallel_column_linear`); a row layer the reverse, reduce-scattering instead of
        all-reducing (:func:`sequence_parallel_row_linear`; its bias's gradient summed over TP). ``seq_chunks``:
        the pieces their collectives are cut into (``CHUNKS``; 1 under async TP, ``distributed/async_tp.py``).
    Under autocast, input, weight and bias are cast to autocast's dtype first, so the all-reduces carry it.

    ``groups``/``unit_size``: the split dimension is ``(groups, units, unit_size)`` and whole units are split
    (the fused QKV: groups 3, units heads, unit size head_dim); the parameter then has those axes (see the
    module docstring). Tokens may also be split over CP (the layer is token-wise).

    Raises:
        TypeError: ``from_dense`` of a module that is not an ``nn.Linear``.
        ValueError: an unknown ``parallel``, a split dimension not divisible by ``groups * unit_size``, or
            ``gather_output`` / ``input_is_parallel=False`` with a grouped or unit layout or with ``seq_shapes``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp_mesh: DeviceMesh | None = None,
                 cp_group: dist.ProcessGroup | None = None, *, parallel: str = "column", groups: int = 1,
                 unit_size: int = 1, gather_output: bool = False, input_is_parallel: bool = True,
                 seq_shapes: Sequence[int] | None = None):
        super().__init__()
        out_features, in_features = weight.shape
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        split = out_features if parallel == "column" else in_features
        if split % (groups * unit_size):
            raise ValueError(f"{parallel}-parallel dimension {split} is not divisible by groups*unit_size "
                             f"= {groups}*{unit_size}")
        plain = groups == 1 and unit_size == 1
        if gather_output and (parallel != "column" or not plain):
            raise ValueError("gather_output needs a column-parallel layer with groups=1, unit_size=1")
        if not input_is_parallel and (parallel != "row" or not plain):
            raise ValueError("input_is_parallel=False needs a row-parallel layer with groups=1, unit_size=1")
        if seq_shapes is not None and (gather_output or not input_is_parallel):
            raise ValueError("seq_shapes (sequence parallelism) excludes gather_output and input_is_parallel=False")
        self.groups = Groups(tp_mesh, cp_group, seq_shapes is not None)
        self.seq_shapes = None if seq_shapes is None else list(seq_shapes)
        self.seq_chunks = CHUNKS
        self.in_features, self.out_features, self.parallel = in_features, out_features, parallel
        self.gather_output, self.input_is_parallel = gather_output, input_is_parallel
        units = split // (groups * unit_size)
        self.plain_shapes: dict[str, torch.Size] = {}  # parameters held with the unit axes, by name
        if parallel == "column":
            shape = (groups, units, unit_size) if not plain else (out_features,)
            self.weight = self._param("weight", weight, (*shape, in_features), Shard(len(shape) - 2 if not plain else 0))
            self.bias = None if bias is None else self._param("bias", bias, shape, Shard(0 if plain else 1))
        else:
            shape = (units, unit_size) if unit_size > 1 else (in_features,)
            self.weight = self._param("weight", weight, (out_features, *shape), Shard(1))
            self.bias = None if bias is None else parallel_param(bias, tp_mesh, Replicate())
        self.out_shapes = compute_split_shapes(out_features, group_size(self.groups.tp))

    def _param(self, name: str, dense: torch.Tensor, shape: Sequence[int], placement: Placement) -> nn.Parameter:
        """``dense`` held in ``shape`` (its unit axes) and sharded by ``placement``; without a mesh, as it is."""
        mesh = self.groups.tp_mesh
        if mesh is None:
            return parallel_param(dense, None, placement)
        if tuple(shape) != tuple(dense.shape):
            self.plain_shapes[name] = dense.shape
        return parallel_param(dense.reshape(shape), mesh, placement)

    @classmethod
    def from_dense(cls, module: nn.Linear, tp_mesh: DeviceMesh | None, cp_group: dist.ProcessGroup | None = None,
                   **kwargs) -> "DistributedMatmul":
        """This rank's part of a dense ``nn.Linear`` (same device and dtype); ``kwargs`` as the constructor's."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"expected nn.Linear, got {type(module).__name__}")
        return cls(module.weight, module.bias, tp_mesh, cp_group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # cast as autocast would, before the collectives: the backward all-reduce of dx then runs in bf16 too
        dtype = compute_dtype(x)
        x, weight = x.to(dtype), local_tensor(self.weight).to(dtype)
        tp, sp = self.groups.tp, self.groups.sequence_parallel
        if self.parallel == "column":
            bias = None if self.bias is None else local_tensor(self.bias).reshape(-1).to(dtype)
            weight = weight.reshape(-1, self.in_features)
            if sp:
                return sequence_parallel_column_linear(x, weight, bias, self.seq_shapes, tp, self.seq_chunks)
            y = column_parallel_linear(x, weight, bias, tp)
            return gather_from_parallel_region(y, -1, self.out_shapes, tp) if self.gather_output else y
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, -1, tp)
        weight = weight.reshape(self.out_features, -1)
        y = (sequence_parallel_row_linear(x, weight, self.seq_shapes, tp, self.seq_chunks) if sp
             else row_parallel_linear(x, weight, tp))
        # the bias in the dtype of y, as F.linear adds it under autocast: an fp32 bias would promote a bf16
        # output (and with it the residual stream of --amp_mode bf16_pure) to fp32
        return y if self.bias is None else y + replicated_param(self.bias, self.groups).to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, parallel={self.parallel}, "
                f"local_weight={tuple(local_tensor(self.weight).shape)}, bias={self.bias is not None}")


class ReplicatedLinear(nn.Module):
    """A dense ``nn.Linear`` whose parameters are replicated over the TP mesh (the ViT's head): every TP rank
    computes the same output from the same (replicated) input, or with ``sequence_parallel`` the output of its
    own tokens (the gradients then summed over TP)."""

    def __init__(self, module: nn.Linear, tp_mesh: DeviceMesh | None, sequence_parallel: bool = False):
        super().__init__()
        self.groups = Groups(tp_mesh, None, sequence_parallel)
        self.weight = parallel_param(module.weight, tp_mesh, Replicate())
        self.bias = None if module.bias is None else parallel_param(module.bias, tp_mesh, Replicate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else replicated_param(self.bias, self.groups)
        return F.linear(x, replicated_param(self.weight, self.groups), bias)


class DistributedMLP(nn.Module):
    """``fc2(GELU(fc1(x)))`` with ``fc1`` column-parallel and ``fc2`` row-parallel: ``(B, n, D) -> (B, n, D)``,
    input and output replicated over TP; the hidden activation ``(B, n, H_r)`` stays feature-split, so one
    all-reduce in forward (after ``fc2``) and one in backward (before ``fc1``'s input) are all the traffic.

    With ``seq_shapes`` (sequence parallelism) input and output are ``(B, seq_shapes[r], D)``, this TP rank's
    tokens: ``fc1`` all-gathers them, ``fc2`` reduce-scatters (the hidden activation ``(n, B, H_r)``)."""

    def __init__(self, module: nn.Module, tp_mesh: DeviceMesh | None, cp_group: dist.ProcessGroup | None = None,
                 *, seq_shapes: Sequence[int] | None = None):
        super().__init__()
        seq_shapes = seq_shapes if group_size(tp_group(tp_mesh)) > 1 else None
        self.sequence_first = seq_shapes is not None
        self.fc1 = DistributedMatmul.from_dense(module.fc1, tp_mesh, cp_group, parallel="column",
                                                seq_shapes=seq_shapes)
        self.act = module.act
        self.fc2 = DistributedMatmul.from_dense(module.fc2, tp_mesh, cp_group, parallel="row", seq_shapes=seq_shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_first:
            return self.fc2(self.act(self.fc1(x)))
        return self.fc2(self.act(self.fc1(x.transpose(0, 1)))).transpose(0, 1)


class DistributedAttention(nn.Module):
    """Multi-head self-attention with heads split over TP and tokens split over CP, from a dense
    ``networks.vit.Attention``. Input ``x``: ``(B, n_r, D)`` this CP rank's tokens, replicated over TP.
    Output: the same shape.

    * ``qkv`` is column-parallel over whole heads of q, k and v (``compute_split_shapes(num_heads, tp)``).
    * K and V ``(B, h_t, n_r, d)`` are all-gathered over CP along the sequence
      (:func:`gather_from_sequence_parallel_region`; backward reduce-scatters dK, dV), so
      ``O_r = softmax(Q_r K^T / sqrt(d)) V`` over all ``N`` tokens (``F.scaled_dot_product_attention``).
      With ``cp_attention="ring"`` they are passed around the CP ranks behind the attention of the chunk in
      hand instead (:func:`distributed.ring_attention.ring_attention`; ``attention_backend`` picks its CUDA
      kernel): the same ``O_r``.
    * ``proj`` is row-parallel over the local heads' features; its all-reduce sums heads.

    ``seq_len`` (total tokens ``N``) fixes the CP split to ``compute_split_shapes(N, cp)``; when None the
    per-rank token counts are all-gathered each call (one tiny collective).

    ``seq_shapes`` (sequence parallelism): input and output are ``(B, seq_shapes[r], D)``, this TP rank's share
    of the CP rank's tokens; ``qkv`` all-gathers them over TP (q, k, v then hold the CP rank's tokens
    sequence-first and piece-major, ``distributed/sequence_parallel.py``; softmax attention does not depend on
    the order of the tokens) and ``proj`` reduce-scatters its output back.

    Raises:
        ValueError: fewer heads than TP ranks, an unknown ``cp_attention``, or (in forward) a local token count
            that disagrees with ``seq_len``.
    """

    def __init__(self, module: nn.Module, tp_mesh: DeviceMesh | None, cp_group: dist.ProcessGroup | None = None,
                 *, seq_len: int | None = None, seq_shapes: Sequence[int] | None = None,
                 cp_attention: str = "all_gather", attention_backend: str = "auto"):
        super().__init__()
        tp = group_size(tp_group(tp_mesh))
        if module.num_heads < tp:
            raise ValueError(f"{module.num_heads} heads cannot be split over {tp} TP ranks")
        if cp_attention not in ("all_gather", "ring"):
            raise ValueError(f"cp_attention must be 'all_gather' or 'ring', got {cp_attention!r}")
        self.cp_attention, self.attention_backend = cp_attention, attention_backend
        seq_shapes = seq_shapes if tp > 1 else None
        self.groups = Groups(tp_mesh, cp_group, seq_shapes is not None)
        self.num_heads, self.head_dim, self.seq_len = module.num_heads, module.head_dim, seq_len
        self.qkv = DistributedMatmul.from_dense(module.qkv, tp_mesh, cp_group, parallel="column", groups=3,
                                                unit_size=self.head_dim, seq_shapes=seq_shapes)
        self.proj = DistributedMatmul.from_dense(module.proj, tp_mesh, cp_group, parallel="row",
                                                 unit_size=self.head_dim, seq_shapes=seq_shapes)
        self.local_heads = local_tensor(self.qkv.weight).shape[1] if tp_mesh is not None else self.num_heads

    def _seq_shapes(self, n_local: int, device: torch.device) -> list[int]:
        cp = self.groups.cp
        if self.seq_len is not None:
            shapes = compute_split_shapes(self.seq_len, group_size(cp))
            if shapes[group_rank(cp)] != n_local:
                raise ValueError(f"CP rank {group_rank(cp)} got {n_local} tokens, expected {shapes[group_rank(cp)]} "
                                 f"of seq_len={self.seq_len}")
            return shapes
        return all_gather_uneven(torch.tensor([n_local], device=device), 0, None, cp).tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_first = self.groups.sequence_parallel  # the GEMM region holds (n, B, features)
        tok, bat = (0, 1) if seq_first else (1, 0)  # the token and batch dims of the region
        qkv = self.qkv(x.transpose(0, 1) if seq_first else x)
        n = qkv.shape[tok]
        qkv = qkv.unflatten(-1, (3, self.local_heads, self.head_dim)).permute(2, bat, 3, tok, 4)
        q, kv = qkv[0], qkv[1:]  # (B, h, n, d), (2, B, h, n, d)
        cp = self.groups.cp
        if group_size(cp) > 1 and self.cp_attention == "ring":
            out = ring_attention(q, kv[0], kv[1], self._seq_shapes(n, x.device), cp, self.attention_backend)
        else:
            if group_size(cp) > 1:  # one collective for K and V: (2, B, h, n_r, d) -> (2, B, h, N, d)
                kv = gather_from_sequence_parallel_region(kv, 3, self._seq_shapes(n, x.device), cp)
            out = F.scaled_dot_product_attention(q, kv[0], kv[1])  # (B, h, n, d)
        out = self.proj(out.permute(2, 0, 1, 3).flatten(2) if seq_first else out.transpose(1, 2).flatten(2))
        return out.transpose(0, 1) if seq_first else out


class DistributedLayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dim of ``(B, n_r, D)`` tokens, its weight and bias replicated over TP.

    Normalization is per token, so no communication in forward: each CP rank's
    ``dweight = sum_tokens dy * x_hat`` and ``dbias = sum_tokens dy`` cover its own tokens (summed over CP by
    data parallelism). With ``sequence_parallel`` the TP ranks hold different tokens, and backward sums those
    two gradients over TP (:func:`replicated_param`).
    """

    def __init__(self, module: nn.LayerNorm, tp_mesh: DeviceMesh | None, sequence_parallel: bool = False):
        super().__init__()
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"expected nn.LayerNorm, got {type(module).__name__}")
        self.normalized_shape, self.eps = module.normalized_shape, module.eps
        self.groups = Groups(tp_mesh, None, sequence_parallel)
        self.weight = parallel_param(module.weight, tp_mesh, Replicate())
        self.bias = parallel_param(module.bias, tp_mesh, Replicate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, replicated_param(self.weight, self.groups),
                            replicated_param(self.bias, self.groups), self.eps)


class DistributedPatchEmbed(nn.Module):
    """Patch embedding that returns only this rank's tokens, from a dense ``networks.vit.PatchEmbed``.

    ``(B, C, H, W)`` (the full image, the same on every rank) -> ``(B, n_r, D)``, the tokens
    ``[offset, offset + n_r)`` of the row-major ``N = (H/p)(W/p)`` patches. Only the patch rows covering those
    tokens are embedded, so the cost is ``~1/cp`` of the dense one (``~1/(cp tp)`` under sequence
    parallelism). ``proj`` keeps the dense parameter names (``patch_embed.proj.weight``/``bias``), replicated
    over TP.

    The tokens are split over CP (``seq_shapes``) and, with ``sequence_parallel``, the CP rank's chunk further
    over TP (``tp_shapes``, each ``compute_split_shapes``; otherwise ``tp_shapes == [n_cp]``): TP rank ``t`` of
    CP rank ``c`` holds the ``tp_shapes[t]`` tokens after ``sum(seq_shapes[:c]) + sum(tp_shapes[:t])``.

    Raises:
        ValueError: more CP ranks than patches.
    """

    def __init__(self, module: nn.Module, tp_mesh: DeviceMesh | None, cp_group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.grid, self.patch_size, self.num_patches = tuple(module.grid), module.patch_size, module.num_patches
        cp = group_size(cp_group)
        if cp > self.num_patches:
            raise ValueError(f"{cp} CP ranks but only {self.num_patches} tokens")
        self.groups = Groups(tp_mesh, cp_group, sequence_parallel)
        self.proj = nn.Module()
        self.proj.weight = parallel_param(module.proj.weight, tp_mesh, Replicate())
        self.proj.bias = parallel_param(module.proj.bias, tp_mesh, Replicate())
        self.seq_shapes = compute_split_shapes(self.num_patches, cp)
        num_cp = self.seq_shapes[group_rank(cp_group)]
        tp = group_size(self.groups.tp) if self.groups.sequence_parallel else 1
        self.tp_shapes = compute_split_shapes(num_cp, tp)
        tp_rank = group_rank(self.groups.tp) if tp > 1 else 0
        self.cp_offset = sum(self.seq_shapes[:group_rank(cp_group)])
        self.offset = self.cp_offset + sum(self.tp_shapes[:tp_rank])
        self.num_local = self.tp_shapes[tp_rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gw, p = self.grid[1], self.patch_size
        row0, row1 = self.offset // gw, math.ceil((self.offset + self.num_local) / gw)
        rows = x[:, :, row0 * p:row1 * p]  # the patch rows holding this rank's tokens
        b, c = x.shape[:2]
        patches = rows.reshape(b, c, row1 - row0, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        weight = replicated_param(self.proj.weight, self.groups)
        tokens = F.linear(patches, weight.reshape(weight.shape[0], -1), replicated_param(self.proj.bias, self.groups))
        return tokens.narrow(1, self.offset - row0 * gw, self.num_local)
