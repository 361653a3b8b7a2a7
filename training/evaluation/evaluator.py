"""Validation skill during training (:class:`Evaluator`), collective over the data-parallel ranks, and the
checks it shares with ``evaluate.py``: channels that exist, latitudes that can weight scores, and the
origin of NaN/Inf samples."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from distributed.simulate import is_simulated
from distributed.world import World, all_reduce
from training.evaluation.ensemble_scoring import Ensemble
from training.evaluation.metrics import latitude_weights, spectrum_rows
from training.evaluation.scoring import score_rollouts
from utils.config.schema import EvaluationConfig
from utils.core.component import Component
from utils.core.errors import NonFiniteError, UserError
from utils.data.loaders import Data
from utils.data.metadata import read_channel_units
from utils.data.timestep import TimeStep


class Evaluator(Component):
    """Validation skill of a model during training (collective over the data-parallel ranks).

    Args:
        cfg: the ``evaluation`` section (``valid_every``, ``key_channels``, ``plot_channel``, ``figure_every``,
            ``valid_rollout_steps``).
        data: the run's data; ``data.valid`` yields ``(input (B, C, H, W), targets (B, K, C, H, W),
            sample indices)`` normalized batches on the device, ``K >= valid_rollout_steps``.
        world: this rank's place in the job.
        leads: the lead time of each rollout step in hours (``training.evaluation.scoring.lead_hours``; nominal
            hours for monthly and annual data): the scores report them in the data's own time-step unit.
        members: a stochastic model's members drawn per initial time (``training.evaluation.ensemble_scoring``;
            every rank of an ensemble group draws all of them); None for a deterministic model.

    Raises:
        UserError: a configured key or plot channel is not in the data, the data's latitudes
            cannot weight the scores, or the climatology file does not fit the validation data.
    """

    def __init__(self, cfg: EvaluationConfig, data: Data, world: World, leads: list[float],
                 members: Ensemble | None = None):
        self.cfg, self.data, self.world, self.members = cfg, data, world, members
        self.steps = cfg.valid_rollout_steps
        dataset = data.valid_dataset
        step = dataset.time_step if dataset is not None else TimeStep.from_hours(data.step_hours)
        self.leads = [round(h / data.step_hours * float(step.value), 9) for h in leads[:self.steps]]
        self.lead_unit = step.unit
        self.key_channels, self.plot_channel = pick_channels(cfg, data.channel_names)
        self.lat_weights = checked_latitude_weights(data.latitude, world.device)
        self.rows = torch.as_tensor(spectrum_rows(data.latitude), device=world.device)
        names = data.channel_names
        units = read_channel_units(dataset.files[0].path, len(names)) if dataset is not None else [""] * len(names)
        self.units = dict(zip(names, units))
        self.longitude = dataset.files[0].axis.longitude if dataset is not None else None
        # the climatology of each sample's valid time (stats/climatology.h5), else the time mean
        self.climatology = data.stats.sample_climatology(dataset)
        self.climatology_source = data.stats.climatology_source(dataset)
        # persistence, climatology and the truth's spectra depend only on the (fixed) validation split: computed once
        self.baselines: tuple[torch.Tensor, ...] | None = None
        self.model, self.autocast, self.phase, self.run_name = None, None, None, None

    def attach(self, model: nn.Module, autocast: Callable[[], ContextManager],
               phase: Callable[[str], ContextManager], run_name: str | None = None) -> None:
        """The model that validation scores, once it is built (the evaluator itself is made before, so that a bad
        channel stops the run before its directory exists): ``autocast``, its autocast context factory;
        ``phase``, the out-of-memory handler's phase context (validation is named in an OOM line); ``run_name``,
        the run the figures' titles name."""
        self.model, self.autocast, self.phase, self.run_name = model, autocast, phase, run_name

    def epoch_end(self, state, record: dict) -> None:
        """Validate after every ``valid_every``-th epoch and after the last one: the scores, ``valid_time_s``
        (the seconds they took) and the figures (``record["figures"]``: after every ``figure_every``-th epoch
        and the last, unless ``figure_every`` is 0) join the epoch's record."""
        if record["epoch"] % self.cfg.valid_every and not state.done:
            return
        every = self.cfg.figure_every
        draw = every > 0 and (record["epoch"] % every == 0 or state.done)
        start = time.perf_counter()
        with self.phase("validation"):
            scores, figures = self.evaluate(self.model, self.autocast, record.get("iteration"), draw)
        record.update(scores, valid_time_s=time.perf_counter() - start)  # the scores were read back: GPU done
        record["figures"] = figures

    def evaluate(self, model: nn.Module, autocast: Callable[[], ContextManager],
                 step: int | None = None, draw: bool = True) -> tuple[dict, dict]:
        """Score ``model``'s rollouts on the whole validation split under ``autocast()`` (``step``: the optimizer
        step the figures' titles name; ``draw``: whether rank 0 draws the figures).

        Returns ``(record, figures)``. The record holds ``loss/valid`` (first lead), ``valid_samples``,
        per channel the first lead's ``rmse/<ch>``, ``acc/<ch>``, ``bias/<ch>``, ``blurring/<ch>``,
        ``rmse_persistence/<ch>``, ``acc_persistence/<ch>``, ``bias_persistence/<ch>``, ``rmse_climatology/<ch>``;
        with rollouts (``valid_rollout_steps`` > 1) also the key channels' ``rmse_by_lead/<ch>/<lead>``,
        ``acc_by_lead/...``, ``bias_by_lead/...``, ``blurring_by_lead/...`` and the whole table (without
        spectra) as ``scorecard`` (:meth:`Scorecard.to_json`). ``figures`` (rank 0 only, with ``draw``; by
        TensorBoard tag; callables that draw and return a matplotlib Figure): the plot channel's first prediction
        and, with rollouts, RMSE/ACC/bias against lead time and the spectra.

        Raises:
            NonFiniteError: the scores are NaN/Inf (naming the validation samples holding NaN/Inf).
        """
        first: list = []

        def keep_first(inp, forecasts, tar, idx) -> None:
            """The first sample's first forecast and target, for the figure (cloned: loader buffers are reused)."""
            if not first:  # of an ensemble, the first member
                pred = forecasts[0][0] if self.members is None else forecasts[0][0, 0]
                first.append((pred.clone(), tar[0, 0].clone()))

        sums, checks = score_rollouts(model, self.data.valid, self.data.stats, self.lat_weights, self.steps,
                                      autocast, keep_first if draw and self.world.is_main else None,
                                      self.baselines is None,
                                      self.climatology, self.rows, self.data.valid_forcings, self.members)
        sums.reduce(self.world)
        if self.baselines is None:
            self.baselines = (sums.mse[1:].clone(), sums.acc[1:].clone(), sums.bias[1:].clone(),
                              sums.spectra[1].clone())
        sums.mse[1:], sums.acc[1:], sums.bias[1:], sums.spectra[1] = self.baselines
        n = sums.count.clamp_min(1)
        values = [*sums.mse.flatten().tolist(), *sums.acc.flatten().tolist(), (sums.loss / n).item()]
        if not math.isfinite(sum(values)) and not is_simulated(self.world.env):  # a simulated rank's are meaningless
            self._raise_nonfinite(checks)
        card = sums.scorecard(self.data.stats.std, self.leads, self.data.channel_names, self.lead_unit,
                              self.climatology_source)
        record = {"loss/valid": values[-1], "valid_samples": card.initial_times, **card.first_lead_record()}
        if card.ensemble is not None:  # the ensemble mean's RMSE is rmse/<ch>; its CRPS and spread beside it
            record.update({f"{score}/{ch}": card.ensemble[score][ch][0] for score in VALIDATION_ENSEMBLE_SCORES
                           for ch in card.channels})
        if self.steps > 1:
            record.update(card.lead_record(self.key_channels), scorecard=card.to_json(spectra=False))
        figures = self._figure_makers(*first[0], step, card) if self.world.is_main and first else {}
        return record, figures

    def _raise_nonfinite(self, checks: list) -> None:
        indices = torch.cat([idx for idx, _ in checks]) if checks else torch.zeros(0, dtype=torch.int64)
        finite = torch.cat([ok for _, ok in checks]).cpu() if checks else torch.zeros(0, dtype=torch.bool)
        bad = nonfinite_samples(self.data, indices[~finite].tolist(), "valid", self.world)
        if bad:
            raise NonFiniteError(f"NaN/Inf in the validation data: {bad}; fix or exclude that file "
                                 "(re-run the converter, check for missing values)")
        raise NonFiniteError("validation metrics are NaN/Inf with finite data: the model's predictions overflow; "
                             "lower --lr, set --max_grad_norm 1.0, or use --amp_mode bf16 instead of fp16 or fp8"
                             + (f", or score fewer --valid_rollout_steps than {self.steps}" if self.steps > 1 else ""))

    def _figure_makers(self, pred: torch.Tensor, target: torch.Tensor, step: int | None,
                       card) -> dict[str, Callable[[], Any]]:
        """This validation's figures by TensorBoard tag, as callables that draw them (matplotlib loads and draws
        on the thread that calls them: the reporter's drawing thread). Read back here: the plot channel of the
        first prediction and target (``(C, H, W)``, normalized) as ``(H, W)`` maps in physical units, and the
        scorecard."""
        names = self.data.channel_names
        ch = names.index(self.plot_channel)
        mean, std = self.data.stats.mean[0, ch], self.data.stats.std[0, ch]
        pred_map, target_map = ((x[ch] * std + mean).float().cpu().numpy() for x in (pred, target))
        labels = (names[ch], self.units[names[ch]], self.data.latitude, self.longitude, self.run_name, step,
                  card.label(0))
        makers = {f"prediction({self.plot_channel})/valid":
                  lambda: _plots().prediction_figure(pred_map, target_map, *labels)}
        if self.steps > 1:
            table, lines = card.to_json(), (list(self.key_channels), dict(self.units), self.run_name, step)
            makers["skill_by_lead/valid"] = lambda: _plots().skill_figure(table, *lines)
            makers["spectra/valid"] = lambda: _plots().spectra_figure(table, *lines)
        return makers


def _plots():
    """``training.evaluation.plots``, imported by its first caller (matplotlib loads on the drawing thread)."""
    from training.evaluation import plots
    return plots


# a stochastic model's first-lead ensemble scores in the epoch record
VALIDATION_ENSEMBLE_SCORES = ("crps", "spread", "spread_skill")


def checked_latitude_weights(latitude, device: torch.device) -> torch.Tensor:
    """:func:`training.evaluation.metrics.latitude_weights` with a one-line error for latitudes that cannot weight scores.

    Raises:
        UserError: latitudes not strictly monotonic, or fewer than two rows.
    """
    try:
        return latitude_weights(latitude, device)
    except ValueError as exc:
        raise UserError(f"the data's latitude rows cannot weight the scores ({exc}); re-create the files with "
                        "python -m tools.convert_era5") from None


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
