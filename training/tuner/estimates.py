"""The planner's analytic estimates, made without running a step: NCCL's buffers outside PyTorch's allocator
(:func:`nccl_allowance`), a rank's tokens, and FSDP's shard bytes from the sharding rule alone
(:func:`analytic_shard_bytes`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from distributed.mappings import compute_split_shapes
from distributed.parallelize import data_parallel_mesh
from distributed.world import World
from networks.vit import build_model
from utils.config.schema import Config

# NCCL's documented default buffer per channel and peer (NCCL_BUFFSIZE, 4 MiB; NCCL user guide, "Environment
# Variables": https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize). NCCL picks the
# channel count from the topology; NCCL_MAX_NCHANNELS bounds it, else 32 channels are assumed (an assumption, not
# a documented default). A ring connects each rank to two peers.
NCCL_BUFFSIZE_DEFAULT = 4 * 2**20
NCCL_CHANNELS_ASSUMED = 32
RING_PEERS = 2


@dataclass
class NcclAllowance:
    """NCCL's own buffers for this rank (outside PyTorch's allocator, so neither measured nor tracked): per
    collective group ``buffsize x channels x peers`` bytes (peers: ring neighbours, 1 in a group of 2)."""

    groups: list[tuple[str, int]]  # (the group's mesh dimensions, its size)
    buffsize: int = NCCL_BUFFSIZE_DEFAULT
    channels: int = NCCL_CHANNELS_ASSUMED

    def group_bytes(self, size: int) -> int:
        return self.buffsize * self.channels * min(RING_PEERS, size - 1)

    @property
    def total(self) -> int:
        return sum(self.group_bytes(size) for _, size in self.groups)


def nccl_allowance(cfg: Config, world: World, environ=os.environ) -> NcclAllowance:
    """The allowance for the collective groups this rank joins: the whole world, ``dp``, ``ens``, ``tp``, ``cp`` and the
    dimensions data parallelism reduces over; ``NCCL_BUFFSIZE`` and ``NCCL_MAX_NCHANNELS`` from ``environ``
    (set them as the job will) or the defaults above."""
    groups: dict[str, tuple[str, int]] = {}
    meshes = [world.meshes[name] for name in ("dp", "ens", "tp", "cp")] if world.meshes else []
    if world.meshes:
        meshes.append(data_parallel_mesh(cfg.parallel, world))
    for mesh in meshes:
        for dim, name in enumerate(mesh.mesh_dim_names):
            group = mesh.get_group(dim)
            if mesh.size(dim) > 1:
                groups[group.group_name] = (name, mesh.size(dim))
    named = ([("world", world.world_size)] if world.world_size > 1 else []) + list(groups.values())
    return NcclAllowance(named, int(environ.get("NCCL_BUFFSIZE", NCCL_BUFFSIZE_DEFAULT)),
                         int(environ.get("NCCL_MAX_NCHANNELS", NCCL_CHANNELS_ASSUMED)))


def all_tokens(cfg: Config) -> int:
    h, w = cfg.data.img_size
    return (h // cfg.model.patch_size) * (w // cfg.model.patch_size)


def rank_tokens(cfg: Config, world: World) -> int:
    """This rank's tokens: all of them, or its context-parallel share."""
    tokens = all_tokens(cfg)
    return compute_split_shapes(tokens, world.cp)[world.meshes["cp"].get_local_rank()] if world.cp > 1 else tokens


def analytic_shard_bytes(cfg: Config, world: World) -> dict[str, int]:
    """This rank's parameter, gradient and Adam bytes under FSDP (ZeRO-2/3, HSDP) without tensor/context
    parallelism, from the sharding rule alone: FSDP2 splits every parameter along dim 0 into as many chunks as the
    shard group has ranks (``dp``; HSDP: ``hsdp_shard_size``), as ``torch.chunk`` does
    (:func:`distributed.mappings.compute_split_shapes`); gradients are sharded alike, in the parameters' dtype;
    Adam keeps ``exp_avg`` and ``exp_avg_sq`` of each shard and a float32 ``step`` per parameter (PyTorch's
    ``torch.optim.Adam``). Empty for any other layout. FSDP2 pads each shard's storage to the largest chunk;
    these are the shards' own bytes."""
    if not world.fsdp_only:
        return {}
    with torch.device("meta"):
        plain = list(build_model(cfg.model, cfg.data).parameters())
    hsdp = cfg.parallel.fsdp == "hsdp"
    chunks = cfg.parallel.hsdp_shard_size if hsdp else world.dp
    shard = world.meshes["hsdp"].get_local_rank("dp_shard") if hsdp else world.meshes["dp"].get_local_rank()
    numel = sum(compute_split_shapes(p.shape[0], chunks)[shard] * p[0].numel() for p in plain)
    size = plain[0].element_size()
    return {"parameters": numel * size, "gradients": numel * size,
            "optimizer state": 2 * numel * size + 4 * len(plain)}
