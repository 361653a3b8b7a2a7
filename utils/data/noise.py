"""The noise inputs of a stochastic (ensemble) model: Gaussian fields, one draw per member and model application.

A stochastic model reads ``Z = model.noise_channels`` extra input channels after the state, forcings and static
fields (``networks/vit.py``); each member of an ensemble gets its own draw, so the members differ. Every draw
comes from its own generator, seeded from a key of whole numbers (NumPy's ``SeedSequence`` mixes the key into
the seed): ``(seed, stream, step, sample, member, application)``. The noise of a member therefore depends on
nothing but what it forecasts: a resumed run, a run with another batch split, and a run whose members sit on
other ranks (``--ensemble_parallel``) draw the same noise for the same member.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from utils.data.forcing_source import append_forcings

# the ``stream`` entry of the key: training and validation/evaluation/forecasts never share draws
TRAINING, EVALUATION = 0, 1


def draw_seed(key: Sequence[int]) -> int:
    """A 63-bit generator seed mixed from ``key`` (non-negative integers) by ``numpy.random.SeedSequence``.

    Raises:
        ValueError: an entry of ``key`` is negative.
    """
    if any(k < 0 for k in key):
        raise ValueError(f"noise keys are non-negative integers, got {tuple(key)}")
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0] >> 1)


def member_noise(prefix: Sequence[int], samples: Sequence[int], members: Sequence[int], application: int,
                 shape: tuple[int, int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal noise fields for each (sample, member) pair, sample-major.

    Args:
        prefix: the key's first entries, ``(seed, stream, step)``: the run's seed, :data:`TRAINING` or
            :data:`EVALUATION`, and the optimizer step (0 outside training).
        samples: the global sample (initial time) index of each of the B states.
        members: the global member numbers this call draws (``0 .. M - 1``, or this rank's share of them).
        application: the model application (0-based rollout step) the noise is for.
        shape: ``(Z, H, W)``, noise channels and grid.
        device: where the fields are drawn (a CUDA generator on a GPU: the same key draws other numbers on
            a GPU than on a CPU, but the same on every GPU).

    Returns:
        float32 ``(B * len(members), Z, H, W)``: row ``b * len(members) + i`` is sample ``samples[b]``'s member
        ``members[i]``.
    """
    device = torch.device(device)
    out = torch.empty((len(samples) * len(members), *shape), device=device)
    gen = torch.Generator(device=device)
    row = 0
    for sample in samples:
        for member in members:
            gen.manual_seed(draw_seed((*prefix, int(sample), int(member), application)))
            torch.randn(shape, generator=gen, device=device, out=out[row])
            row += 1
    return out


def repeat_members(x: torch.Tensor | None, m: int) -> torch.Tensor | None:
    """``(B, ...)`` -> ``(B * m, ...)``: each state (or forcing) repeated for its ``m`` members, sample-major as
    :func:`member_noise` orders them; None stays None."""
    return x if x is None or m == 1 else x.repeat_interleave(m, dim=0)


def member_inputs(inp: torch.Tensor, m: int, forcing: Callable[[int], torch.Tensor] | None,
                  noise: Callable[[int], torch.Tensor] | None):
    """What ``m`` members of each state are fed: ``(B * m, C, H, W)`` states (:func:`repeat_members`), and
    application ``j`` -> ``(B * m, F + S + Z, H, W)`` input-only channels: ``forcing(j)`` ``(B, F + S, H, W)``
    repeated for the members, then ``noise(j)`` ``(B * m, Z, H, W)`` (:func:`member_noise`), in the forcings'
    dtype. Either may be None; so is the function when both are."""
    if forcing is None and noise is None:
        return repeat_members(inp, m), None

    def extra(j: int) -> torch.Tensor:
        forced, drawn = repeat_members(forcing and forcing(j), m), noise and noise(j)
        return drawn if forced is None else append_forcings(forced, drawn)

    return repeat_members(inp, m), extra
