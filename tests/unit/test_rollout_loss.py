"""Rollout training's K-step loss, its per-step activation checkpointing and the curriculum's K."""

from __future__ import annotations

import pytest
import torch

from utils.config.schema import Config, OptimConfig
from utils.config.validate import Launch, validate
from utils.core.errors import UserError
from training.evaluation.metrics import relative_l2_loss
from training.loop.rollout import max_rollout_steps, rollout_loss, rollout_steps_at, step_weights


def _model_and_data(k: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GELU(), torch.nn.Conv2d(8, 3, 3, padding=1))
    return model, torch.randn(2, 3, 8, 16), torch.randn(2, k, 3, 8, 16)


def test_one_step_is_the_one_step_loss_bit_for_bit():
    model, x, y = _model_and_data(3)
    assert torch.equal(rollout_loss(model, relative_l2_loss, x, y, (1.0,)), relative_l2_loss(model(x), y[:, 0]))


def test_k_steps_feed_each_forecast_back_and_weight_the_mean():
    model, x, y = _model_and_data(3)
    first, second, third = model(x), model(model(x)), model(model(model(x)))
    want = (2 * relative_l2_loss(first, y[:, 0]) + relative_l2_loss(second, y[:, 1])
            + 0 * relative_l2_loss(third, y[:, 2])) / 3
    torch.testing.assert_close(rollout_loss(model, relative_l2_loss, x, y, (2.0, 1.0, 0.0)), want, rtol=1e-6, atol=0)


def test_per_step_checkpointing_gives_the_same_gradients():
    model, x, y = _model_and_data(3)
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        rollout_loss(model, relative_l2_loss, x, y, (1.0, 1.0, 1.0), recompute).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_gradients_flow_through_every_step():
    model, x, y = _model_and_data(2)
    x.requires_grad_(True)
    rollout_loss(model, relative_l2_loss, x, y, (0.0, 1.0)).backward()  # only the second step's loss
    assert x.grad.abs().sum() > 0 and all(p.grad.abs().sum() > 0 for p in model.parameters())


def test_each_step_gets_its_own_forcing_appended_to_the_fed_back_forecast():
    """Application j reads [forecast j-1, forcing(j)]: the forcing of its own target's valid time, not the first's."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(5, 3, 3, padding=1)  # 3 prognostic + 2 forcing channels in, 3 out
    x, y = torch.randn(2, 3, 8, 16), torch.randn(2, 3, 3, 8, 16)
    forcings = torch.randn(3, 2, 2, 8, 16)  # one (B, F, H, W) per step
    seen = []

    def forcing(j: int) -> torch.Tensor:
        seen.append(j)
        return forcings[j]
    first = model(torch.cat([x, forcings[0]], 1))
    second = model(torch.cat([first, forcings[1]], 1))
    third = model(torch.cat([second, forcings[2]], 1))
    want = (relative_l2_loss(first, y[:, 0]) + relative_l2_loss(second, y[:, 1]) + relative_l2_loss(third, y[:, 2])) / 3
    for recompute in (False, True):
        seen.clear()
        got = rollout_loss(model, relative_l2_loss, x, y, (1.0, 1.0, 1.0), recompute, forcing)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert seen == [0, 1, 2]
    assert torch.equal(rollout_loss(model, relative_l2_loss, x, y, (1.0,), forcing=forcing),
                       relative_l2_loss(first, y[:, 0]))


def test_curriculum_raises_k_by_iterations_or_epochs_up_to_the_maximum():
    fixed = OptimConfig(train_rollout_steps=3)
    assert [rollout_steps_at(fixed, s, 0) for s in (0, 10**6)] == [3, 3] and max_rollout_steps(fixed) == 3
    iters = OptimConfig(train_rollout_steps=1, rollout_max_steps=4, rollout_raise_every=10)
    assert [rollout_steps_at(iters, s, 0) for s in (0, 9, 10, 25, 30, 999)] == [1, 1, 2, 3, 4, 4]
    epochs = OptimConfig(train_rollout_steps=2, rollout_max_steps=3, rollout_raise_every=2, rollout_raise_unit="epochs")
    assert [rollout_steps_at(epochs, 99, e) for e in (0, 1, 2, 7)] == [2, 2, 3, 3]
    assert step_weights(iters) == (1.0,) * 4


@pytest.mark.parametrize("optim,needle", [
    ({"train_rollout_steps": 3, "rollout_max_steps": 2}, "--rollout_max_steps 2 is below --train_rollout_steps 3"),
    ({"train_rollout_steps": 2, "rollout_step_weights": (1.0,)}, "has 1 weight(s) but the run trains up to 2"),
    ({"train_rollout_steps": 2, "rollout_step_weights": (0.0, 0.0)}, "the first 2 weights sum to 0"),
    ({"rollout_raise_every": 5}, "--rollout_raise_every has no effect without a rollout curriculum"),
])
def test_bad_rollout_configs_are_one_line(optim, needle):
    cfg = Config()
    cfg.logging.expdir = "/tmp/unused-expdir"
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    with pytest.raises(UserError, match="") as err:
        validate(cfg, Launch())
    assert needle in str(err.value) and "\n" not in str(err.value)
