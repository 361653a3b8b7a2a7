"""Scoring on the validation split: the component the trainer calls after every ``valid_every``-th epoch.

For the model and for persistence (the input as the forecast), per channel: latitude-weighted RMSE in
physical units and ACC against the climatology (``utils/metrics.py``), plus the training loss. Every
data-parallel rank scores its shard; the sums are all-reduced, so each rank returns the same numbers.
"""

from __future__ import annotations

import math
from typing import Callable, ContextManager

import torch
from torch import nn

from distributed.env import World, all_reduce
from utils.data_loader import Data
from utils.errors import NonFiniteError, UserError
from utils.metrics import latitude_weights, relative_l2_loss, weighted_acc_channels, weighted_rmse_channels
from utils.profiling import nvtx_range
from utils.schema import EvaluationConfig

PREFIXES = ("rmse", "acc", "rmse_persistence", "acc_persistence")


class Evaluator:
    """Validation scores of a model (collective over the data-parallel ranks).

    Args:
        cfg: the ``evaluation`` section (``key_channels``, ``plot_channel``).
        data: the run's data; ``data.valid`` yields ``(input, target, sample indices)`` batches
            of normalized ``(B, C, H, W)`` fields on the device.
        world: this rank's place in the job.

    Raises:
        UserError: a configured key or plot channel is not in the data.
    """

    def __init__(self, cfg: EvaluationConfig, data: Data, world: World):
        self.data, self.world = data, world
        self.key_channels, self.plot_channel = pick_channels(cfg, data.channel_names)
        self.lat_weights = latitude_weights(data.latitude, world.device)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, autocast: Callable[[], ContextManager]) -> tuple[dict, object | None]:
        """Score ``model`` on the whole validation split under ``autocast()``.

        Returns ``(record, figure)``: ``loss/valid``, ``valid_samples`` and per channel
        ``rmse/<ch>``, ``acc/<ch>``, ``rmse_persistence/<ch>``, ``acc_persistence/<ch>`` (RMSE in the
        channel's physical units, ACC in [-1, 1]); the figure of the first sample's plot channel
        on rank 0, else None.

        Raises:
            NonFiniteError: the scores are NaN/Inf (naming the validation samples holding NaN/Inf).
        """
        model.eval()
        std, clim = self.data.stats.std.view(1, -1), self.data.stats.clim
        c = std.shape[1]
        w = self.lat_weights
        sums = torch.zeros(4 * c + 2, device=self.world.device)  # 4 scores per channel, loss, samples
        first = None
        finite, seen = [], []  # per sample: are its scores finite (device), and its index (host)
        for inp, tar, idx in self.data.valid:
            with nvtx_range("validation"), autocast():
                pred = model(inp)
            pred = pred.float()
            rmse = weighted_rmse_channels(pred, tar, w) * std
            persistence = weighted_rmse_channels(inp, tar, w) * std
            for offset, score in enumerate((rmse, weighted_acc_channels(pred, tar, clim, w), persistence,
                                            weighted_acc_channels(inp, tar, clim, w))):
                sums[offset * c:(offset + 1) * c] += score.sum(0)
            sums[-2] += relative_l2_loss(pred, tar) * inp.shape[0]
            sums[-1] += inp.shape[0]
            finite.append(torch.isfinite(rmse + persistence).all(1))
            seen.append(idx)
            if first is None:
                first = (pred[0].clone(), tar[0].clone())  # loader buffers are reused
        all_reduce(sums, self.world, "dp")
        values = (sums / sums[-1].clamp_min(1)).tolist()
        if not math.isfinite(sum(values)):
            self._raise_nonfinite(torch.cat(seen), torch.cat(finite).cpu())
        record = {"loss/valid": values[-2], "valid_samples": int(sums[-1].item())}
        for offset, prefix in enumerate(PREFIXES):
            record.update({f"{prefix}/{n}": v for n, v in zip(self.data.channel_names,
                                                               values[offset * c:(offset + 1) * c])})
        figure = self._figure(*first) if self.world.is_main and first is not None else None
        return record, figure

    def _raise_nonfinite(self, indices: torch.Tensor, finite: torch.Tensor) -> None:
        bad = nonfinite_samples(self.data, indices[~finite].tolist(), "valid", self.world)
        if bad:
            raise NonFiniteError(f"NaN/Inf in the validation data: {bad}; fix or exclude that file "
                                 "(re-run the converter, check for missing values)")
        raise NonFiniteError("validation metrics are NaN/Inf with finite data: the model's predictions overflow; "
                             "lower --lr, set --max_grad_norm 1.0, or use --amp_mode bf16 instead of fp16")

    def _figure(self, pred: torch.Tensor, tar: torch.Tensor):
        """Prediction, target and difference maps of the plot channel, in physical units."""
        from utils.plots import prediction_figure  # matplotlib (0.5 s) loads only on the rank that draws
        names = self.data.channel_names
        ch = names.index(self.plot_channel)
        mean, std = self.data.stats.mean[0, ch], self.data.stats.std[0, ch]
        to_np = lambda x: (x[ch] * std + mean).float().cpu().numpy()  # noqa: E731
        return prediction_figure(to_np(pred), to_np(tar), names[ch])


def nonfinite_samples(data: Data, indices: list[int], split: str, world: World) -> str:
    """Origins of NaN/Inf samples among this rank's ``indices`` of ``split``, or ``""`` when every
    rank's are finite.

    Collective: every rank scans its own samples and the ranks agree on the verdict.
    """
    local = data.find_nonfinite(indices, split)
    anywhere = all_reduce(torch.tensor(float(len(local)), device=world.device), world,
                          op=torch.distributed.ReduceOp.MAX).item()
    return ("; ".join(local) or "a sample on another rank") if anywhere else ""


def pick_channels(cfg: EvaluationConfig, names: list[str]) -> tuple[list[str], str]:
    """(key channels, plot channel) from the evaluation config, defaulting to the first four / the first.

    Raises:
        UserError: a configured channel is not in the data.
    """
    for name in (*cfg.key_channels, *([cfg.plot_channel] if cfg.plot_channel is not None else [])):
        if name not in names:
            raise UserError(f"channel {name!r} (--key_channels / --plot_channel) is not in the data, whose "
                            f"channels are {', '.join(names)}; pick from those")
    return list(cfg.key_channels) or names[:4], cfg.plot_channel or names[0]
