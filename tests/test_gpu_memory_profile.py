"""GPU-only checks of the memory profiling window (skipped without CUDA): allocator snapshots that PyTorch's own
tools load, CUDA statistics, and the FSDP2 memory tracker on a GPU."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from ruamel.yaml import YAML
from torch.cuda import _memory_viz

from distributed.env import LaunchEnv, World
from utils.memory_profile import MemoryProfiler
from utils.schema import MemoryConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# ---------------------------------------------------------------- begin: memory profiling window (issue #13)


def tiny_vit() -> torch.nn.Module:
    from networks.vit import VisionTransformer
    torch.manual_seed(0)
    return VisionTransformer(img_size=(8, 16), patch_size=4, in_chans=2, out_chans=2, embed_dim=16, depth=2,
                             num_heads=2).cuda()


def profile(tmp_path, model, stacks: str = "python", steps: int = 3) -> dict:
    world = World(LaunchEnv(), torch.device("cuda", torch.cuda.current_device()))
    optimizer = torch.optim.Adam(model.parameters())
    cfg = MemoryConfig(memory_profile=True, memory_profile_start_step=1, memory_profile_steps=2,
                       memory_profile_stacks=stacks, memory_profile_depth=3)
    profiler = MemoryProfiler(cfg, tmp_path, world, model, optimizer, 3)
    try:
        for step in range(steps):
            with profiler.step(0, step):
                for _ in range(2):
                    x = torch.randn(3, 2, 8, 16, device="cuda")
                    (model(x) - x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    finally:
        profiler.close()
    return json.loads((tmp_path / "rank0" / "summary.json").read_text())


def test_snapshots_load_with_pytorch_tools_and_stats_have_cuda_keys(tmp_path):
    summary = profile(tmp_path, tiny_vit())
    names = summary["files"]["snapshots"]
    assert names == [f"snapshot_e0_s{s}_{w}.pickle" for s in (1, 2) for w in ("start", "end")]
    for name in names:
        with open(tmp_path / "rank0" / name, "rb") as f:
            snapshot = pickle.load(f)
        assert "segments" in snapshot and _memory_viz.segsum(snapshot)
        assert "<html" in _memory_viz.trace_plot(snapshot).lower()
    events = [e for trace in snapshot["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" and e["frames"] for e in events)  # history with Python stacks
    assert {"peak_allocated_bytes", "peak_reserved_bytes"} <= summary.keys() and "peak_rss_bytes" not in summary
    assert summary["peak_allocated_bytes"] > summary["parameter_bytes"] > 0
    stats = YAML(typ="safe").load((tmp_path / "rank0" / "memory_stats.yaml").read_text())
    first = stats[0]
    assert first["start"]["allocated_bytes.all.current"] > 0
    assert (first["end_minus_start"]["num_alloc_retries"]
            == first["end"]["num_alloc_retries"] - first["start"]["num_alloc_retries"])


def test_history_is_recorded_only_in_the_window_and_without_stacks_on_request(tmp_path):
    profile(tmp_path, tiny_vit(), stacks="none")
    with open(tmp_path / "rank0" / "snapshot_e0_s2_end.pickle", "rb") as f:
        snapshot = pickle.load(f)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    assert events and not any(e.get("frames") for e in events)  # context=None: no frames
    before = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])
    torch.empty(1 << 20, device="cuda")  # after the window: not recorded
    assert sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"]) <= before


def test_fsdp_memory_tracker_on_a_gpu(tmp_path):
    """FSDP2 over one GPU (a single-rank NCCL group): the module table comes from FSDPMemTracker."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny_vit()
        mesh = init_device_mesh("cuda", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        summary = profile(tmp_path, model)
    finally:
        dist.destroy_process_group()
    header = (tmp_path / "rank0" / "module_table.txt").read_text().splitlines()[0]
    assert "All Gather" in header and "Sharded Param" in header
    assert summary["parameter_bytes"] == sum(p.to_local().numel() for p in model.parameters()) * 4
# ---------------------------------------------------------------- end: memory profiling window (issue #13)
