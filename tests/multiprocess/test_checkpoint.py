"""Sharded checkpoints (``distributed.checkpoint.sharded.ShardedCheckpoints``) and ``tools.export_model``.

A small ViT with Adam, LambdaLR, a disabled GradScaler and a toy stateful with per-rank state takes a
few steps, is saved, takes more, and is loaded into fresh objects, which must hold bitwise the saved
state: one process, DDP, FSDP2, and FSDP checkpoints loaded on other world sizes. Also retention,
skipping broken checkpoints, interrupted and async saves, a full disk, and the export tool
(tensor-parallel checkpoints: ``tests/multiprocess/test_tp_checkpoint.py``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import unittest
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from networks.model_file import config_sections
from distributed.checkpoint.folder import LATEST, step_folder
from distributed.checkpoint.sharded import ShardedCheckpoints
from distributed.checkpoint.storage import CheckedWriter
from distributed.launch import LaunchEnv
from distributed.world import World
from networks.vit import VisionTransformer, build_model
from tests.dist_utils import run_distributed, subprocess_env
from utils.config.loading import load_config, to_yaml
from utils.core.errors import UserError
from utils.config.schema import CheckpointConfig

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(img_size=(8, 16), patch_size=4, in_chans=2, out_chans=2, embed_dim=16, depth=2, num_heads=2)
# the same model as a config (for config.yaml and the export tool)
SMALL_CONFIG = {"img_size": [8, 16], "patch_size": 4, "n_in_channels": 2, "n_out_channels": 2, "embed_dim": 16,
                "depth": 2, "num_heads": 2}
LOGGER = "distributed.checkpoint.sharded"


class Toy:
    """A stateful like the trainer's TrainState: a counter equal on every rank, a random stream per rank."""

    def __init__(self, rank: int):
        self.count, self.rank_name = 0, f"rank {rank}"
        self.gen = torch.Generator().manual_seed(100 + rank)

    def advance(self) -> None:
        self.count += 1
        torch.rand(3, generator=self.gen)

    def state_dict(self) -> dict:
        return {"count": self.count, "history": [0.5 * i for i in range(self.count)]}

    def load_state_dict(self, state: dict) -> None:
        assert state["history"] == [0.5 * i for i in range(state["count"])]
        self.count = state["count"]

    def per_rank_state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "name": self.rank_name}

    def load_per_rank_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.rank_name = state["name"]


@dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    toy: Toy
    manager: ShardedCheckpoints


def make_world(rank: int = 0, world_size: int = 1) -> World:
    return World(LaunchEnv(rank=rank, world_size=world_size), torch.device("cpu"))


def make_run(directory, world: World, parallel: str = "none", seed: int = 0, **cfg) -> Run:
    """A model (plain, ``ddp`` or ``fsdp`` over all ranks) with its optimizer, scheduler, toy and manager."""
    torch.manual_seed(seed)
    model = VisionTransformer(**SMALL)
    if parallel == "ddp":
        model = DDP(model)
    elif parallel == "fsdp":
        mesh = init_device_mesh("cpu", (world.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    toy = Toy(world.rank)
    stateful = {"scheduler": scheduler, "scaler": torch.amp.GradScaler("cpu", enabled=False), "toy": toy}
    manager = ShardedCheckpoints(CheckpointConfig(**cfg), Path(directory), model, optimizer, stateful, world)
    return Run(model, optimizer, scheduler, toy, manager)


def train(run: Run, steps: int) -> None:
    for _ in range(steps):
        gen = torch.Generator().manual_seed(1000 * run.toy.count + int(run.toy.rank_name[-1]))
        loss = run.model(torch.randn(2, 2, 8, 16, generator=gen)).square().mean()
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        run.scheduler.step()
        run.toy.advance()


def snapshot(run: Run) -> dict:
    """Everything a checkpoint restores, full (unsharded) tensors, copied."""
    model_sd, optim_sd = get_state_dict(run.model, run.optimizer, options=StateDictOptions(full_state_dict=True))
    state = {"model": model_sd, "optim": optim_sd, "scheduler": run.scheduler.state_dict(),
             "toy": run.toy.state_dict(), "toy_rank": run.toy.per_rank_state_dict()}
    return _clone(state)


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def assert_same(got, want, where: str = "") -> None:
    """Bitwise equal tensors, equal everything else, recursively."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), (where, set(got) ^ set(want))
        for key in want:
            assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, (where, got, want)


def round_trip(rank: int, world_size: int, directory: str, parallel: str, async_checkpoint: bool = False) -> dict:
    """Train 3 steps, save, train 2 more; a fresh run loads step 3 bitwise. Returns step 3's snapshot."""
    world = make_world(rank, world_size)
    run = make_run(directory, world, parallel, async_checkpoint=async_checkpoint)
    train(run, 3)
    run.manager.save(3)
    want = snapshot(run)
    train(run, 2)  # the parameters change while an async save may still be writing
    run.manager.close()
    assert run.manager.latest() == step_folder(Path(directory), 3)
    fresh = make_run(directory, world, parallel, seed=1)
    assert fresh.manager.load() == 3
    assert_same(snapshot(fresh), want)
    return want


def checkpoint_files(folder: Path) -> list[str]:
    """A checkpoint's file names, each rank's ``__<rank>_<k>.distcp`` (one per writer thread that had
    data) counted once as ``__<rank>.distcp``."""
    return sorted({re.sub(r"^(__\d+)_\d+\.distcp$", r"\1.distcp", p.name) for p in folder.iterdir()})


def test_one_process_round_trip(tmp_path):
    round_trip(0, 1, str(tmp_path), "none")
    folder = tmp_path / "step_00000003"
    assert (tmp_path / LATEST).read_text().strip() == folder.name
    assert checkpoint_files(folder) == [".metadata", "__0.distcp", "checksums.json", "rank0.pt"]


def ddp_round_trip_then_broken_rank_file(rank: int, world_size: int, directory: str) -> None:
    """run_distributed target: the DDP round trip; then a newer checkpoint whose rank1.pt is corrupt
    loads on rank 0 only, so both ranks must agree to fall back to step 3."""
    want = round_trip(rank, world_size, directory, "ddp")
    run = make_run(directory, make_world(rank, world_size), "ddp", seed=2)
    run.manager.load()
    train(run, 1)
    run.manager.save(4)
    if rank == 0:
        (Path(directory) / "step_00000004" / "rank1.pt").write_bytes(b"corrupt")
    torch.distributed.barrier()
    fresh = make_run(directory, make_world(rank, world_size), "ddp", seed=1)
    with unittest.TestCase().assertLogs(LOGGER, "WARNING") as logs:
        assert fresh.manager.load() == 3
    assert "step_00000004 does not load (" in logs.output[0]
    assert_same(snapshot(fresh), want)


def test_ddp_round_trip_and_ranks_agree_on_fallback(tmp_path):
    run_distributed(ddp_round_trip_then_broken_rank_file, 2, str(tmp_path))


def fsdp_save(rank: int, world_size: int, directory: str) -> None:
    """run_distributed target: FSDP round trips, sync then async; each rank keeps its snapshot."""
    round_trip(rank, world_size, str(Path(directory) / "sync"), "fsdp")
    want = round_trip(rank, world_size, directory, "fsdp", async_checkpoint=True)
    torch.save(want, Path(directory) / f"want{rank}.pt")


def fsdp_load(rank: int, world_size: int, directory: str) -> None:
    """run_distributed target: load the 2-rank FSDP checkpoint on ``world_size`` ranks."""
    world = make_world(rank, world_size)
    fresh = make_run(directory, world, "fsdp", seed=1)
    saved = torch.load(Path(directory) / f"want{min(rank, 1)}.pt", weights_only=False)
    if rank < 2:
        assert fresh.manager.load() == 3
    else:
        saved["toy_rank"] = fresh.toy.per_rank_state_dict()  # no rank2.pt: this rank's part starts afresh
        with unittest.TestCase().assertLogs(LOGGER, "WARNING") as logs:
            assert fresh.manager.load() == 3
        assert f"has no rank{rank}.pt" in logs.output[0]
    assert_same(snapshot(fresh), saved)


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fsdp")
    run_distributed(fsdp_save, 2, str(directory))
    return directory


def test_fsdp_round_trip_sync_and_async(fsdp_checkpoint):
    assert (fsdp_checkpoint / "sync" / LATEST).read_text().strip() == "step_00000003"
    assert checkpoint_files(fsdp_checkpoint / "step_00000003") == [
        ".metadata", "__0.distcp", "__1.distcp", "checksums.json", "rank0.pt", "rank1.pt"]


def test_fsdp_checkpoint_loads_on_one_process(fsdp_checkpoint):
    fresh = make_run(fsdp_checkpoint, make_world(), seed=1)
    assert fresh.manager.load() == 3
    assert_same(snapshot(fresh), torch.load(fsdp_checkpoint / "want0.pt", weights_only=False))


def test_fsdp_checkpoint_loads_on_four_ranks(fsdp_checkpoint):
    run_distributed(fsdp_load, 4, str(fsdp_checkpoint))


def test_keep_checkpoints_deletes_older(tmp_path):
    run = make_run(tmp_path, make_world(), keep_checkpoints=2)
    for step in range(1, 5):
        train(run, 1)
        run.manager.save(step)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]
    assert run.manager.latest() == tmp_path / "step_00000004"


def saved_then_trained(tmp_path: Path):
    """A run checkpointed after one step and trained one more; returns it and its state at the checkpoint."""
    run = make_run(tmp_path, make_world())
    train(run, 1)
    run.manager.save(1)
    want = snapshot(run)
    train(run, 1)
    return run, want


def test_truncated_newest_checkpoint_is_skipped_with_warning(tmp_path, caplog):
    run, want = saved_then_trained(tmp_path)
    run.manager.save(2)
    shard = max((tmp_path / "step_00000002").glob("__0_*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    fresh = make_run(tmp_path, make_world(), seed=1)
    assert fresh.manager.load() == 1
    assert_same(snapshot(fresh), want)
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]
    assert len(warnings) == 1 and "step_00000002 does not load" in warnings[0], warnings


def test_every_checkpoint_broken_is_one_line_error(tmp_path):
    run = make_run(tmp_path, make_world())
    run.manager.save(1)
    (tmp_path / "step_00000001" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(UserError, match="no checkpoint in .* loads .newest step_00000001: ") as err:
        make_run(tmp_path, make_world(), seed=1).manager.load()
    assert "\n" not in str(err.value)
    shutil.rmtree(tmp_path / "step_00000001")  # deleted by hand: not a fresh start either
    with pytest.raises(UserError, match="latest names step_00000001, but neither it nor an older"):
        make_run(tmp_path, make_world(), seed=1).manager.load()


def test_interrupted_save_leaves_latest_and_is_cleaned(tmp_path, monkeypatch):
    run, want = saved_then_trained(tmp_path)

    def crash(*args, **kwargs):  # the shards are written, .metadata never is
        raise RuntimeError("simulated crash")
    with monkeypatch.context() as patch:
        patch.setattr(dcp.FileSystemWriter, "finish", crash)
        with pytest.raises(CheckpointException):
            run.manager.save(2)
    interrupted = tmp_path / "step_00000002"
    assert any(interrupted.glob("*.distcp")) and not (interrupted / ".metadata").exists()
    assert (tmp_path / LATEST).read_text().strip() == "step_00000001"
    (interrupted / "__7_0.distcp").write_bytes(b"left by a run on more ranks")
    fresh = make_run(tmp_path, make_world(), seed=1)
    assert fresh.manager.load() == 1
    assert_same(snapshot(fresh), want)
    train(fresh, 1)
    fresh.manager.save(2)  # the same step again: the leftover folder is replaced, not mixed in
    assert checkpoint_files(interrupted) == [".metadata", "__0.distcp", "checksums.json", "rank0.pt"]
    assert (tmp_path / LATEST).read_text().strip() == "step_00000002"
    (tmp_path / "step_00000007").mkdir()  # an interrupted save of a timeline this run abandoned
    train(fresh, 1)
    fresh.manager.save(3)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]


def test_async_save_commits_on_wait(tmp_path):
    run = make_run(tmp_path, make_world(), async_checkpoint=True)
    train(run, 2)
    run.manager.save(2)
    want = snapshot(run)
    train(run, 1)  # staging is done: changing the parameters does not change the checkpoint
    assert run.manager.latest() is None  # written in the background, committed by wait()
    run.manager.wait()
    assert run.manager.latest() == tmp_path / "step_00000002"
    run.manager.close()
    fresh = make_run(tmp_path, make_world(), seed=1)
    assert fresh.manager.load() == 2
    assert_same(snapshot(fresh), want)


def test_explicit_path_loads_that_checkpoint_or_is_one_line_error(tmp_path):
    run = make_run(tmp_path, make_world(), keep_checkpoints=3)
    for step in (1, 2):
        train(run, 1)
        run.manager.save(step)
        if step == 1:
            want = snapshot(run)
    fresh = make_run(tmp_path / "other", make_world(), seed=1)
    assert fresh.manager.load(tmp_path / "step_00000001") == 1
    assert_same(snapshot(fresh), want)
    assert fresh.manager.load(tmp_path) == 2  # a directory: its latest
    (tmp_path / "step_00000005").mkdir()
    for bad in (tmp_path / "step_00000005", tmp_path / "missing"):
        with pytest.raises(UserError, match="is not a complete checkpoint") as err:
            fresh.manager.load(bad)
        assert "\n" not in str(err.value)
    assert make_run(tmp_path / "empty", make_world()).manager.load() is None


def test_full_disk_is_one_line_error_and_keeps_latest(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = make_run(disk, make_world())
        run.manager.save(1)
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (shutil.disk_usage(disk).free - 16 * 1024))  # less room than a checkpoint needs
        with pytest.raises(UserError) as err:
            run.manager.save(2)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"writing checkpoint {disk / 'step_00000002'} failed: ")
        assert "No space left on device" in message and "GiB free there" in message, message
        assert run.manager.latest() == disk / "step_00000001"
        assert not (disk / "step_00000002").exists() and not list(disk.glob("*.tmp"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def _export(*args, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tools.export_model", *map(str, args)], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())


def test_export_tool(tmp_path):
    run_dir = tmp_path / "runs" / "tiny" / "1CPU" / "00"
    run_dir.mkdir(parents=True)
    cfg = load_config("config/ViT.yaml", "tiny", SMALL_CONFIG)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    run = make_run(run_dir / "checkpoints", make_world())
    train(run, 2)
    run.manager.save(2)
    want2 = snapshot(run)["model"]
    train(run, 1)
    run.manager.save(3)
    want3 = snapshot(run)["model"]
    (run_dir / "checkpoints" / "step_00000009").mkdir()  # an interrupted save: never exported

    procs = {"latest": _export(run_dir, cwd=tmp_path),
             "step 2": _export(run_dir, "--step", 2, "--out", tmp_path / "two.pt", cwd=tmp_path),
             "missing run": _export(tmp_path / "nope", cwd=tmp_path),
             "missing step": _export(run_dir, "--step", 9, cwd=tmp_path),
             "bad flag": _export(run_dir, "--step", "x", cwd=tmp_path)}
    out = {name: (*p.communicate(timeout=120), p.returncode) for name, p in procs.items()}
    for name, step, want, path in (("latest", 3, want3, run_dir / "checkpoints" / "model_step_3.pt"),
                                   ("step 2", 2, want2, tmp_path / "two.pt")):
        assert out[name][2] == 0 and f"(model at step {step})" in out[name][0], out[name]
        saved = torch.load(path)  # weights_only: plain tensors and Python values
        assert saved["step"] == step and saved["config"] == config_sections(cfg)
        model = build_model(cfg.model, cfg.data)
        model.load_state_dict(saved["model"])
        assert_same(model.state_dict(), want)
    for name, needle in (("missing run", "run directory"), ("missing step", "complete steps: 2, 3"),
                         ("bad flag", "--step: invalid int value")):
        _, stderr, status = out[name]
        assert status == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, (name, stderr)
        assert needle in stderr and "Traceback" not in stderr, (name, stderr)


def test_a_failing_writer_thread_fails_the_save(tmp_path, monkeypatch):
    import errno
    import threading

    from torch.distributed.checkpoint import filesystem
    write_item = filesystem._write_item

    def full_disk_off_the_main_thread(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_item(*args, **kwargs)
    monkeypatch.setattr(filesystem, "_write_item", full_disk_off_the_main_thread)
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(16)}
    with pytest.raises(CheckpointException, match="No space left on device"):
        dcp.save(state, storage_writer=CheckedWriter(tmp_path, thread_count=4), no_dist=True)
    assert not (tmp_path / ".metadata").exists()  # plain FileSystemWriter would commit the missing items
