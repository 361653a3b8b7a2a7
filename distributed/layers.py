"""Tensor-parallel (TP) and context-parallel (CP) building blocks for the ViT.

Layout of the parallelism (Megatron-LM style, Shoeybi et al. 2019; CP by all-gathering
keys/values along the sequence as in Llama 3's context parallelism):

* **TP** splits weights: column-parallel ``Linear`` layers own a block of output rows,
  row-parallel ones the matching block of input columns; activations between them are
  feature-split, everything else (residual stream, LayerNorms, patch embedding, head) is
  replicated over the TP group.
* **CP** splits tokens: every CP rank holds a contiguous chunk of the ``N`` tokens
  (:func:`~distributed.mappings.compute_split_shapes`, uneven allowed) and all weights.
  Token-wise layers need no communication; attention all-gathers K/V so local queries
  see every token.

Gradient contract (the training loop relies on it):

* After ``loss.backward()`` every TP-sharded parameter holds exactly its slice of the
  single-process gradient *restricted to this CP rank's tokens*; TP-replicated parameters
  hold the same on every TP peer.
* Every parameter is replicated over CP and each CP rank only saw its own tokens, so the
  true gradient is the **sum over the CP group**. Call :func:`reduce_replicated_gradients`
  once after backward (after all micro-batches when accumulating) and before
  ``clip_grad_norm_`` / ``optimizer.step()``. It is a no-op without CP.

Process groups are passed in (e.g. ``mesh["tp"].get_group()``); ``None`` or a group of one
rank means "not parallel" and the layers then compute exactly like their dense twins.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed.mappings import (
    all_gather_uneven,
    compute_split_shapes,
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_from_parallel_region,
    scatter_to_parallel_region,
)

__all__ = [
    "ParallelGroups",
    "ShardLayout",
    "DistributedMatmul",
    "DistributedMLP",
    "DistributedAttention",
    "DistributedLayerNorm",
    "DistributedPatchEmbed",
    "reduce_replicated_gradients",
]


class ParallelGroups:
    """Holds the ``tp_group`` and ``cp_group`` of a module (either may be ``None``).

    Process groups cannot be pickled or deep-copied, so modules keep them behind this
    holder, whose copies are itself: ``copy.deepcopy(model)`` (e.g. for an EMA model)
    then shares the communicators instead of failing.
    """

    def __init__(self, tp_group: dist.ProcessGroup | None = None, cp_group: dist.ProcessGroup | None = None):
        self.tp_group = tp_group
        self.cp_group = cp_group

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __repr__(self) -> str:
        return f"ParallelGroups(tp={group_size(self.tp_group)}, cp={group_size(self.cp_group)})"


class ParallelModule(nn.Module):
    """Mixin giving ``tp_group`` / ``cp_group`` properties backed by :class:`ParallelGroups`."""

    parallel_groups: ParallelGroups

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.parallel_groups.tp_group

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.parallel_groups.cp_group


@dataclass(frozen=True)
class ShardLayout:
    """How dimension ``dim`` of a dense tensor is split over the TP ranks.

    The dimension (size ``groups * units * unit_size``) is viewed as
    ``(groups, units, unit_size)`` and the ``units`` axis is split with
    :func:`compute_split_shapes`, so e.g. a fused QKV weight (``groups=3``, ``units=heads``,
    ``unit_size=head_dim``) gives each rank whole heads of q, k and v.
    """

    dim: int
    groups: int
    units: int
    unit_size: int

    @property
    def full_size(self) -> int:
        return self.groups * self.units * self.unit_size

    def unit_range(self, rank: int, world: int) -> tuple[int, int]:
        """``(first_unit, num_units)`` owned by ``rank`` of ``world``."""
        shapes = compute_split_shapes(self.units, world)
        return sum(shapes[:rank]), shapes[rank]

    def local_size(self, rank: int, world: int) -> int:
        """Size of ``dim`` in ``rank``'s shard."""
        return self.groups * self.unit_range(rank, world)[1] * self.unit_size

    def shard(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Contiguous copy of ``rank``'s shard of the dense tensor ``full``.

        Raises:
            ValueError: if ``full.shape[dim]`` is not ``groups * units * unit_size``.
        """
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"expected size {self.full_size} along dim {self.dim}, got {tuple(full.shape)}")
        start, count = self.unit_range(rank, world)
        fm = full.movedim(self.dim, 0)
        rest = fm.shape[1:]
        fm = fm.reshape((self.groups, self.units * self.unit_size) + rest)
        part = fm[:, start * self.unit_size:(start + count) * self.unit_size]
        return part.reshape((self.groups * count * self.unit_size,) + rest).movedim(0, self.dim).contiguous()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`shard`: rebuild the dense tensor from all ranks' shards (rank order)."""
        world = len(shards)
        parts = []
        for rank, s in enumerate(shards):
            sm = s.movedim(self.dim, 0)
            count = self.unit_range(rank, world)[1]
            parts.append(sm.reshape((self.groups, count * self.unit_size) + sm.shape[1:]))
        full = torch.cat(parts, 1)
        return full.reshape((self.full_size,) + full.shape[2:]).movedim(0, self.dim)


# ----------------------------------------------------------------------------- linear layers


class DistributedMatmul(ParallelModule):
    """Tensor-parallel ``y = x W^T + b`` with ``W`` of dense shape ``(out_features, in_features)``.

    ``parallel="column"``: this rank owns rows ``W_r`` (``(out_r, in)``) and ``b_r``.
        Input ``x`` ``(..., in)`` is replicated over TP and enters through
        :func:`copy_to_parallel_region`; output ``y_r = x W_r^T + b_r`` is ``(..., out_r)``
        (feature-split), or the dense ``(..., out)`` with ``gather_output=True``.
        Backward: ``dW_r = dy_r^T x``, ``db_r = sum dy_r``, ``dx = sum_r dy_r W_r``
        (the all-reduce of ``copy_to``).
    ``parallel="row"``: this rank owns columns ``W_r`` (``(out, in_r)``); the bias is
        replicated. Input ``x_r`` ``(..., in_r)`` is feature-split (or dense with
        ``input_is_parallel=False``, then scattered); ``y = sum_r x_r W_r^T + b`` is
        all-reduced (:func:`reduce_from_parallel_region`) and the bias added once after
        the sum. Backward: ``dx_r = dy W_r``, ``dW_r = dy^T x_r``, ``db = sum dy`` (the
        same on every TP rank).

    The split dimension is viewed as ``(groups, units, unit_size)`` (:class:`ShardLayout`)
    and ``units`` are split unevenly if needed; defaults ``groups=1, unit_size=1`` split
    single features. Works for any float dtype; tokens may also be split over CP (the
    layer is token-wise, so CP only matters for :func:`reduce_replicated_gradients`).

    Raises:
        ValueError: on an unknown ``parallel``, a split dimension not divisible by
            ``groups * unit_size``, or ``gather_output`` / ``input_is_parallel=False``
            combined with a grouped or unit layout (the dense order would not be contiguous).
    """

    def __init__(self, in_features: int, out_features: int, tp_group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None, *, parallel: str = "column", bias: bool = True,
                 groups: int = 1, unit_size: int = 1, gather_output: bool = False,
                 input_is_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        split = out_features if parallel == "column" else in_features
        if split % (groups * unit_size):
            raise ValueError(f"{parallel}-parallel dimension {split} is not divisible by groups*unit_size "
                             f"= {groups}*{unit_size}")
        plain = groups == 1 and unit_size == 1
        if gather_output and (parallel != "column" or groups != 1):
            raise ValueError("gather_output needs a column-parallel layer with groups=1")
        if not input_is_parallel and (parallel != "row" or not plain):
            raise ValueError("input_is_parallel=False needs a row-parallel layer with groups=1, unit_size=1")
        self.parallel_groups = ParallelGroups(tp_group, cp_group)
        self.in_features, self.out_features, self.parallel = in_features, out_features, parallel
        self.gather_output, self.input_is_parallel = gather_output, input_is_parallel
        tp, rank = group_size(tp_group), group_rank(tp_group)
        layout = ShardLayout(0 if parallel == "column" else 1, groups, split // (groups * unit_size), unit_size)
        local = layout.local_size(rank, tp)
        shape = (local, in_features) if parallel == "column" else (out_features, local)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        self.bias = nn.Parameter(torch.empty(local if parallel == "column" else out_features, **factory)) \
            if bias else None
        # name -> layout of every TP-sharded parameter; read by full_state_dict / load_full_state_dict
        self.tp_layouts = {"weight": layout}
        if bias and parallel == "column":
            self.tp_layouts["bias"] = ShardLayout(0, groups, layout.units, unit_size)
        self.out_shapes = [layout.local_size(r, tp) for r in range(tp)]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(in), 1/sqrt(in))`` with the dense fan-in (``nn.Linear``'s default bound).

        Shards are drawn independently; use :meth:`from_dense` to reproduce a dense init exactly.
        """
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_dense(cls, module: nn.Linear, tp_group: dist.ProcessGroup | None,
                   cp_group: dist.ProcessGroup | None = None, *, parallel: str = "column", groups: int = 1,
                   unit_size: int = 1, gather_output: bool = False,
                   input_is_parallel: bool = True) -> "DistributedMatmul":
        """Copy this rank's shard of a dense ``nn.Linear`` (same device and dtype; no RNG use).

        Raises:
            TypeError: if ``module`` is not an ``nn.Linear``.
            ValueError: as the constructor.
        """
        if not isinstance(module, nn.Linear):
            raise TypeError(f"expected nn.Linear, got {type(module).__name__}")
        # built on meta, then materialized: no random init, so the global RNG stays in step across ranks
        new = cls(module.in_features, module.out_features, tp_group, cp_group, parallel=parallel,
                  bias=module.bias is not None, groups=groups, unit_size=unit_size, gather_output=gather_output,
                  input_is_parallel=input_is_parallel, device="meta", dtype=module.weight.dtype)
        new.to_empty(device=module.weight.device)
        new.load_dense_(module.weight, module.bias)
        return new

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Overwrite the local parameters with this rank's shard of dense ``weight`` / ``bias``."""
        tp, rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.weight.copy_(self.tp_layouts["weight"].shard(weight.detach(), rank, tp))
        if self.bias is not None and bias is not None:
            layout = self.tp_layouts.get("bias")
            self.bias.copy_(layout.shard(bias.detach(), rank, tp) if layout else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "column":
            y = F.linear(copy_to_parallel_region(x, self.tp_group), self.weight, self.bias)
            if self.gather_output:
                y = gather_from_parallel_region(y, -1, self.out_shapes, self.tp_group)
            return y
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, -1, self.tp_group)
        y = reduce_from_parallel_region(F.linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, parallel={self.parallel}, "
                f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}, {self.parallel_groups}")


class DistributedMLP(ParallelModule):
    """``fc2(GELU(fc1(x)))`` with ``fc1`` column-parallel and ``fc2`` row-parallel.

    ``(B, n, D) -> (B, n, D)``, input and output replicated over TP; the hidden activation
    ``(B, n, H_r)`` stays feature-split, so one all-reduce in forward (after ``fc2``) and one
    in backward (before ``fc1``'s input) are the only communication. Tokens may be CP-split.
    """

    def __init__(self, in_features: int, hidden_features: int, tp_group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None, *, device=None, dtype=None):
        super().__init__()
        self.parallel_groups = ParallelGroups(tp_group, cp_group)
        kw = {"device": device, "dtype": dtype}
        self.fc1 = DistributedMatmul(in_features, hidden_features, tp_group, cp_group, parallel="column", **kw)
        self.act = nn.GELU()
        self.fc2 = DistributedMatmul(hidden_features, in_features, tp_group, cp_group, parallel="row", **kw)

    @classmethod
    def from_dense(cls, module: nn.Module, tp_group: dist.ProcessGroup | None,
                   cp_group: dist.ProcessGroup | None = None) -> "DistributedMLP":
        """Shard a dense MLP with ``fc1`` / ``act`` / ``fc2`` (``networks.vit.MLP``); ``act`` is copied.

        Raises:
            TypeError: if ``fc1`` / ``fc2`` are not ``nn.Linear``.
        """
        new = cls(module.fc1.in_features, module.fc1.out_features, tp_group, cp_group, device="meta",
                  dtype=module.fc1.weight.dtype)
        new.fc1 = DistributedMatmul.from_dense(module.fc1, tp_group, cp_group, parallel="column")
        new.act = copy.deepcopy(module.act)
        new.fc2 = DistributedMatmul.from_dense(module.fc2, tp_group, cp_group, parallel="row")
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DistributedAttention(ParallelModule):
    """Multi-head self-attention with heads split over TP and tokens split over CP.

    Input ``x``: ``(B, n_r, D)`` this CP rank's tokens, replicated over TP. Output: same shape.

    * ``qkv`` is column-parallel with layout ``(3, heads, head_dim)``: TP rank ``t`` owns
      ``h_t`` whole heads of q, k and v (``compute_split_shapes(num_heads, tp)``, uneven allowed).
    * K and V ``(B, h_t, n_r, d)`` are all-gathered over CP along the sequence
      (:func:`gather_from_sequence_parallel_region`; backward reduce-scatters dK, dV), so
      ``O_r = softmax(Q_r K^T / sqrt(d)) V`` over all ``N`` tokens, computed by
      ``F.scaled_dot_product_attention`` (no mask; the ViT is non-causal).
    * ``proj`` is row-parallel over the local heads' features; its all-reduce sums heads.

    ``seq_len`` (total tokens ``N``) fixes the CP split to ``compute_split_shapes(N, cp)``;
    when ``None`` the per-rank token counts are all-gathered each call (one tiny collective).
    Memory: each CP rank holds the full K/V of its local heads (``O(N)``), attention scores
    are ``O(n_r N)`` unless a fused SDPA backend is used.

    Raises:
        ValueError: if ``dim % num_heads != 0``, there are fewer heads than TP ranks, or the
            local token count disagrees with ``seq_len``.
    """

    def __init__(self, dim: int, num_heads: int, tp_group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None, *, seq_len: int | None = None,
                 device=None, dtype=None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        if num_heads < group_size(tp_group):
            raise ValueError(f"{num_heads} heads cannot be split over {group_size(tp_group)} TP ranks")
        self.parallel_groups = ParallelGroups(tp_group, cp_group)
        self.num_heads, self.head_dim, self.seq_len = num_heads, dim // num_heads, seq_len
        self.local_heads = compute_split_shapes(num_heads, group_size(tp_group))[group_rank(tp_group)]
        kw = {"device": device, "dtype": dtype}
        self.qkv = DistributedMatmul(dim, 3 * dim, tp_group, cp_group, parallel="column", groups=3,
                                     unit_size=self.head_dim, **kw)
        self.proj = DistributedMatmul(dim, dim, tp_group, cp_group, parallel="row", unit_size=self.head_dim, **kw)

    @classmethod
    def from_dense(cls, module: nn.Module, tp_group: dist.ProcessGroup | None,
                   cp_group: dist.ProcessGroup | None = None, *, seq_len: int | None = None
                   ) -> "DistributedAttention":
        """Shard a dense ``networks.vit.Attention`` (fused ``qkv`` rows ordered ``(3, heads, head_dim)``).

        Raises:
            ValueError: as the constructor.
        """
        dim = module.qkv.in_features
        new = cls(dim, module.num_heads, tp_group, cp_group, seq_len=seq_len, device="meta",
                  dtype=module.qkv.weight.dtype)
        new.qkv = DistributedMatmul.from_dense(module.qkv, tp_group, cp_group, parallel="column", groups=3,
                                               unit_size=new.head_dim)
        new.proj = DistributedMatmul.from_dense(module.proj, tp_group, cp_group, parallel="row",
                                                unit_size=new.head_dim)
        return new

    def _seq_shapes(self, n_local: int, device: torch.device) -> list[int]:
        cp = self.cp_group
        if self.seq_len is not None:
            shapes = compute_split_shapes(self.seq_len, group_size(cp))
            if shapes[group_rank(cp)] != n_local:
                raise ValueError(f"CP rank {group_rank(cp)} got {n_local} tokens, expected {shapes[group_rank(cp)]} "
                                 f"of seq_len={self.seq_len}")
            return shapes
        counts = all_gather_uneven(torch.tensor([n_local], device=device), 0, None, cp)
        return counts.tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, kv = qkv[0], qkv[1:]
        if group_size(self.cp_group) > 1:
            # one collective for K and V: (2, B, h, n_r, d) -> (2, B, h, N, d)
            kv = gather_from_sequence_parallel_region(kv, 3, self._seq_shapes(n, x.device), self.cp_group)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1])
        return self.proj(out.transpose(1, 2).reshape(b, n, self.local_heads * self.head_dim))


# ----------------------------------------------------------------------------- replicated layers


class DistributedLayerNorm(nn.LayerNorm, ParallelModule):
    """``nn.LayerNorm`` over the last dim of ``(B, n_r, D)`` CP-split tokens; weights replicated.

    The forward is the dense one (normalization is per token, so no communication). Each
    CP rank's ``dweight = sum_tokens dy * x_hat`` and ``dbias = sum_tokens dy`` only cover its
    own tokens; :func:`reduce_replicated_gradients` sums them over CP. Over TP the input
    and its gradient are replicated, so the gradients are already identical.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 tp_group: dist.ProcessGroup | None = None, cp_group: dist.ProcessGroup | None = None, *,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias=bias, device=device, dtype=dtype)
        self.parallel_groups = ParallelGroups(tp_group, cp_group)

    @classmethod
    def from_dense(cls, module: nn.LayerNorm, tp_group: dist.ProcessGroup | None,
                   cp_group: dist.ProcessGroup | None = None) -> "DistributedLayerNorm":
        """Copy a dense ``nn.LayerNorm`` (same shape, eps, device, dtype).

        Raises:
            TypeError: if ``module`` is not an ``nn.LayerNorm``.
        """
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"expected nn.LayerNorm, got {type(module).__name__}")
        ref = module.weight
        new = cls(module.normalized_shape, module.eps, module.elementwise_affine, module.bias is not None,
                  tp_group, cp_group, device=None if ref is None else ref.device,
                  dtype=None if ref is None else ref.dtype)
        new.load_state_dict(module.state_dict())
        return new


class DistributedPatchEmbed(ParallelModule):
    """Patch embedding that returns only this CP rank's tokens.

    ``(B, C, H, W)`` (full image, the same on every rank) -> ``(B, n_r, D)``, the tokens
    ``[offset, offset + n_r)`` of the row-major ``N = (H/p)(W/p)`` patches. Only the patch
    rows covering those tokens are convolved, so the conv costs ``~1/cp`` of the dense one.
    Backward: ``dproj`` only covers the local tokens (summed over CP by
    :func:`reduce_replicated_gradients`); the image gradient is partial per CP rank.

    Keeps ``proj`` (``nn.Conv2d``), ``grid`` and ``num_patches`` so parameter names match
    ``networks.vit.PatchEmbed``.

    Raises:
        ValueError: if there are more CP ranks than patches.
    """

    def __init__(self, proj: nn.Conv2d, grid: tuple[int, int], tp_group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.parallel_groups = ParallelGroups(tp_group, cp_group)
        self.proj, self.grid = proj, tuple(grid)
        self.num_patches = grid[0] * grid[1]
        cp = group_size(cp_group)
        if cp > self.num_patches:
            raise ValueError(f"{cp} CP ranks but only {self.num_patches} tokens")
        self.seq_shapes = compute_split_shapes(self.num_patches, cp)
        self.offset = sum(self.seq_shapes[:group_rank(cp_group)])
        self.num_local = self.seq_shapes[group_rank(cp_group)]

    @classmethod
    def from_dense(cls, module: nn.Module, tp_group: dist.ProcessGroup | None,
                   cp_group: dist.ProcessGroup | None = None) -> "DistributedPatchEmbed":
        """Copy a dense ``networks.vit.PatchEmbed`` (its ``proj`` is deep-copied)."""
        proj = nn.Conv2d(module.proj.in_channels, module.proj.out_channels, module.proj.kernel_size,
                         stride=module.proj.stride, bias=module.proj.bias is not None, device="meta",
                         dtype=module.proj.weight.dtype)
        proj.to_empty(device=module.proj.weight.device)
        proj.load_state_dict(module.proj.state_dict())
        return cls(proj, module.grid, tp_group, cp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p_h = self.proj.kernel_size[0]
        gw = self.grid[1]
        if self.num_local == self.num_patches:
            return self.proj(x).flatten(2).transpose(1, 2)
        row0, row1 = self.offset // gw, (self.offset + self.num_local - 1) // gw + 1
        tokens = self.proj(x[:, :, row0 * p_h:row1 * p_h]).flatten(2).transpose(1, 2)
        return tokens.narrow(1, self.offset - row0 * gw, self.num_local)


# ----------------------------------------------------------------------------- gradient reduction


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    # DTensor gradients (FSDP2 over a dp mesh dim): reduce their local shard in place.
    return t.to_local() if hasattr(t, "to_local") else t


def find_groups(model: nn.Module) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    found = [m.parallel_groups for m in model.modules()
             if isinstance(getattr(m, "parallel_groups", None), ParallelGroups)]
    # keyed by member ranks: a DeviceMesh may hand out distinct objects for the same group
    tps = {tuple(dist.get_process_group_ranks(g.tp_group)): g.tp_group for g in found if group_size(g.tp_group) > 1}
    cps = {tuple(dist.get_process_group_ranks(g.cp_group)): g.cp_group for g in found if group_size(g.cp_group) > 1}
    if len(tps) > 1 or len(cps) > 1:
        raise ValueError("the model mixes several TP or CP process groups; pass one model per group set")
    return next(iter(tps.values()), None), next(iter(cps.values()), None)


def tp_sharded_params(model: nn.Module) -> set[int]:
    ids = set()
    for m in model.modules():
        for name in getattr(m, "tp_layouts", {}):
            p = getattr(m, name, None)
            if p is not None:
                ids.add(id(p))
    return ids


def _all_reduce_coalesced(grads: Iterable[torch.Tensor], group: dist.ProcessGroup, op, bucket_bytes: int) -> None:
    """All-reduce ``grads`` in place, flattened into buckets of one dtype/device each."""
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    sizes: dict[tuple, int] = {}
    for g in grads:
        key = (g.device, g.dtype)
        if key not in buckets or sizes[key] + g.numel() * g.element_size() > bucket_bytes:
            buckets.setdefault(key, []).append([])
            sizes[key] = 0
        buckets[key][-1].append(g)
        sizes[key] += g.numel() * g.element_size()
    for bucket_list in buckets.values():
        for bucket in bucket_list:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=op, group=group)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))


@torch.no_grad()
def reduce_replicated_gradients(model: nn.Module, *, sync_tp_replicas: bool = False,
                                bucket_mb: float = 256.0) -> None:
    """Make every gradient equal to (its slice of) the single-process gradient.

    Call once per optimizer step, after ``backward`` (of all accumulated micro-batches)
    and before gradient clipping / ``optimizer.step()``. Process groups are read from the
    distributed layers inside ``model`` (any wrapper that keeps ``model.modules()`` works).

    * CP: every parameter is replicated over CP and each rank's ``.grad`` covers only its
      tokens, so all gradients are **summed** over the CP group (bucketed all-reduce).
    * ``sync_tp_replicas=True``: additionally **average** the gradients of TP-replicated
      parameters (norms, row-parallel biases, patch embedding, position embedding, head)
      over TP. They are identical in exact arithmetic; averaging only guards against
      non-deterministic kernels letting replicas drift. Off by default.

    No-op without CP (and TP sync). Parameters whose ``.grad`` is ``None`` are skipped (they
    must be ``None`` on every peer). DTensor gradients (FSDP2 over a dp group) are reduced
    shard-wise, which is valid because CP/TP peers hold the same dp shard layout.

    Raises:
        ValueError: if the model mixes several TP or CP groups.
    """
    tp_group, cp_group = find_groups(model)
    bucket_bytes = int(bucket_mb * 2**20)
    params = [p for p in model.parameters() if p.grad is not None]
    if cp_group is not None:
        _all_reduce_coalesced([local_tensor(p.grad) for p in params], cp_group, dist.ReduceOp.SUM, bucket_bytes)
    if sync_tp_replicas and tp_group is not None:
        sharded = tp_sharded_params(model)
        grads = [local_tensor(p.grad) for p in params if id(p) not in sharded]
        _all_reduce_coalesced(grads, tp_group, dist.ReduceOp.SUM, bucket_bytes)
        for g in grads:
            g.div_(group_size(tp_group))
