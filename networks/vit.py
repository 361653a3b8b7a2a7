"""Vision Transformer that maps the atmospheric state at time t to t + dt.

Plain PyTorch: no distributed code lives here. Parallelism (DDP, FSDP, tensor and
context parallel) is applied from ``distributed/`` by swapping or wrapping the
submodules defined below and by replacing the documented hooks (``Attention.attend``,
``VisionTransformer.embed`` and ``unpatchify``), so their names and layouts are part of the contract:

* ``patch_embed.proj``: ``nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)``
* ``pos_embed``: learned ``(1, num_patches, embed_dim)``
* ``blocks[i].norm1 / attn.qkv / attn.proj / norm2 / mlp.fc1 / mlp.fc2``;
  ``attn.qkv`` is one fused ``Linear(embed_dim, 3 * embed_dim)`` whose output rows are
  ordered ``(3, num_heads, head_dim)`` (q, k, v; head-major within each).
* ``norm`` and ``head``: ``Linear(embed_dim, out_chans * patch_size**2)``, un-patchified
  to ``(B, out_chans, H, W)``.

Architecture after Dosovitskiy et al., "An Image is Worth 16x16 Words" (ICLR 2021),
with pre-norm blocks, as used for weather by the NERSC "Deep Learning at Scale"
tutorial and FourCastNet-style models.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class PatchEmbed(nn.Module):
    """Split a ``(B, C, H, W)`` field into non-overlapping patches and project them.

    Returns tokens of shape ``(B, N, D)`` with ``N = (H / p) * (W / p)`` in row-major
    patch order (latitude rows outer, longitude inner).
    """

    def __init__(self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        h, w = img_size
        if h % patch_size or w % patch_size:
            raise ValueError(
                f"img_size {h}x{w} is not divisible by patch_size {patch_size}; "
                "pick a patch size that divides both, or crop img_size to a multiple of it"
            )
        self.grid = (h // patch_size, w // patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The stride-p p x p convolution is one matmul per patch. Computed as a Linear over
        # (C, p, p)-flattened patches it takes the GEMM path; cuDNN's bf16 convolution for this
        # shape took ~2 ms of a ~100 ms step on an H100 (benchmarks/profile_step.py).
        b, c = x.shape[:2]
        (gh, gw), p = self.grid, self.patch_size
        patches = x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)
        return F.linear(patches, self.proj.weight.reshape(self.proj.out_channels, -1), self.proj.bias)


class Attention(nn.Module):
    """Multi-head self-attention over ``(B, N, D)`` tokens with a fused QKV projection.

    Uses ``F.scaled_dot_product_attention`` (softmax(QK^T / sqrt(d_h)) V, Vaswani et al.
    2017), so the fastest available backend (cuDNN, flash, memory-efficient) is chosen
    by PyTorch or by a ``torch.nn.attention.sdpa_kernel`` context set by the caller.
    """

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim)
        return self.proj(self.attend(qkv).reshape(b, n, -1))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Packed ``(B, N, 3, H, D)`` q, k, v -> ``(B, N, H, D)`` attention outputs.

        An instance attribute of the same name replaces it (``distributed/parallelize.py`` installs a
        kernel that reads the packed layout in place, ``kernels/cudnn_attention.py``).
        """
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


class MLP(nn.Module):
    """Two-layer perceptron ``fc2(GELU(fc1(x)))`` on ``(B, N, D)``; hidden width ``D * mlp_ratio``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``; ``(B, N, D) -> (B, N, D)``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """ViT weather model: ``(B, in_chans, H, W)`` state at t -> ``(B, out_chans, H, W)`` state at t + dt.

    Args:
        img_size: ``(H, W)`` grid size in points; both must be divisible by ``patch_size``.
        patch_size: patch edge in grid points.
        in_chans, out_chans: number of input / output channels (variables x levels).
        embed_dim: token width D; must be divisible by ``num_heads``.
        depth: number of transformer blocks.
        num_heads: attention heads per block.
        mlp_ratio: MLP hidden width as a multiple of D.
        residual: return ``x[:, :out_chans] + network(x)``: the network predicts the change over one step, as
            GraphCast (Lam et al. 2023) and FourCastNet 3 do; the input's first ``out_chans`` channels are the
            prognostic state, the rest input-only (forcings, static fields).

    Inputs and outputs are float tensors (fp32 parameters; run under autocast for bf16/fp16).

    Raises:
        ValueError: when ``img_size`` is not divisible by ``patch_size`` or ``embed_dim``
            by ``num_heads``.
    """

    def __init__(
        self,
        img_size: tuple[int, int] = (360, 720),
        patch_size: int = 8,
        in_chans: int = 20,
        out_chans: int = 20,
        embed_dim: int = 384,
        depth: int = 12,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        residual: bool = False,
    ):
        super().__init__()
        self.img_size = tuple(img_size)
        self.patch_size = patch_size
        self.out_chans = out_chans
        self.residual = residual
        self.patch_embed = PatchEmbed(self.img_size, patch_size, in_chans, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, out_chans * patch_size**2)
        self.init_weights()

    def init_weights(self) -> None:
        """Truncated-normal (std 0.02) linear and position weights, zero biases, unit LayerNorms.

        Also used to materialize a model built on the meta device.
        """
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                # fan-in uniform as nn.Conv2d's default, restated so meta-device init matches
                bound = 1.0 / math.sqrt(m.in_channels * m.kernel_size[0] * m.kernel_size[1])
                nn.init.uniform_(m.weight, -bound, bound)
                nn.init.uniform_(m.bias, -bound, bound)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> tokens with their position embedding ``(B, N, D)``.

        An instance attribute of the same name replaces it (context parallelism installs one that embeds
        only this rank's tokens, ``distributed/tensor_parallel.py``).
        """
        return self.patch_embed(x) + self.pos_embed

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> normalized tokens ``(B, N, D)``."""
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """Head output ``(B, N, C_out * p * p)`` -> ``(B, C_out, H, W)``.

        An instance attribute of the same name replaces it (context parallelism installs one that first
        gathers every rank's tokens).
        """
        b = x.shape[0]
        gh, gw = self.patch_embed.grid
        p = self.patch_size
        x = x.view(b, gh, gw, self.out_chans, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, self.out_chans, gh * p, gw * p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.unpatchify(self.head(self.forward_features(x)))
        # residual: the network predicts the change of the first out_chans (prognostic) input channels; the sum is
        # taken in the wider of the two dtypes, so a bf16 output does not round the fp32 state
        return out + x[:, :self.out_chans] if self.residual else out


def build_model(model, data) -> VisionTransformer:
    """Build the network named by ``model.nettype`` (a ``utils.config.schema.ModelConfig``) for the grid and
    channels of ``data`` (a ``DataConfig``: ``img_size``, ``model_in_channels``: the prognostic channels, forcings
    and static fields, ``n_out_channels``: the prognostic ones).

    Raises:
        KeyError: ``model.nettype`` is not in :data:`MODELS` (the config schema only allows those).
    """
    return MODELS[model.nettype](
        img_size=tuple(data.img_size),
        patch_size=model.patch_size,
        in_chans=data.model_in_channels + model.noise_channels,
        out_chans=data.n_out_channels,
        embed_dim=model.embed_dim,
        depth=model.depth,
        num_heads=model.num_heads,
        mlp_ratio=model.mlp_ratio,
        residual=model.residual,
    )


# ``nettype`` values of the config; the schema's Literal for nettype lists the same names.
MODELS = {"VisionTransformer": VisionTransformer}
