"""FLOPs per sample: the documented formula against a hand count and against PyTorch's FLOP counter."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from networks.vit import build_model
from utils.config.loading import load_config
from training.monitor.flops import vit_flops_per_sample


def test_formula_matches_hand_count_for_tiny():
    p = load_config("config/ViT.yaml", "tiny")  # 32x64, patch 4, C=4, D=64, depth 2, mlp 4
    n, d, c, pp = 8 * 16, 64, 4, 16
    embed = 2 * n * d * c * pp
    per_block = 2 * n * d * 3 * d + 2 * n * n * d + 2 * n * n * d + 2 * n * d * d + 2 * (2 * n * d * 4 * d)
    head = 2 * n * d * c * pp
    assert vit_flops_per_sample(p.model, p.data) == 3 * (embed + 2 * per_block + head)


def test_formula_matches_flop_counter_on_a_training_step():
    p = load_config("config/ViT.yaml", "tiny")
    model = build_model(p.model, p.data)
    x = torch.randn(2, p.data.n_in_channels, *p.data.img_size)
    # the math backend decomposes attention into counted matmuls (the CPU flash kernel is not counted)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).square().mean().backward()
    # the input gradient of the patch projection is not needed, so PyTorch skips 1/3 of its backward
    skipped = 2 * (8 * 16) * 64 * 4 * 16
    assert counter.get_total_flops() == 2 * vit_flops_per_sample(p.model, p.data) - 2 * skipped
