"""Ensemble training: every initial state forecast by M members of a stochastic model, scored together by the CRPS.

A stochastic model (``--noise_channels Z``) reads Z noise fields after the state, forcings and static fields; each
member of each sample gets its own draw for each model application (``utils/data/noise.py``, keyed by the run's
seed, the optimizer step, the sample, the member and the application), so the members of a rollout diverge as a
real ensemble does. With ``--loss crps`` the K-step loss of ``training/loop/rollout.py`` scores each step's M
members against the one truth with the almost fair CRPS (Lang et al. 2024, AIFS-CRPS, ``crps_alpha``), latitude
weighted and averaged over the normalized channels, in float32. With ``--ensemble_parallel`` the members are
spread over the ranks of an ensemble group and gathered before the loss (``distributed/ensemble_parallel.py``).

This is the approach of AIFS-CRPS and of FourCastNet 3 (trained in makani with an ensemble CRPS): one model,
sampled by its noise, trained so that its members are sharp and as spread as the truth is uncertain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from distributed.ensemble_parallel import gather_members, local_members
from training.evaluation.ensemble_metrics import almost_fair_crps
from training.evaluation.ensemble_scoring import Ensemble
from utils.config.schema import Config
from utils.data.noise import TRAINING, member_inputs, member_noise


@dataclass
class Members:
    """The members this rank forecasts in training and the loss that scores them.

    ``members``: the global member numbers of this rank (``0 .. M - 1``, or its share under ensemble parallelism);
    ``total``: M; ``noise_shape``: ``(Z, H, W)``; ``seed``: the run's seed; ``group``: the ensemble group (None:
    one rank holds every member); ``alpha``: the afCRPS alpha; ``weights``: ``(H,)`` latitude weights of the
    crop (mean 1); ``score``: :func:`almost_fair_crps` or its compiled twin.
    """

    members: range
    total: int
    noise_shape: tuple[int, int, int]
    seed: int
    group: dist.ProcessGroup | None
    alpha: float
    weights: torch.Tensor
    score: Callable[..., torch.Tensor] = almost_fair_crps

    def inputs(self, inp: torch.Tensor, idx: torch.Tensor, step: int,
               forcing: Callable[[int], torch.Tensor] | None) -> tuple[torch.Tensor, Callable[[int], torch.Tensor]]:
        """The members' initial states and input-only channels for ``rollout_loss``.

        Args:
            inp: ``(B, C, H, W)``, the initial states.
            idx: ``(B,)`` their sample indices (any device).
            step: the optimizer step (the noise key's; a resume draws the same noise again).
            forcing: application ``j`` -> the samples' ``(B, F + S, H, W)`` forcings and static fields, or None.

        Returns:
            ``(B * m, C, H, W)`` states, each repeated for this rank's m members (sample-major), and ``j -> (B * m,
            F + S + Z, H, W)``: the forcings repeated, then each member's noise for application ``j``.
        """
        samples = idx.tolist()

        def noise(j: int) -> torch.Tensor:
            return member_noise((self.seed, TRAINING, step), samples, self.members, j, self.noise_shape, inp.device)

        return member_inputs(inp, len(self.members), forcing, noise)

    def loss(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The afCRPS of the ensemble: ``pred`` ``(B * m, C, H, W)``, this rank's members sample-major, gathered
        over the group to ``(B, M, C, H, W)`` and scored against ``target`` ``(B, C, H, W)``; a float32 0-d tensor,
        the mean over samples and channels (the same on every rank of the group)."""
        m = len(self.members)
        local = pred.reshape(pred.shape[0] // m, m, *pred.shape[1:])
        return self.score(gather_members(local, self.group), target, self.weights, self.alpha).mean()


def validation_members(cfg: Config) -> Ensemble | None:
    """The members validation draws per initial time of a stochastic model (``valid_ensemble_members``, by default
    the training's ``ensemble_members``), with the run's seed; None for a deterministic model."""
    if not cfg.model.noise_channels:
        return None
    count = cfg.evaluation.valid_ensemble_members or cfg.optim.ensemble_members
    return Ensemble(count, cfg.model.noise_channels, cfg.optim.seed)
