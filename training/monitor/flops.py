"""Model FLOPs per sample and MFU (model FLOPs utilization).

Forward FLOPs of the ViT, counting a multiply-add as 2 FLOPs, for N tokens of width D,
L blocks, MLP ratio r, C_in/C_out channels and patch p:

* patch embedding (a p x p stride-p convolution = one matmul per token): ``2 N D C_in p^2``
* per block: QKV ``2 N D (3D)``, attention scores ``Q K^T`` ``2 N^2 D`` and weighted
  values ``A V`` ``2 N^2 D``, output projection ``2 N D^2``, MLP ``2 * 2 N D (rD)``,
  i.e. ``(8 + 4r) N D^2 + 4 N^2 D`` (``24 N D^2 + 4 N^2 D`` for r = 4);
* head: ``2 N D C_out p^2``.

Backward costs twice the forward (gradients with respect to inputs and to weights), so a
training step is 3x forward (Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
sec. 2.1; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters", app.). Activation recomputation is not counted (model FLOPs, not hardware FLOPs).
Norms, softmax and pointwise ops are ignored (< 1 %).
"""

from __future__ import annotations

import torch

# Dense peak FLOP/s per GPU by (name fragment, dtype); tensor-core peaks from NVIDIA data sheets.
PEAK_FLOPS = {
    ("H200", "bf16"): 989e12, ("H100", "bf16"): 989e12, ("A100", "bf16"): 312e12,
    ("H200", "fp32"): 67e12, ("H100", "fp32"): 67e12, ("A100", "fp32"): 19.5e12,
}


def vit_flops_per_sample(model, data) -> float:
    """Training FLOPs for one sample (forward + backward) of the ViT of ``model`` (ModelConfig) on the
    grid and channels of ``data`` (DataConfig)."""
    h, w = data.img_size
    p, d, depth, r = model.patch_size, model.embed_dim, model.depth, model.mlp_ratio
    n = (h // p) * (w // p)
    embed = 2 * n * d * (data.model_in_channels + model.noise_channels) * p * p
    block = (8 + 4 * r) * n * d * d + 4 * n * n * d
    head = 2 * n * d * data.n_out_channels * p * p
    return 3.0 * (embed + depth * block + head)


def peak_flops(device: torch.device, amp_mode: str) -> float | None:
    """Dense peak FLOP/s of ``device`` for the AMP mode, or None when unknown (e.g. CPU).

    fp16 has the bf16 peak. fp8 is measured against the bf16 peak too: attention and the layers outside the
    float8 linears run bf16, so the MFU of fp8 and bf16 runs compare directly (a faster fp8 run scores higher).
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = "fp32" if amp_mode == "none" else "bf16"
    return next((v for (frag, dt), v in PEAK_FLOPS.items() if frag in name and dt == dtype), None)
