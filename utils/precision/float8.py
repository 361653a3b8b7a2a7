"""Float8 training of the transformer blocks (``--amp_mode fp8``) with torchao.float8.

Every ``nn.Linear`` inside ``model.blocks`` (``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``) becomes a
torchao ``Float8Linear``: its three GEMMs (output, input gradient, weight gradient) take float8 operands,
e4m3 for activations and weights, e5m2 (tensorwise) or e4m3 (rowwise) for gradients, scaled dynamically
per tensor or per row (``--fp8_recipe``; ``rowwise_with_gw_hp`` keeps the weight-gradient GEMM in bf16), and
return bf16. The weights stay fp32 parameters under the same names and shapes, so checkpoints of fp8 and
bf16 runs are interchangeable.

Everything else keeps higher precision, under bf16 autocast as with ``--amp_mode bf16``:

* the patch embedding and the head: the first layer sees the raw fields and the last one writes the
  forecast, where quantization error costs most accuracy; together they are about 4 % of the GEMM FLOPs
  of the base config, so float8 would save little there;
* attention (bf16 SDPA), the LayerNorms, GELU and the residual adds: no weight GEMMs to convert;
* the loss and the optimizer: fp32, whose dynamic range the updates and the loss reduction need.

On the GPU ``torch._scaled_mm`` takes only GEMMs whose inner dim and output width are multiples of 16.
The layer widths are (``utils.config.validate`` checks embed_dim and the MLP width); the weight-gradient GEMM's inner
dim is the micro-batch's token count, so when the tokens per sample are not a multiple of 16 (4050 at
360 x 720, patch 8) torchao's ``pad_inner_dim`` zero-pads the inner dims (a copy of each float8 operand per
GEMM, left out when every micro-batch is aligned).

Under FSDP with the tensorwise recipe and ``--fp8_all_gather`` the weights are all-gathered in float8
(torchao's ``enable_fsdp_float8_all_gather``: each rank casts its shard with a scale from the global amax,
half the bytes of a bf16 gather); :func:`float8_step_hook` then precomputes those scales for all weights in
one all-reduce after each optimizer step. Rowwise scales are per row of the full weight, so rowwise
recipes gather bf16. torchao wraps such weights in a tensor subclass of its own; the model's ``state_dict``
holds the plain fp32 tensors inside instead, so sharded checkpoints load without torchao (a pickled
subclass would not load with ``weights_only``).

torchao is imported inside the functions: it is an optional extra (``pip install -e '.[fp8]'``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from functools import partial
from typing import Callable

import torch
from torch import nn

from utils.precision.fp8_advice import fp8_advice

log = logging.getLogger(__name__)

TOKEN_ALIGNMENT = 16  # torch._scaled_mm: multiples of 16 in the GEMM dims it constrains


def apply_float8(model: nn.Module, precision, fsdp: bool) -> None:
    """Convert every ``nn.Linear`` in ``model.blocks`` to torchao's ``Float8Linear`` (in place).

    Args:
        model: a plain :class:`networks.vit.VisionTransformer` (on any device, the meta device included),
            before activation checkpointing, compile and FSDP are applied.
        precision: the config's ``precision`` section; ``fp8_recipe`` picks the scaling, ``fp8_all_gather`` the float8 all-gather; with
            ``enable_jit`` and the rowwise recipe, Inductor's ``emulate_precision_casts`` is switched on
            (global, for every graph compiled afterwards in this process).
        fsdp: FSDP will shard the model (float8 all-gather applies only then).

    Raises:
        ModuleNotFoundError: torchao is not installed (``utils.config.validate.validate`` checks it first).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    all_gather = float8_all_gather(precision, fsdp)
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(precision.fp8_recipe), enable_fsdp_float8_all_gather=all_gather,
        pad_inner_dim=model.patch_embed.num_patches % TOKEN_ALIGNMENT != 0)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name.startswith("blocks."))
    if all_gather:
        for module in model.blocks.modules():
            if isinstance(module, nn.Linear):
                module.register_state_dict_post_hook(_plain_weight)
    if precision.enable_jit and precision.fp8_recipe == "rowwise":
        # compiled rowwise casts recomputed for backward can differ from the forward's and turn the loss NaN
        # unless Inductor rounds intermediates as eager does (pytorch/pytorch#150859; torchtitan sets the same)
        import torch._inductor.config as inductor_config
        inductor_config.emulate_precision_casts = True


def _plain_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    # an alias of the fp32 tensor inside torchao's wrapper (the wrapper unwraps every op but a few it keeps,
    # alias not among them): saving writes plain tensors, loading into it loads the weight
    key = prefix + "weight"
    state_dict[key] = torch.ops.aten.alias.default(state_dict[key])


def float8_all_gather(precision, fsdp: bool) -> bool:
    """Whether FSDP all-gathers the float8 weights in float8 (tensorwise scaling only)."""
    return (precision.amp_mode == "fp8" and fsdp and precision.fp8_all_gather
            and precision.fp8_recipe == "tensorwise")


def float8_step_hook(model: nn.Module, precision, fsdp: bool) -> Callable[[], None] | None:
    """What to call after each optimizer step, or None when nothing is needed.

    With float8 all-gather (:func:`float8_all_gather`), torchao's ``precompute_float8_dynamic_scale_for_fsdp``:
    the scales of all float8 weights from their updated values in one all-reduce, instead of one per
    weight in the next forward.
    """
    if not float8_all_gather(precision, fsdp):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    return partial(precompute_float8_dynamic_scale_for_fsdp, model)


@functools.lru_cache(maxsize=None)  # once per process: the batch tuner builds a model per trial
def log_fp8_advice(gpu_name: str, width: int) -> None:
    """Log where fp8 pays on this GPU (``utils/precision/fp8_advice.py``): one warning line, with the measured
    fp8/bf16 ratio, when the model's ``width`` is below it; an info line otherwise; nothing for an unmeasured
    GPU."""
    advice = fp8_advice(gpu_name, width)
    if advice is not None:
        slower, line = advice
        (log.warning if slower else log.info)(line)
