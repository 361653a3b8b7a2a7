"""Tensor-parallel checkpoints in the dense (single-GPU) layout (``distributed/checkpoint/views.py``) and the
GradScaler under tensor parallelism.

A ViT with 3 heads (split 2 + 1 over tp=2) and Adam trains a few steps and is checkpointed by
``ShardedCheckpoints`` in every layout: plain (one process), tp=2 with FSDP over dp=2 and tp=2 with
HSDP (4 ranks), tp=2 sync and async (2 ranks). Each checkpoint is loaded into other layouts (plain,
tp=1, tp=2, tp=2 + FSDP/HSDP) and compared bitwise, in the dense layout, with the state at save time:
the reference gathers every parameter and Adam moment with ``get_state_dict(full_state_dict=True)`` (DTensor's
own gather) and reshapes the head-axis ones to the plain shape, a path independent of the checkpoint's
chunks. Also the checkpoint's metadata (dense shape, one chunk per head block), ``tools.export_model`` from a
tp checkpoint, the plain boxes of a viewed shard, and torch's GradScaler skipping a step on every tp rank
when one rank's gradient shard overflows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distributed.checkpoint.export import export_model, full_model_state_dict
from distributed.checkpoint.folder import step_folder
from distributed.checkpoint.sharded import ShardedCheckpoints
from distributed.checkpoint.views import plain_boxes
from distributed.launch import LaunchEnv
from distributed.layers import DistributedMatmul
from distributed.tensor_parallel import apply_tensor_context_parallel, checkpoint_views
from distributed.world import World
from networks.vit import VisionTransformer, build_model
from tests.dist_utils import run_distributed
from tests.multiprocess.test_checkpoint import assert_same
from utils.config.loading import load_config, to_yaml
from utils.config.schema import CheckpointConfig

# 3 heads of 4 over tp=2: rank 0 owns heads 0-1, rank 1 head 2 (qkv: 3 blocks each); MLP hidden 48
SMALL3 = dict(img_size=(8, 16), patch_size=4, in_chans=2, out_chans=2, embed_dim=12, depth=2, num_heads=3)
SMALL3_CONFIG = {"img_size": [8, 16], "patch_size": 4, "n_in_channels": 2, "n_out_channels": 2, "embed_dim": 12,
                 "depth": 2, "num_heads": 3}


# ----------------------------------------------------------------------------- helpers (any process)
def make_model(seed: int, tp_mesh=None, tp: bool = True, fsdp_mesh=None) -> torch.nn.Module:
    """The dense ViT (seeded), tensor parallel over ``tp_mesh`` (None: tp=1) unless not ``tp``, then
    FSDP2 over ``fsdp_mesh`` (blocks, then the root)."""
    torch.manual_seed(seed)
    model = VisionTransformer(**SMALL3)
    if tp:
        apply_tensor_context_parallel(model, tp_mesh, None)
    if fsdp_mesh is not None:
        for block in model.blocks:
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model


class Run:
    """A model with Adam, a scheduler and a ShardedCheckpoints over ``directory``."""

    def __init__(self, model, directory: Path, async_checkpoint: bool = False):
        rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (1 + step))
        self.manager = ShardedCheckpoints(CheckpointConfig(async_checkpoint=async_checkpoint), Path(directory), model,
                                         self.optimizer, {"scheduler": self.scheduler},
                                         World(LaunchEnv(rank=rank, world_size=size), torch.device("cpu")))
        self.steps = 0

    def train(self, steps: int) -> None:
        """Adam steps on the same batch on every rank (tp peers need it; dp ranks may share it)."""
        for _ in range(steps):
            self.steps += 1
            x = torch.randn(2, 2, 8, 16, generator=torch.Generator().manual_seed(self.steps))
            self.optimizer.zero_grad()
            self.model(x).square().mean().backward()
            self.optimizer.step()
            self.scheduler.step()

    def dense(self) -> dict:
        """Model, optimizer and scheduler state in the dense layout (collective): DTensors (FSDP, tp) gathered by
        ``get_state_dict``, head-axis parameters and moments reshaped to the plain shape."""
        views = checkpoint_views(self.model)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        model_sd = {k: v.detach().clone().reshape(views.get(k, v.shape)) for k, v in model_sd.items()}
        optim_state = {k: {n: t.clone().reshape(views[k]) if k in views and t.dim() else t.clone() for n, t in v.items()}
                       for k, v in optim_sd["state"].items()}
        return {"model": model_sd, "optim": {"state": optim_state, "param_groups": optim_sd["param_groups"]},
                "scheduler": self.scheduler.state_dict()}

    def load(self, directory: Path, step: int, want: dict) -> None:
        """Load ``directory``'s latest checkpoint (of ``step``), check it is bitwise ``want`` and go on
        from its step."""
        assert self.manager.load(Path(directory)) == step
        assert_same(self.dense(), want, str(directory))
        self.steps = self.scheduler.last_epoch


def _save_reference(run: Run, directory: Path) -> dict:
    """The run's dense state, written to ``<directory>/want.pt`` by rank 0 for the other processes."""
    want, full = run.dense(), full_model_state_dict(run.model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({**want, "full_state_dict": full}, Path(directory) / "want.pt")
    return want


def _want(directory: Path) -> dict:
    want = torch.load(Path(directory) / "want.pt", weights_only=False)
    del want["full_state_dict"]
    return want


# ----------------------------------------------------------------------------- distributed workers
def fsdp_worker(rank: int, world_size: int, root: str) -> None:
    """4 ranks, tp=2 x dp=2: the plain checkpoint loads into tp + FSDP; tp + FSDP saves and reloads;
    tp + HSDP (2 replicas of 1 shard) loads that and saves its own, asynchronously."""
    root = Path(root)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    run = Run(make_model(1, tp, fsdp_mesh=mesh["dp"]), root / "tp_fsdp")
    run.load(root / "plain", 2, _want(root / "plain"))  # a non-TP checkpoint into tp + FSDP
    run.train(1)
    run.manager.save(3)
    want = _save_reference(run, root / "tp_fsdp")
    Run(make_model(2, tp, fsdp_mesh=mesh["dp"]), root / "other").load(root / "tp_fsdp", 3, want)

    hsdp_mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    hsdp = Run(make_model(3, hsdp_mesh["tp"], fsdp_mesh=hsdp_mesh["dp_replicate", "dp_shard"]),
               root / "hsdp", async_checkpoint=True)
    hsdp.load(root / "tp_fsdp", 3, want)
    hsdp.manager.save(3)
    hsdp.manager.close()


def tp_worker(rank: int, world_size: int, root: str) -> None:
    """2 ranks, tp=2: the tp + FSDP checkpoint loads; sync and async saves reload bitwise (the async one
    although the parameters change while it is written)."""
    root = Path(root)
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]
    run = Run(make_model(4, tp), root / "tp_run" / "checkpoints")
    run.load(root / "tp_fsdp", 3, _want(root / "tp_fsdp"))
    run.train(1)
    run.manager.save(4)
    want4 = _save_reference(run, root / "tp_run")
    async_run = Run(make_model(5, tp), root / "tp_async", async_checkpoint=True)
    async_run.load(root / "tp_run" / "checkpoints", 4, want4)
    async_run.train(1)
    async_run.manager.save(5)
    want5 = _save_reference(async_run, root / "tp_async")
    async_run.train(2)  # while the background write may still run
    async_run.manager.close()
    assert async_run.manager.latest() == step_folder(root / "tp_async", 5)
    Run(make_model(6, tp), root / "other").load(root / "tp_async", 5, want5)


# ----------------------------------------------------------------------------- the checkpoints
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """``plain`` (step 2, one process), ``tp_fsdp`` and ``hsdp`` (async; step 3, 4 ranks), ``tp_run/checkpoints``
    (step 4) and ``tp_async`` (step 5, 2 ranks), each with the dense reference ``want.pt`` beside it
    (``hsdp`` holds ``tp_fsdp``'s state)."""
    root = tmp_path_factory.mktemp("tp_checkpoints")
    plain = Run(make_model(0, tp=False), root / "plain")
    plain.train(2)
    plain.manager.save(2)
    _save_reference(plain, root / "plain")
    run_distributed(fsdp_worker, 4, str(root))
    run_distributed(tp_worker, 2, str(root))
    return root


CHECKPOINTS = {"tp_fsdp": 3, "hsdp": 3, "tp_run/checkpoints": 4, "tp_async": 5}


def _reference(root: Path, name: str) -> dict:
    return _want(root / {"hsdp": "tp_fsdp", "tp_run/checkpoints": "tp_run"}.get(name, name))


@pytest.mark.parametrize("tp", [False, True], ids=["plain model", "tp=1"])
def test_tp_checkpoints_load_on_one_process(checkpoints, tp):
    for name, step in CHECKPOINTS.items():
        Run(make_model(7, tp=tp), checkpoints / "other").load(checkpoints / name, step, _reference(checkpoints, name))


def test_checkpoint_holds_dense_tensors_in_head_blocks(checkpoints):
    """qkv's weight (36 x 12 dense) is 3 blocks of rank 0's two heads (8 rows) and 3 of rank 1's one
    head (4 rows), each at its place in the dense tensor; replicated tensors are one chunk."""
    metadata = FileSystemReader(checkpoints / "tp_run" / "checkpoints" / "step_00000004").read_metadata()
    for key in ("model.blocks.0.attn.qkv.weight", "optim.state.blocks.0.attn.qkv.weight.exp_avg"):
        md = metadata.state_dict_metadata[key]
        assert md.size == torch.Size([36, 12])
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        assert chunks == [((0, 0), (8, 12)), ((8, 0), (4, 12)), ((12, 0), (8, 12)), ((20, 0), (4, 12)),
                          ((24, 0), (8, 12)), ((32, 0), (4, 12))], chunks
    proj = metadata.state_dict_metadata["model.blocks.0.attn.proj.weight"]
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in proj.chunks) == [((0, 0), (12, 8)), ((0, 8), (12, 4))]
    assert len(metadata.state_dict_metadata["model.blocks.0.attn.proj.bias"].chunks) == 1


def test_export_model_from_tp_checkpoint(checkpoints):
    run_dir = checkpoints / "tp_run"
    cfg = load_config("config/ViT.yaml", "tiny", SMALL3_CONFIG)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    out, step = export_model(run_dir)
    assert step == 4
    model = build_model(cfg.model, cfg.data)
    model.load_state_dict(torch.load(out)["model"])
    assert_same(model.state_dict(), torch.load(run_dir / "want.pt", weights_only=False)["full_state_dict"])


# ----------------------------------------------------------------------------- the plain boxes of a viewed shard
@pytest.mark.parametrize("heads,world", [(3, 2), (5, 2), (5, 3), (4, 4)])
def test_plain_boxes_place_every_element_of_a_shard(heads, world):
    """A tp rank's shard of the fused QKV weight held as (3, heads, head_dim, D), whole or cut along D (FSDP),
    lands where the plain (3 * heads * head_dim, D) tensor has it."""
    d, width = 2, 6
    view = (3, heads, d, width)
    dense = torch.arange(3 * heads * d * width, dtype=torch.float64).reshape(3 * heads * d, width)
    held = dense.reshape(view)
    chunk = -(-heads // world)
    for rank in range(world):
        h0, hr = rank * chunk, max(0, min(chunk, heads - rank * chunk))
        for c0, cn in [(0, width), (0, 3), (3, 3), (2, 1)]:
            box = ((0, h0, 0, c0), (3, hr, d, cn))
            local = held[:, h0:h0 + hr, :, c0:c0 + cn]
            covered = 0
            for (off, size), index in plain_boxes(view, dense.shape, box):
                part = local[index].reshape(size)
                assert torch.equal(dense[off[0]:off[0] + size[0], off[1]:off[1] + size[1]], part), (rank, off)
                covered += part.numel()
            assert covered == local.numel(), (rank, c0, cn)


# ----------------------------------------------------------------------------- GradScaler
def _scaler_worker(rank: int, world_size: int) -> None:
    """2 ranks as one tp group: rank 1's gradient shard overflows. With DTensor parameters torch's own scaler
    skips the step on both ranks (the inf check is reduced over the mesh), also with an explicit unscale_ and
    for fused Adam, then steps on both."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for variant in ("step", "unscale_", "fused"):
        torch.manual_seed(0)
        layer = DistributedMatmul.from_dense(torch.nn.Linear(4, 4), mesh["tp"])
        optimizer = torch.optim.Adam(layer.parameters(), lr=0.1, fused=variant == "fused")
        scaler = torch.amp.GradScaler("cpu")
        for overflow in (True, False):
            before = layer.weight.to_local().detach().clone()
            optimizer.zero_grad()
            scaler.scale(layer(torch.ones(2, 4)).square().sum()).backward()
            if overflow and rank == 1:
                layer.weight.grad.to_local()[0, 0] = float("inf")
            if variant == "unscale_":
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            stepped = not torch.equal(layer.weight.to_local(), before)
            assert stepped == (not overflow), (variant, overflow, rank)
        assert scaler.get_scale() == 2.0**15, (variant, scaler.get_scale())  # halved once, on both ranks


def test_grad_scaler_skips_the_step_on_every_tp_rank():
    run_distributed(_scaler_worker, 2)
