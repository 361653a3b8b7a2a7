"""``--amp_mode bf16_pure``: a bf16 residual stream between the blocks with fp32 master weights and Adam state, on
one process, DDP and FSDP2 (two gloo ranks), trained against bf16 autocast and a single-process reference."""

from __future__ import annotations

import pytest
import torch

from distributed.parallelize import unwrap
from distributed.world import init_distributed
from networks.vit import build_model
from tests.dist_utils import run_distributed
from tests.train_utils import tiny_params
from utils.config.loading import load_config
from training.loop.step import build_training_step
from training.loop.trainer import Trainer

STEPS = {"num_iters": 4, "global_batch_size": 8}


def record_block_dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    """The dtype of every block's output, appended at each forward (a forward hook per block)."""
    seen: list[torch.dtype] = []
    for block in unwrap(model).blocks:
        block.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    return seen


def batch(cfg, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (4, cfg.data.n_in_channels, *cfg.data.img_size)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)[:, None], torch.arange(4)


@pytest.mark.parametrize("mode,stream", [("bf16_pure", torch.bfloat16), ("bf16", torch.float32)])
def test_residual_stream_is_bf16_and_the_state_fp32(mode, stream):
    """Between the blocks bf16 (plain bf16 autocast: fp32); parameters, gradients and Adam's moments fp32; the
    state dict plain fp32 tensors under the plain model's names, so checkpoints load into any mode."""
    cfg = load_config("config/ViT.yaml", "tiny", {"amp_mode": mode})
    world = init_distributed(cfg.parallel)
    step = build_training_step(cfg, world)
    seen = record_block_dtypes(step.model)
    grads = {}
    for name, p in step.model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.dtype))
    loss, _ = step(iter([batch(cfg, i) for i in range(2)]))
    step(iter([batch(cfg, 2)]))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert seen and set(seen) == {stream}
    assert {p.dtype for p in step.model.parameters()} == {torch.float32}
    assert set(grads.values()) == {torch.float32} and len(grads) == len(list(step.model.parameters()))
    moments = [t for s in step.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    state = step.model.state_dict()
    plain = build_model(cfg.model, cfg.data)
    assert list(state) == list(plain.state_dict()) and {v.dtype for v in state.values()} == {torch.float32}
    plain.load_state_dict(state)


def train(cfg) -> tuple[dict, dict]:
    """Train ``cfg`` in this process; the last epoch's record and the final weights."""
    world = init_distributed(cfg.parallel)
    trainer = Trainer(cfg, world)
    try:
        record = trainer.train()
    finally:
        trainer.close()
    return record, {k: v.detach().clone() for k, v in unwrap(trainer.model).state_dict().items()}


def test_trains_as_bf16_autocast_does(tiny_data, tmp_path):
    """12 steps of the tiny config: the losses of bf16_pure and bf16 autocast agree within bf16's rounding
    noise, far closer than to the untrained loss; the weights moved alike."""
    common = {"num_iters": 12, "limit_nsamples": 32, "limit_nsamples_val": 16, "valid_every": 3,
              "save_checkpoint": "false"}
    got = {mode: train(tiny_params(tiny_data, tmp_path / mode, amp_mode=mode, **common))
           for mode in ("bf16", "bf16_pure")}
    (pure, pure_w), (auto, auto_w) = got["bf16_pure"], got["bf16"]
    for key in ("loss/train", "loss/valid"):
        assert abs(pure[key] - auto[key]) < 0.02 * auto[key], (key, pure[key], auto[key])
    assert auto["loss/train"] < 0.9  # trained: the relative L2 loss starts near 1
    moved = sum((auto_w[k] - pure_w[k]).norm() ** 2 for k in auto_w) ** 0.5
    assert moved < 0.05 * sum(v.norm() ** 2 for v in auto_w.values()) ** 0.5


def _train_on_ranks(rank: int, world_size: int, data_path: str, expdir: str, overrides: dict) -> None:
    """run_distributed target: bf16_pure under DDP, FSDP or tp; the block outputs are bf16 on every rank."""
    cfg = tiny_params(data_path, expdir, **overrides)
    world = init_distributed(cfg.parallel)
    trainer = Trainer(cfg, world)
    seen = record_block_dtypes(trainer.model)
    trainer.train()
    trainer.close()
    assert seen and set(seen) == {torch.bfloat16}, (rank, set(seen))
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    from tests.train_utils import train_checkpoint
    return train_checkpoint(tiny_params(tiny_data, tmp_path_factory.mktemp("single"), amp_mode="bf16_pure", **STEPS))


@pytest.mark.parametrize("overrides", [{"fsdp": "none"}, {"fsdp": "zero2"}, {"tensor_parallel": 2}],
                         ids=["DDP", "FSDP", "tp 2"])
def test_ddp_fsdp_and_tp_match_one_process(tiny_data, tmp_path, single, overrides):
    """DDP (fp32 parameters, the pre-hook's cast), FSDP2 (bf16 parameters from its policy) and tensor parallelism
    (the mp configs inherit bf16_pure from opt) train as one process does: the weights differ from its weights
    by a small part of how far training moved them (bf16 rounding of the half batches' activations, or of the
    partial sums of the row-parallel layers; FSDP also rounds the LayerNorm weights and position embedding)."""
    run_distributed(_train_on_ranks, 2, str(tiny_data), str(tmp_path), {**STEPS, "amp_mode": "bf16_pure", **overrides})
    got = torch.load(tmp_path / "tiny" / "2CPU" / "00" / "checkpoints" / "model.pt")["model"]
    cfg = tiny_params(tiny_data, tmp_path)
    torch.manual_seed(cfg.optim.seed)
    start = build_model(cfg.model, cfg.data).state_dict()
    assert got.keys() == single.keys() and {v.dtype for v in got.values()} == {torch.float32}
    for key in single:
        moved = (single[key] - start[key]).norm()
        assert moved > 0 and (got[key] - single[key]).norm() < 0.2 * moved, key
