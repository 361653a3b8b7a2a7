"""Autocast dtypes of ``--amp_mode`` and the bf16 residual stream of ``bf16_pure``."""

from __future__ import annotations

import torch
from torch import nn

# autocast dtype, also FSDP's parameter dtype; fp8 runs bf16 wherever its float8 linears do not; bf16_pure is bf16
# autocast with a bf16 residual stream (apply_bf16_residual)
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "bf16_pure": torch.bfloat16, "fp16": torch.float16,
              "fp8": torch.bfloat16}


def apply_bf16_residual(model: nn.Module) -> None:
    """``--amp_mode bf16_pure``: carry the residual stream between the blocks in bf16 (in place).

    Under bf16 autocast a block's output ``x + attn(norm1(x))`` keeps the dtype of ``x``, and ``x`` starts fp32
    (the patch embedding's bf16 output plus the fp32 position embedding), so every residual add, LayerNorm input
    and saved activation of the stream is fp32. Casting the first block's input to bf16 makes the whole stream
    bf16: half the bytes of those bandwidth-bound passes, forward and backward. The parameters stay fp32 master
    weights (Adam and checkpoints see only them), cast to bf16 by autocast for the GEMMs; LayerNorm computes its
    statistics in fp32 (on CUDA autocast runs it in fp32), the attention kernels keep the softmax in fp32 and
    the loss is fp32 (``relative_l2_loss``). This is what FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16)`` gives under ``--fsdp`` (bf16 parameters, block inputs cast to
    bf16), so one GPU, DDP and FSDP run the same arithmetic; there the cast finds bf16 already.
    """
    model.blocks[0].register_forward_pre_hook(_bf16_inputs)


def _bf16_inputs(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
