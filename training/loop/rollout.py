"""Rollout training: the K-step loss and the curriculum that sets K.

From one initial state the model is applied K times, each application fed the previous forecast, and the loss is
the weighted mean over the steps of the one-step loss (FourCastNet's and makani's multistep fine-tuning,
GraphCast's 1 -> 12 step curriculum, anemoi's rollout schedule). Gradients flow through all K applications.
K is a pure function of the optimizer step and the epoch (:func:`rollout_steps_at`), so a resume continues the
curriculum exactly, across a raise.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from utils.config.schema import OptimConfig
from utils.data.forcing_source import append_forcings


def max_rollout_steps(optim: OptimConfig) -> int:
    """The largest K of the run: ``rollout_max_steps`` with a curriculum, else ``train_rollout_steps``. Training
    samples carry this many targets for the whole run, so the set of initial times (and the data order) does not
    change when the curriculum raises K."""
    return max(optim.train_rollout_steps, optim.rollout_max_steps)


def rollout_steps_at(optim: OptimConfig, step: int, epoch: int) -> int:
    """K for optimizer step ``step`` (0-based) of epoch ``epoch`` (0-based): ``train_rollout_steps``, raised by one
    every ``rollout_raise_every`` iterations or epochs up to ``rollout_max_steps`` (no curriculum when that is 0)."""
    if not optim.rollout_max_steps:
        return optim.train_rollout_steps
    done = step if optim.rollout_raise_unit == "iterations" else epoch
    return min(optim.rollout_max_steps, optim.train_rollout_steps + done // optim.rollout_raise_every)


def step_weights(optim: OptimConfig) -> tuple[float, ...]:
    """The loss weight of each rollout step up to :func:`max_rollout_steps` (``rollout_step_weights``, or 1 each)."""
    return tuple(optim.rollout_step_weights) or (1.0,) * max_rollout_steps(optim)


def rollout_loss(model: Callable[[torch.Tensor], torch.Tensor],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], inp: torch.Tensor, tar: torch.Tensor,
                 weights: tuple[float, ...], recompute: bool = False,
                 forcing: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """The K-step loss ``sum_j w_j L(f^j(x), y_j) / sum_j w_j``, ``K = len(weights)``, ``f^j`` the model applied j
    times; with one step exactly ``L(f(x), y_1)``.

    Args:
        model: the model, ``(B, C + F + S, H, W) -> (B, C, H, W)``.
        loss_fn: the one-step loss (``relative_l2_loss``: latitude and channel weights inside), a 0-d tensor.
        inp: the initial states, ``(B, C, H, W)`` normalized.
        tar: the targets, ``(B, k, C, H, W)`` with ``k >= K``; ``tar[:, j - 1]`` is ``j*dt`` after ``inp``.
        weights: one non-negative weight per step (not all 0).
        recompute: activation checkpointing per step: every application but the last runs under
            ``torch.utils.checkpoint`` (non-reentrant) and is recomputed in backward, so only its input is kept.
            The last is not: its backward follows at once, so recomputing it would only cost time.
        forcing: ``j -> (B, F + S, H, W)``, the input-only channels of application ``j`` (0-based; for the valid
            time of ``tar[:, j]``, ``utils/data/forcing_source.py``), appended to its input; None: none.

    Returns:
        The loss, a 0-d tensor (float32 from ``relative_l2_loss``).
    """
    if len(weights) == 1:
        return loss_fn(model(append_forcings(inp, forcing and forcing(0))), tar[:, 0])
    return _SCOPE(_k_step_loss, model, loss_fn, inp, tar, weights, recompute, forcing)


def _k_step_loss(model, loss_fn, inp, tar, weights, recompute, forcing) -> torch.Tensor:
    total, x = None, inp
    for j, w in enumerate(weights):
        last = j == len(weights) - 1
        x = append_forcings(x, forcing and forcing(j))
        x = checkpoint(model, x, use_reentrant=False) if recompute and not last else model(x)
        term = w * loss_fn(x, tar[:, j])
        total = term if total is None else total + term
    return total / sum(weights)


class RolloutScope(nn.Module):
    """A parameterless module that calls ``fn``: the K applications of the model run inside one module call, so
    PyTorch's memory trackers (``MemTracker``, ``FSDPMemTracker``: the planner, the memory profile) see a model
    called K times by its parent, which they track, instead of a root called again, which they take for the next
    iteration and refuse."""

    def forward(self, fn, *args):
        return fn(*args)


_SCOPE = RolloutScope()
