"""GPU-only checks (skipped without CUDA): the prefetching loader and the DALI GPU pipeline equal the CPU path."""

from __future__ import annotations

import pytest
import torch

from utils.config import load_config
from utils.data_loader import build_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
