"""GPU-only checks (skipped without CUDA): the prefetching loader and the DALI GPU pipeline equal the CPU path;
fp8 training on Hopper (one GPU, and FSDP's float8 all-gather on two); tensor parallelism with and without
sequence parallelism, compiled, on two GPUs; the checkpoint's page-locked host
buffers; the memory profiling window's allocator snapshots (loaded by PyTorch's own tools), CUDA statistics
and FSDP2 memory tracker. The tests' train.py runs (``RUNS``) start together when the session starts
(tests/gpu/background.py)."""

from __future__ import annotations

import json
import math
import logging
import pickle

import pytest
import torch
from ruamel.yaml import YAML
from torch.cuda import _memory_viz

from distributed.launch import LaunchEnv
from distributed.world import World
from distributed.checkpoint.staging import HostStager, register_pinned_memory
from utils.config.loading import load_config
from utils.data.loaders import build_data
from training.monitor.memory_profile import MemoryProfiler
from tests.gpu.background import Run
from utils.config.schema import MemoryConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_TP2_SP = ("--tensor_parallel", "2", "--enable_jit", "true", "--sequence_parallel")
# The tests' train.py runs (tests/gpu/background.py: tiny, 8 steps on 64 samples), all started when the session
# starts and side by side, each waited for by the test that names it.
RUNS = {
    "cudnn-fp32": Run(("--attention_backend", "cudnn", "--amp_mode", "none")),
    "efficient-fp32": Run(("--attention_backend", "efficient", "--amp_mode", "none")),
    "cpu-offload": Run(("--fsdp", "zero3", "--fsdp_cpu_offload", "--amp_mode", "bf16", "--global_batch_size", "8"),
                       gpus=2),
    "sp-true": Run((*_TP2_SP, "true", "--amp_mode", "none"), gpus=2),
    "sp-false": Run((*_TP2_SP, "false", "--amp_mode", "none"), gpus=2),
    # the benchmarks' setting: bf16 with cuDNN attention on the sequence-first q, k, v
    "sp-cudnn": Run((*_TP2_SP, "true", "--amp_mode", "bf16", "--attention_backend", "cudnn"), gpus=2),
    # 128 tokens per sample
    "fp8-aligned": Run(("--amp_mode", "fp8", "--img_size", "[32,64]"), needs=("torchao",), hopper=True),
    # 45 tokens per sample: zero-padded weight-gradient GEMMs
    "fp8-padded": Run(("--amp_mode", "fp8", "--img_size", "[20,36]"), needs=("torchao",), hopper=True),
    "fp8-compiled-rowwise": Run(("--amp_mode", "fp8", "--enable_jit", "true", "--fp8_recipe", "rowwise"),
                                needs=("torchao",), hopper=True),
    "fp8-fsdp": Run(("--amp_mode", "fp8", "--fsdp", "zero3", "--global_batch_size", "8"), gpus=2,
                    needs=("torchao",), hopper=True),
}


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetcher_yields_the_cpu_batches_in_order_across_partial_epochs(tiny_data, workers):
    cfg = load_config("config/ViT.yaml", "tiny", {"data_path": str(tiny_data), "num_data_workers": str(workers)})
    cpu = build_data(cfg.data, 8, 0, 1, torch.device("cpu"))
    gpu = build_data(cfg.data, 8, 0, 1, torch.device("cuda"))
    for epoch, n_train in ((0, 3), (1, None)):  # epoch 0 abandoned after 3 batches, then validation
        for data in (cpu, gpu):
            data.train.set_epoch(epoch)
        pairs = zip(cpu.train, gpu.train)
        for i, ((ci, ct, cidx), (gi, gt, gidx)) in enumerate(pairs):
            if n_train is not None and i == n_train:
                break
            torch.testing.assert_close(gi.cpu(), ci, atol=1e-6, rtol=0)
            torch.testing.assert_close(gt.cpu(), ct, atol=1e-6, rtol=0)
            assert torch.equal(gidx, cidx)
        for (ci, ct, _), (gi, gt, _) in zip(cpu.valid, gpu.valid):
            torch.cuda.synchronize()
            torch.testing.assert_close(gi.cpu(), ci, atol=1e-6, rtol=0)
            torch.testing.assert_close(gt.cpu(), ct, atol=1e-6, rtol=0)


def test_dali_gpu_pipeline_equals_native_cpu_batches(tiny_data):
    """DALI with GPU normalization (device_id set) against the native loader on the CPU, two epochs."""
    pytest.importorskip("nvidia.dali")
    overrides = {"data_path": str(tiny_data), "data_loader_config": "dali", "num_data_workers": "2"}
    cfg = load_config("config/ViT.yaml", "tiny", overrides)
    dali = build_data(cfg.data, 8, 0, 1, torch.device("cuda"))
    native = build_data(load_config("config/ViT.yaml", "tiny", {"data_path": str(tiny_data)}).data,
                        8, 0, 1, torch.device("cpu"))
    try:
        for epoch in (0, 1):
            dali.train.set_epoch(epoch)
            native.train.set_epoch(epoch)
            n = 0
            for (gi, gt, gidx), (ni, nt, nidx) in zip(dali.train, native.train):  # buffers are reused: compare now
                assert gi.is_cuda and gt.is_cuda
                assert torch.equal(torch.as_tensor(gidx).cpu(), torch.as_tensor(nidx))
                torch.testing.assert_close(gi.cpu(), ni, atol=1e-5, rtol=0)
                torch.testing.assert_close(gt.cpu(), nt, atol=1e-5, rtol=0)
                n += 1
            assert n == len(native.train) == len(dali.train) > 0
    finally:
        dali.train.close(), dali.valid.close()


@pytest.mark.runs("cudnn-fp32", "efficient-fp32")
def test_attention_backend_is_checked_in_the_runs_dtype(train_run):
    """cuDNN attention has no fp32 kernel: with --amp_mode none it is a one-line error, not a crash mid-step;
    the probe itself runs in the run's dtype (fp32 here), so a backend that has fp32 kernels trains."""
    from utils.core.errors import UserError
    from training.loop.step import set_attention_backend
    bad = train_run("cudnn-fp32").proc
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --attention_backend cudnn runs only in")
    good = train_run("efficient-fp32").proc
    assert good.returncode == 0, good.stderr
    try:
        with pytest.raises(UserError, match="cannot run head dim 16 in float32"):
            set_attention_backend("flash", torch.device("cuda"), 16, torch.float32)
        set_attention_backend("flash", torch.device("cuda"), 16, torch.bfloat16)
    finally:
        set_attention_backend("auto", torch.device("cuda"), 16, torch.float32)
        for enable in (torch.backends.cuda.enable_cudnn_sdp, torch.backends.cuda.enable_flash_sdp,
                       torch.backends.cuda.enable_mem_efficient_sdp, torch.backends.cuda.enable_math_sdp):
            enable(True)


def test_progress_lines_never_synchronize_the_gpu(tiny_data, tmp_path, monkeypatch):
    """Non-TTY progress lines print the loss already read back for the finiteness check; the steps with
    their progress lines run under CUDA sync-debug mode "error", which raises on any host sync (.item()).
    The lines are read from the reporter's own logger, so records of other loggers (torch's DCP writing the
    final checkpoint, say) neither count nor matter."""
    from distributed.world import init_distributed
    from utils.config.loading import load_config
    from training.monitor import reporter
    from training.loop.trainer import Trainer

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = Lines()
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    cfg = load_config("config/ViT.yaml", "tiny", {"data_path": str(tiny_data), "expdir": str(tmp_path),
                                                  "data_loader_config": "synthetic", "log_every": "1"})
    trainer = Trainer(cfg, init_distributed(cfg.parallel))
    batches = iter(trainer.data.train)
    state = trainer.state
    state.epoch_end = 10
    pending = trainer.train_step(batches)
    state.step = state.epoch_step = 1
    torch.cuda.synchronize()
    level = reporter.log.level
    reporter.log.setLevel(logging.INFO)
    reporter.log.addHandler(lines)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            check = trainer.train_step(batches)
            trainer._check_finite(pending)
            pending = check
            state.step += 1
            state.epoch_step += 1
            trainer.reporter.step_end(state)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        reporter.log.removeHandler(lines)
        reporter.log.setLevel(level)
        trainer.close()
    assert trainer.last_loss()[0] == 3
    assert [line.split(" loss")[0] for line in lines.lines] == [f"epoch 1 step {s}/10" for s in (1, 2, 3)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.runs("cpu-offload")
def test_fsdp_cpu_offload_trains_on_two_gpus(train_run):
    """--fsdp_cpu_offload materializes the shards on the host (FSDP2's CPUOffloadPolicy requires it)."""
    done = train_run("cpu-offload")
    assert done.ok(), done.failure()
    record = done.last_record()
    assert record["loss/train"] == record["loss/train"] and record["memory/peak_allocated"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.runs("sp-true", "sp-false", "sp-cudnn")
def test_tp2_sequence_parallel_compiled_on_two_gpus_trains_like_tp2_without_it(train_run):
    """Sequence parallelism over NCCL under torch.compile (inductor, fp32): the overlapped all-gathers and
    reduce-scatters of distributed/sequence_parallel.py give the losses of plain tensor parallelism (the same
    sums in another order). The three runs go side by side (tests/gpu/background.py)."""
    losses = {}
    for name in ("true", "false", "cudnn"):
        done = train_run(f"sp-{name}")
        assert done.ok(), done.failure()
        losses[name] = done.last_record()["loss/train"]
    assert math.isfinite(losses["true"]) and losses["true"] == pytest.approx(losses["false"], rel=1e-3)
    assert losses["cudnn"] == pytest.approx(losses["true"], rel=5e-2)  # bf16 rounding


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _hopper(), reason="needs a GPU of compute capability 9.0 (Hopper) or newer")
@pytest.mark.parametrize("name", [
    pytest.param("fp8-aligned", marks=pytest.mark.runs("fp8-aligned")),
    pytest.param("fp8-padded", marks=pytest.mark.runs("fp8-padded")),
    pytest.param("fp8-compiled-rowwise", marks=pytest.mark.runs("fp8-compiled-rowwise")),
], ids=["aligned", "padded", "compiled-rowwise"])
def test_fp8_trains_on_hopper(train_run, name):
    pytest.importorskip("torchao")
    done = train_run(name)
    assert done.ok(), done.failure()
    assert math.isfinite(done.last_record()["loss/train"])


@pytest.mark.skipif(not _hopper() or torch.cuda.device_count() < 2, reason="needs 2 Hopper or newer GPUs")
@pytest.mark.runs("fp8-fsdp")
def test_fp8_with_float8_all_gather_trains_on_two_gpus(train_run):
    """FSDP's float8 all-gather over NCCL, with the scales precomputed after each step."""
    pytest.importorskip("torchao")
    done = train_run("fp8-fsdp")
    assert done.ok(), done.failure()
    assert math.isfinite(done.last_record()["loss/train"])


def test_checkpoint_host_buffers_are_page_locked_and_hold_the_state():
    register_pinned_memory()
    stager = HostStager(torch.device("cuda", torch.cuda.current_device()))
    state = {"w": torch.randn(1000, 1000, device="cuda"), "moments": [torch.randn(3, device="cuda"),
                                                                      torch.tensor(2.0, device="cuda")]}
    stager.prepare(state)  # in the background, as the trainer does after its first step
    staged = stager.stage(state)
    assert staged["w"].is_pinned() and staged["moments"][1].is_pinned()
    assert torch.equal(staged["w"], state["w"].cpu()) and torch.equal(staged["moments"][0], state["moments"][0].cpu())
    state["w"].add_(1)
    assert torch.equal(stager.stage(state)["w"], state["w"].cpu())
    stager.close()


def tiny_vit() -> torch.nn.Module:
    from networks.vit import VisionTransformer
    torch.manual_seed(0)
    return VisionTransformer(img_size=(8, 16), patch_size=4, in_chans=2, out_chans=2, embed_dim=16, depth=2,
                             num_heads=2).cuda()


def profile(tmp_path, model, stacks: str = "python", steps: int = 3) -> dict:
    world = World(LaunchEnv(), torch.device("cuda", torch.cuda.current_device()))
    optimizer = torch.optim.Adam(model.parameters())
    cfg = MemoryConfig(memory_profile=True, memory_profile_start_step=1, memory_profile_steps=2,
                       memory_profile_stacks=stacks, memory_profile_depth=3, memory_snapshot_on_oom=False)
    profiler = MemoryProfiler(cfg, tmp_path, world, model, optimizer, 3)
    try:
        for step in range(steps):
            with profiler.step(cfg.memory_profile_epoch, step):
                for _ in range(2):
                    x = torch.randn(3, 2, 8, 16, device="cuda")
                    (model(x) - x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    finally:
        profiler.close(None)
    return json.loads((tmp_path / "rank0" / "summary.json").read_text())


def test_snapshots_load_with_pytorch_tools_and_stats_have_cuda_keys(tmp_path):
    summary = profile(tmp_path, tiny_vit())
    names = summary["files"]["snapshots"]
    assert names == [f"snapshot_e1_s{s}_{w}.pickle" for s in (1, 2) for w in ("start", "end")]
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
    with open(tmp_path / "rank0" / "snapshot_e1_s2_end.pickle", "rb") as f:
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


def test_a_real_oom_gives_the_one_line_error_and_a_snapshot_that_loads(tmp_path):
    from utils.core.errors import OutOfMemory
    from training.monitor.oom import OutOfMemoryHandler

    device = torch.device("cuda", torch.cuda.current_device())
    handler = OutOfMemoryHandler(MemoryConfig(memory_snapshot_on_oom=True), tmp_path, 0, device, 8)
    try:
        with pytest.raises(OutOfMemory) as caught, handler.phase("backward"):
            torch.empty(torch.cuda.get_device_properties(device).total_memory * 2, dtype=torch.uint8, device=device)
    finally:
        handler.close(None)
    message = str(caught.value)
    assert message.startswith(f"rank 0 ran out of {device} memory in backward at local batch 8 trying to allocate")
    assert "GiB free of" in message and "oom_snapshot.pickle" in message and "\n" not in message
    with open(tmp_path / "rank0" / "oom_snapshot.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert any(e["action"] == "oom" for trace in snapshot["device_traces"] for e in trace)
