"""The checkpoint's host copy (distributed/checkpoint/staging.py): independent copies, buffers allocated once
(in the background when prepared) and reused, DTensors staged as DTensors of the same layout (host shards),
and an allocation failure reported at the save that needs it."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tests.dist_utils import run_distributed
from distributed.checkpoint import staging as host_staging
from distributed.checkpoint.staging import HostStager


def state() -> dict:
    return {"model": {"w": torch.randn(4, 3), "b": torch.randn(3)},
            "optim": {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.randn(4, 3)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w", "b"]}]},
            "train_state": {"step": 7}}


def test_stage_copies_every_tensor_and_keeps_other_values():
    src = state()
    staged = HostStager(torch.device("cpu")).stage(src)
    for path in (("model", "w"), ("model", "b")):
        a, b = src[path[0]][path[1]], staged[path[0]][path[1]]
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    moments = staged["optim"]["state"]["w"]
    assert torch.equal(moments["exp_avg"], src["optim"]["state"]["w"]["exp_avg"]) and moments["step"].item() == 2.0
    assert staged["optim"]["param_groups"] == src["optim"]["param_groups"]
    assert staged["train_state"] == {"step": 7}
    src["model"]["w"].add_(1)  # training goes on: the staged copy must not change
    assert not torch.equal(src["model"]["w"], staged["model"]["w"])


def test_buffers_are_allocated_once_and_reused():
    stager = HostStager(torch.device("cpu"))
    src = state()
    stager.prepare(src)  # in the background
    first = stager.stage(src)["model"]["w"]
    src["model"]["w"].mul_(3)
    second = stager.stage(src)["model"]["w"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, src["model"]["w"])
    src["model"]["w"] = torch.randn(5, 3)  # another structure: new buffers of the new shape
    third = stager.stage(src)["model"]["w"]
    assert third.shape == (5, 3) and torch.equal(third, src["model"]["w"])
    stager.close()


def test_tensors_are_packed_into_aligned_chunks(monkeypatch):
    monkeypatch.setattr(host_staging, "CHUNK_BYTES", 256)
    src = {"small": [torch.randn(5) for _ in range(20)], "big": torch.randn(100), "step": torch.tensor(3),
           "empty": torch.zeros(0, 4)}
    stager = HostStager(torch.device("cpu"))
    staged = stager.stage(src)
    leaves = staged["small"] + [staged["big"], staged["step"], staged["empty"]]
    assert all(torch.equal(a, b) for a, b in zip(src["small"] + [src["big"], src["step"], src["empty"]], leaves))
    assert staged["step"].shape == () and staged["step"].dtype == torch.int64
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in leaves if t.numel())
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no two buffers overlap
    assert all(t.data_ptr() % host_staging.ALIGN == 0 for t in leaves)
    # 20 x 20 bytes, 64 apart: 4 per 256-byte chunk; the 400-byte tensor gets its own, step and empty one
    chunks = {t.untyped_storage().data_ptr() for t in leaves}
    assert len(chunks) == 7 and staged["big"].untyped_storage().nbytes() == 400


def test_a_failed_allocation_fails_the_save_and_the_next_one_retries(monkeypatch):
    stager = HostStager(torch.device("cpu"))
    real_empty = torch.empty

    def refuse(*args, **kwargs):
        raise MemoryError("host out of memory")

    monkeypatch.setattr(torch, "empty", refuse)
    src = state()
    with pytest.raises(RuntimeError, match="host buffers failed: host out of memory"):
        stager.stage(src)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert torch.equal(stager.stage(src)["model"]["b"], src["model"]["b"])


def dtensor_shards(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(15.0).reshape(5, 3)  # 5 rows over 2 ranks: 3 + 2, uneven like FSDP2's
    original = distribute_tensor(full, mesh, [Shard(0)])
    staged = HostStager(torch.device("cpu")).stage({"w": original})["w"]
    assert isinstance(staged, DTensor) and staged.shape == full.shape and staged.placements == original.placements
    rows = (0, 3) if rank == 0 else (3, 5)
    assert torch.equal(staged.to_local(), full[rows[0]:rows[1]])
    assert staged.to_local().data_ptr() != original.to_local().data_ptr()
    # DCP writes the staged DTensor where it writes the original: the same local box
    boxes = [compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements) for t in (staged, original)]
    assert boxes[0] == boxes[1] == ((rows[1] - rows[0], 3), (rows[0], 0))
    dist.barrier()


def test_dtensor_shards_are_staged_as_dtensors_of_the_same_layout():
    run_distributed(dtensor_shards, 2)
