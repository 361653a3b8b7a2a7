"""The memory profiling window (training/monitor/memory_profile.py): activation counter against hand counts, the files and
their keys on CPU, the FSDP2 module table on two gloo ranks, and nothing installed outside the window."""

from __future__ import annotations

import contextlib
import json
import re
import logging
from pathlib import Path

import pytest
import torch
from ruamel.yaml import YAML
from torch import nn

from distributed.launch import LaunchEnv
from distributed.world import World, init_distributed
from tests.dist_utils import run_distributed
from tests.train_utils import tiny_params
from training.monitor.activations import ActivationCounter
from training.monitor.memory_profile import MemoryProfiler
from utils.config.schema import MemoryConfig
from training.loop.trainer import Trainer

B, N, D = 3, 8, 16  # batch, tokens ((8 / 4) x (16 / 4) patches), embedding width of the tiny ViT below
F32 = 4


def tiny_vit(ac: str = "none", ac_blocks: int = 0) -> nn.Module:
    from distributed.parallelize import apply_activation_checkpointing
    from networks.vit import VisionTransformer
    torch.manual_seed(0)
    model = VisionTransformer(img_size=(8, 16), patch_size=4, in_chans=2, out_chans=2, embed_dim=D, depth=2,
                              num_heads=2)
    apply_activation_checkpointing(model, ac, 0, ac_blocks)
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int = 1) -> None:
    for _ in range(micro_batches):
        x = torch.randn(B, 2, 8, 16)
        (model(x) - x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def counted(model: nn.Module, x: torch.Tensor, amp: bool = False):
    with ActivationCounter(model).count() as result:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            model(x).float().sum().backward()
    return result


@pytest.mark.parametrize("amp,element", [(False, 4), (True, 2)])
def test_activation_counter_matches_a_hand_count(amp, element):
    """Linear(4, 8) -> ReLU -> Linear(8, 3) on x (5, 4), x not requiring grad. Autograd saves: x for the first
    weight's gradient (under autocast its bf16 copy); ReLU's output, which the second Linear saves again as its
    input (one storage, counted once); the second weight (transposed view; under autocast a bf16 copy): a
    parameter, not counted. The first weight is not saved (x needs no gradient)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    result = counted(model, torch.randn(5, 4), amp)
    assert result.by_block == {"other": 5 * 4 * element + 5 * 8 * element}
    assert result.micro_batches == 1


def test_activation_counter_per_block_falls_with_activation_checkpointing():
    """Per ViT block (B x N tokens of width D, hidden 4D, 2 heads): LayerNorm input, mean, rstd (twice); QKV input;
    attention q/k/v (one storage), output and logsumexp; MLP input, GELU input and output. A fully checkpointed
    block keeps only its input alive, and that is what is counted."""
    x = torch.randn(B, 2, 8, 16)
    tokens = B * N
    layer_norm = tokens * D * F32 + 2 * tokens * F32
    attention = tokens * 3 * D * F32 + tokens * D * F32 + B * 2 * N * F32
    block = 2 * layer_norm + tokens * D * F32 + attention + tokens * D * F32 + 2 * tokens * 4 * D * F32
    none = counted(tiny_vit(), x).by_block
    assert none["blocks.0"] == none["blocks.1"] == block
    selective = counted(tiny_vit("selective", ac_blocks=1), x).by_block
    assert selective["blocks.0"] == tokens * D * F32 and selective["blocks.1"] == block
    full = counted(tiny_vit("full"), x).by_block
    assert full["blocks.0"] == full["blocks.1"] == tokens * D * F32
    assert none["other"] == selective["other"] == full["other"]
    assert sum(none.values()) > sum(selective.values()) > sum(full.values())


def cpu_world() -> World:
    return World(LaunchEnv(), torch.device("cpu"))


def test_nothing_is_installed_outside_the_window(tmp_path):
    model = tiny_vit()
    optimizer = torch.optim.Adam(model.parameters())
    globals_before = dict(nn.modules.module._global_forward_pre_hooks)
    off = MemoryProfiler(MemoryConfig(), tmp_path / "memory", cpu_world(), model, optimizer, B)
    assert all(isinstance(off.step(1, s), contextlib.nullcontext) for s in range(4))
    on = MemoryProfiler(MemoryConfig(memory_profile=True, memory_profile_start_step=1, memory_profile_steps=1),
                        tmp_path / "memory", cpu_world(), model, optimizer, B)
    assert isinstance(on.step(1, 0), contextlib.nullcontext) and isinstance(on.step(2, 1), contextlib.nullcontext)
    assert not (tmp_path / "memory").exists()
    with on.step(1, 1):
        assert model._forward_pre_hooks and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        train_step(model, optimizer)
    assert not model._forward_pre_hooks and not model.blocks[0]._forward_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert nn.modules.module._global_forward_pre_hooks == globals_before
    assert not optimizer._optimizer_step_pre_hooks
    assert isinstance(on.step(1, 2), contextlib.nullcontext)  # the window is over


def read_rank_files(directory) -> tuple[dict, list, str]:
    summary = json.loads((directory / "summary.json").read_text())
    for name in ("memory_stats", "module_table", "module_table_json"):
        assert (directory / summary["files"][name]).is_file()
    stats = YAML(typ="safe").load((directory / "memory_stats.yaml").read_text())
    return summary, stats, (directory / "module_table.txt").read_text()


SUMMARY_KEYS = {"activation_bytes_per_step", "activation_bytes_per_sample", "parameter_bytes", "gradient_bytes",
                "optimizer_state_bytes", "files"}


def test_window_writes_the_promised_files_on_cpu(tmp_path, caplog):
    model = tiny_vit()
    optimizer = torch.optim.Adam(model.parameters())
    cfg = MemoryConfig(memory_profile=True, memory_profile_start_step=1, memory_profile_steps=2,
                       memory_profile_depth=3)
    profiler = MemoryProfiler(cfg, tmp_path / "memory", cpu_world(), model, optimizer, B)
    with caplog.at_level(logging.INFO, logger="training.monitor.memory_profile"):
        for step in range(4):
            with profiler.step(1, step):
                train_step(model, optimizer, micro_batches=2)
        profiler.end_epoch(1)
    profiler.close(None)
    summary, stats, table = read_rank_files(tmp_path / "memory" / "rank0")
    assert SUMMARY_KEYS | {"peak_rss_bytes"} <= summary.keys()
    assert not {"peak_allocated_bytes", "peak_reserved_bytes"} & summary.keys() and summary["files"]["snapshots"] == []
    assert [w["step"] for w in summary["window"]] == [1, 2] and summary["micro_batches_per_step"] == 2
    parameters = sum(p.numel() for p in model.parameters()) * F32
    assert summary["parameter_bytes"] == summary["gradient_bytes"] == parameters
    assert summary["optimizer_state_bytes"] == 2 * parameters + len(list(model.parameters())) * F32  # + Adam's step
    with ActivationCounter(model).count() as one_step:
        train_step(model, optimizer, micro_batches=2)
    assert summary["activation_bytes_per_step"] == one_step.total > 0
    assert summary["activation_bytes_per_sample"] == summary["activation_bytes_per_step"] / (2 * B)
    assert [(r["epoch"], r["step"]) for r in stats] == [(1, 1), (1, 2)]  # epochs counted from 1
    for record in stats:
        start, end, diff = record["start"], record["end"], record["end_minus_start"]
        assert {"host_rss_bytes", "host_vms_bytes"} <= start.keys() == diff.keys()
        assert diff["host_rss_bytes"] == end["host_rss_bytes"] - start["host_rss_bytes"]
    assert "VisionTransformer.blocks.1" in table and "Activation" in table and "Optstate" in table
    assert "blocks.1.attn" not in table  # depth 3: root, its children, the blocks
    assert re.search(r"memory profile \(e1 s1, e1 s2\), [MG]iB per rank", caplog.text)  # MiB below 1 GiB
    assert "memory_viz" not in caplog.text
    assert "nothing profiled" not in caplog.text


def test_epoch_end_closes_a_window_it_cut_short(tmp_path):
    model = tiny_vit()
    optimizer = torch.optim.Adam(model.parameters())
    cfg = MemoryConfig(memory_profile=True, memory_profile_epoch=2, memory_profile_start_step=1,
                       memory_profile_steps=5)
    profiler = MemoryProfiler(cfg, tmp_path, cpu_world(), model, optimizer, B)
    for epoch in range(1, 4):
        for step in range(3):
            with profiler.step(epoch, step):
                train_step(model, optimizer)
        profiler.end_epoch(epoch)
    profiler.close(None)
    summary, stats, _ = read_rank_files(tmp_path / "rank0")
    assert [(w["epoch"], w["step"]) for w in summary["window"]] == [(2, 1), (2, 2)] and len(stats) == 2


def test_an_epoch_without_the_window_steps_says_so(tmp_path, caplog):
    model = tiny_vit()
    optimizer = torch.optim.Adam(model.parameters())
    cfg = MemoryConfig(memory_profile=True, memory_profile_start_step=5)
    profiler = MemoryProfiler(cfg, tmp_path, cpu_world(), model, optimizer, B)
    for step in range(2):
        with profiler.step(1, step):
            train_step(model, optimizer)
    profiler.end_epoch(1)
    assert "epoch 1 ran none of the window's steps 5-6; nothing profiled" in caplog.text
    assert not tmp_path.joinpath("rank0").exists()


def fsdp_window(rank: int, world_size: int, directory: str) -> None:
    """run_distributed target: a tiny ViT sharded with FSDP2 over 2 gloo ranks, one profiled step of 2 micro-batches."""
    from torch.distributed.fsdp import fully_shard

    from distributed.world import build_meshes
    meshes = build_meshes("cpu", world_size, 1, 1, "tp-cp-dp", 0)
    world = World(LaunchEnv(rank=rank, world_size=world_size), torch.device("cpu"), dp=world_size, meshes=meshes)
    model = tiny_vit("full")
    for block in model.blocks:
        fully_shard(block, mesh=meshes["dp"])
    fully_shard(model, mesh=meshes["dp"])
    optimizer = torch.optim.Adam(model.parameters())
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("training.monitor.memory_profile").addHandler(handler)
    logging.getLogger("training.monitor.memory_profile").setLevel(logging.INFO)
    cfg = MemoryConfig(memory_profile=True, memory_profile_start_step=1, memory_profile_steps=1,
                       memory_profile_depth=3)
    profiler = MemoryProfiler(cfg, directory, world, model, optimizer, B)
    for step in range(2):
        with profiler.step(1, step):
            train_step(model, optimizer, micro_batches=2)
    profiler.close(None)
    summary, _, table = read_rank_files(Path(directory) / f"rank{rank}")
    local = sum(p.to_local().numel() for p in model.parameters()) * F32
    full = sum(p.numel() for p in model.parameters()) * F32
    assert summary["parameter_bytes"] == summary["gradient_bytes"] == local < full
    assert summary["activation_bytes_by_block"]["blocks.0"] == 2 * B * N * D * F32  # its input, 2 micro-batches
    header = table.splitlines()[0]
    for category in ("Sharded Param", "Unsharded Param", "Sharded Grad", "Activation", "All Gather", "Reduce Scatter",
                     "OptState"):
        assert category in header
    assert "FSDPVisionTransformer.blocks.0" in table
    rows = json.loads((Path(directory) / f"rank{rank}" / "module_table.json").read_text())
    assert max(r["bytes"]["All Gather"] for r in rows) > 0 and max(r["bytes"]["Reduce Scatter"] for r in rows) > 0
    if rank == 0:
        text = "\n".join(lines)
        assert re.search("[MG]iB per rank", text) and "\n     1 " in text and "FSDPVisionTransformer" in text
    else:
        assert not any(re.search("[MG]iB per rank", line) for line in lines)


def test_fsdp_module_table_and_summary_on_two_gloo_ranks(tmp_path):
    run_distributed(fsdp_window, 2, str(tmp_path))


def test_training_with_memory_profile_writes_the_summary(tiny_data, tmp_path):
    """The acceptance command, in-process: ``train.py --config tiny --memory_profile true`` on CPU."""
    cfg = tiny_params(tiny_data, tmp_path, memory_profile="true", num_iters=6, save_checkpoint="false")
    trainer = Trainer(cfg, init_distributed(cfg.parallel))
    trainer.train()
    trainer.close()
    summary = json.loads((trainer.run_dir / "memory" / "rank0" / "summary.json").read_text())
    assert summary["activation_bytes_per_step"] > 0 and summary["peak_rss_bytes"] > 0
    assert [w["step"] for w in summary["window"]] == [1, 2]
