"""Ensemble training on one process: the members' noise, their inputs, the CRPS loss through the K-step rollout, and
the config checks."""

from __future__ import annotations

import pytest
import torch

from training.evaluation.ensemble_metrics import almost_fair_crps
from training.loop.ensemble import Members
from training.loop.rollout import rollout_loss
from utils.config.schema import Config, ModelConfig, OptimConfig, ParallelConfig
from utils.config.validate import Launch, validate
from utils.core.errors import UserError
from utils.data.noise import EVALUATION, TRAINING, draw_seed, member_inputs, member_noise, repeat_members

SHAPE = (2, 4, 6)  # Z, H, W


def members(m: int, total: int | None = None, first: int = 0, alpha: float = 0.95) -> Members:
    return Members(range(first, first + m), total or m, SHAPE, 7, None, alpha, torch.linspace(0.5, 1.5, SHAPE[1]))


def test_noise_depends_only_on_its_key():
    a = member_noise((7, TRAINING, 3), [10, 11], range(4), 0, SHAPE)
    assert a.shape == (8, *SHAPE) and a.dtype == torch.float32
    assert torch.equal(a, member_noise((7, TRAINING, 3), [10, 11], range(4), 0, SHAPE))
    # members drawn on two ranks (two halves) are the rows of one draw; so is a sample drawn alone
    halves = [member_noise((7, TRAINING, 3), [10, 11], r, 0, SHAPE).view(2, 2, *SHAPE) for r in (range(2), range(2, 4))]
    assert torch.equal(torch.cat(halves, 1).view(8, *SHAPE), a)
    assert torch.equal(member_noise((7, TRAINING, 3), [11], range(4), 0, SHAPE), a[4:])
    for other in (member_noise((8, TRAINING, 3), [10, 11], range(4), 0, SHAPE),  # seed
                  member_noise((7, EVALUATION, 3), [10, 11], range(4), 0, SHAPE),  # stream
                  member_noise((7, TRAINING, 4), [10, 11], range(4), 0, SHAPE),  # step
                  member_noise((7, TRAINING, 3), [10, 11], range(4), 1, SHAPE)):  # application
        assert not torch.isclose(other, a).any()
    rows = a.flatten(1)
    assert (rows[:, None] != rows[None]).any(-1).sum() == 8 * 7  # every (sample, member) its own draw
    assert abs(a.mean()) < 0.2 and abs(a.std() - 1) < 0.2


def test_negative_keys_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        draw_seed((1, -1))


def test_member_inputs_repeat_the_state_and_forcings_then_append_each_members_noise():
    inp, idx = torch.randn(2, 3, *SHAPE[1:]), torch.tensor([5, 9])
    forcing = torch.randn(2, 2, 1, *SHAPE[1:])  # per application j: (B, F + S, H, W)
    x, extra = members(3).inputs(inp, idx, 4, lambda j: forcing[j])
    assert torch.equal(x, repeat_members(inp, 3)) and torch.equal(x[3:6], inp[1:].expand(3, -1, -1, -1))
    for j in range(2):
        got = extra(j)
        assert got.shape == (6, 1 + SHAPE[0], *SHAPE[1:])
        assert torch.equal(got[:, :1], forcing[j].repeat_interleave(3, 0))
        assert torch.equal(got[:, 1:], member_noise((7, TRAINING, 4), [5, 9], range(3), j, SHAPE))
    assert torch.equal(members(3).inputs(inp, idx, 4, None)[1](1), member_noise((7, TRAINING, 4), [5, 9], range(3), 1,
                                                                                SHAPE))


def test_crps_loss_scores_the_members_of_each_sample_together():
    pred, target = torch.randn(2 * 4, 3, *SHAPE[1:]), torch.randn(2, 3, *SHAPE[1:])
    ens = members(4)
    want = almost_fair_crps(pred.view(2, 4, 3, *SHAPE[1:]), target, ens.weights, 0.95).mean()
    assert torch.equal(ens.loss(pred, target), want)
    same = pred.view(2, 4, 3, *SHAPE[1:])[:, :1].expand(-1, 4, -1, -1, -1).reshape(8, 3, *SHAPE[1:])
    mae = ((same[::4] - target).abs() * ens.weights.view(1, 1, -1, 1)).mean()
    torch.testing.assert_close(ens.loss(same, target), mae)  # identical members: the CRPS is the absolute error


def test_each_member_is_rolled_out_with_its_own_noise_at_every_step():
    """A two-step CRPS rollout equals the loss written out by hand: member i's second application reads its own
    first forecast and its own noise of application 1."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3 + SHAPE[0], 3, 3, padding=1)
    inp, tar, idx = torch.randn(2, 3, *SHAPE[1:]), torch.randn(2, 2, 3, *SHAPE[1:]), torch.tensor([1, 2])
    ens = members(2)
    x, extra = ens.inputs(inp, idx, 0, None)
    got = rollout_loss(model, ens.loss, x, tar, (1.0, 1.0), forcing=extra)
    first = model(torch.cat([x, member_noise((7, TRAINING, 0), [1, 2], range(2), 0, SHAPE)], 1))
    second = model(torch.cat([first, member_noise((7, TRAINING, 0), [1, 2], range(2), 1, SHAPE)], 1))
    want = (ens.loss(first, tar[:, 0]) + ens.loss(second, tar[:, 1])) / 2
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    got.backward()
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())


def config(**sections) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(**sections.get("model", {}))
    cfg.optim = OptimConfig(**sections.get("optim", {}))
    cfg.parallel = ParallelConfig(**sections.get("parallel", {}))
    return cfg


@pytest.mark.parametrize("sections,world,message", [
    ({"optim": {"loss": "crps", "ensemble_members": 1}, "model": {"noise_channels": 2}}, 1,
     "--loss crps scores an ensemble, but --ensemble_members is 1"),
    ({"optim": {"loss": "crps", "ensemble_members": 4}}, 1, "--loss crps with --noise_channels 0"),
    ({"optim": {"ensemble_members": 4}, "model": {"noise_channels": 2}}, 1, "--ensemble_members 4 with --loss l2"),
    ({"optim": {"loss": "crps", "ensemble_members": 3}, "model": {"noise_channels": 2},
      "parallel": {"ensemble_parallel": 2}}, 2, "--ensemble_members 3 is not divisible by --ensemble_parallel 2"),
    ({"optim": {"loss": "crps", "ensemble_members": 4}, "model": {"noise_channels": 2},
      "parallel": {"ensemble_parallel": 2}}, 3, "not divisible by tensor_parallel x context_parallel x "
                                                "ensemble_parallel = 1 x 1 x 2"),
])
def test_bad_ensemble_settings_are_refused_with_the_fix(sections, world, message):
    with pytest.raises(UserError, match=message.replace("+", r"\+")):
        validate(config(**sections), Launch(world_size=world))


def test_a_valid_ensemble_config_passes():
    validate(config(optim={"loss": "crps", "ensemble_members": 4}, model={"noise_channels": 2},
                    parallel={"ensemble_parallel": 2}), Launch(world_size=4))


def test_member_inputs_without_noise_repeat_the_forcings_and_without_either_feed_nothing():
    inp, forcing = torch.randn(2, 3, 4, 5), torch.randn(2, 1, 4, 5, dtype=torch.bfloat16)
    states, extra = member_inputs(inp, 2, lambda j: forcing, None)
    assert torch.equal(states, inp.repeat_interleave(2, 0)) and torch.equal(extra(0), forcing.repeat_interleave(2, 0))
    noise = torch.randn(4, 2, 4, 5)
    both = member_inputs(inp, 2, lambda j: forcing, lambda j: noise)[1](0)
    assert both.dtype == torch.bfloat16 and torch.equal(both[:, 1:], noise.to(torch.bfloat16))
    assert member_inputs(inp, 2, None, None)[1] is None
