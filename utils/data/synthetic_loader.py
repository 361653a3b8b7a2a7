"""Random normalized batches made on the device: the compute ceiling, no I/O."""

from __future__ import annotations

import torch

from utils.data.dataset import check_start_batch


class SyntheticBatches:
    """Random normalized batches made on the device: the compute ceiling, no I/O.

    Yields ``n_batches`` times the same standard-normal float32 ``inp`` ``(B, C, H, W)`` and
    ``tar`` ``(B, k, C, H, W)`` (``k = target_steps``; made once and reused, so generation costs
    nothing per step) and dummy int64 indices ``(B,)``; ``n_batches - start_batch`` batches after
    ``set_epoch(epoch, start_batch)``.

    Raises:
        ValueError: ``target_steps`` below 1.
    """

    def __init__(self, n_batches: int, batch_size: int, n_channels: int, img_size, device, seed: int = 0, *,
                 target_steps: int = 1):
        if target_steps < 1:
            raise ValueError(f"target_steps must be >= 1, got {target_steps}")
        gen = torch.Generator(device=device).manual_seed(seed)
        self.inp = torch.randn((batch_size, n_channels, *img_size), generator=gen, device=device)
        self.tar = torch.randn((batch_size, target_steps, n_channels, *img_size), generator=gen, device=device)
        self.idx = torch.arange(batch_size)
        self.n_batches = n_batches
        self.start = 0  # first batch of the next iteration

    def __len__(self) -> int:
        return self.n_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next iteration (only) starts at batch ``start_batch`` (the batches do not depend on the epoch).

        Raises:
            ValueError: ``start_batch`` is not in ``[0, len(self)]``.
        """
        check_start_batch(start_batch, self.n_batches)
        self.start = start_batch

    def __iter__(self):
        start, self.start = self.start, 0
        return ((self.inp, self.tar, self.idx) for _ in range(start, self.n_batches))

    def close(self) -> None:
        """Free the device tensors; the object cannot iterate again."""
        self.inp = self.tar = None
