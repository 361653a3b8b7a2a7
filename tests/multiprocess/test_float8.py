"""``--amp_mode fp8`` on the CPU, where torchao's float8 linears run too (``torch._scaled_mm`` has CPU
kernels): which layers become float8, checkpoints interchangeable with bf16 runs, numerics against the bf16
model for every recipe, the padded GEMMs, the step hook, a short training run, and FSDP2's float8
all-gather on two gloo ranks against one process (outputs, bytes gathered, checkpoints)."""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

pytest.importorskip("torchao")

from utils.precision.float8 import apply_float8, float8_step_hook  # noqa: E402
from networks.vit import VisionTransformer, build_model  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.train_utils import tiny_params, train_checkpoint  # noqa: E402
from utils.config.loading import load_config  # noqa: E402
from training.evaluation.metrics import relative_l2_loss  # noqa: E402
from utils.config.schema import PrecisionConfig  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
BLOCK_LINEAR_WEIGHT = re.compile(r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.fc[12])\.weight")


def tiny_vit(img_size=(32, 64)) -> VisionTransformer:
    return VisionTransformer(img_size=img_size, patch_size=4, in_chans=4, out_chans=4, embed_dim=64, depth=2,
                             num_heads=4)


def fp8(recipe: str = "tensorwise", **keys) -> PrecisionConfig:
    return PrecisionConfig(amp_mode="fp8", fp8_recipe=recipe, **keys)


def float8_linears(model: nn.Module) -> dict[str, nn.Module]:
    from torchao.float8.float8_linear import Float8Linear
    return {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# ---------------------------------------------------------------- conversion
@pytest.mark.parametrize("recipe", RECIPES)
def test_only_the_linears_of_the_blocks_become_float8(recipe):
    model = tiny_vit()
    apply_float8(model, fp8(recipe), fsdp=False)
    assert set(float8_linears(model)) == {f"blocks.{i}.{name}" for i in range(2)
                                          for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert type(model.head) is nn.Linear and type(model.patch_embed.proj) is nn.Conv2d


def test_checkpoints_load_both_ways_between_float8_and_plain_models():
    torch.manual_seed(0)
    plain = tiny_vit()
    converted = copy.deepcopy(plain)
    apply_float8(converted, fp8(), fsdp=False)
    a, b = plain.state_dict(), converted.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert type(b[key]) is torch.Tensor and b[key].dtype == a[key].dtype and torch.equal(a[key], b[key]), key
    torch.manual_seed(1)
    into_plain, into_float8 = tiny_vit(), tiny_vit()
    apply_float8(into_float8, fp8(), fsdp=False)
    into_plain.load_state_dict(b)
    into_float8.load_state_dict(a)
    assert all(torch.equal(into_plain.state_dict()[k], a[k]) and torch.equal(into_float8.state_dict()[k], a[k])
               for k in a)


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_and_backward_track_the_bf16_model(recipe):
    """The same weights under bf16 autocast with and without float8 linears: the outputs differ by float8's
    rounding (a few 1e-3 here), not more; the gradients by more in the blocks (e5m2/e4m3 gradients), little
    elsewhere. The parameters are bf16 because torchao's linears follow only CUDA's autocast: on the CPU
    this gives them the bf16 operands a GPU run's autocast gives."""
    torch.manual_seed(0)
    plain = tiny_vit().bfloat16()
    converted = copy.deepcopy(plain)
    apply_float8(converted, fp8(recipe), fsdp=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 4, 32, 64, generator=g), torch.randn(2, 4, 32, 64, generator=g)
    outputs = []
    for model in (plain, converted):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            relative_l2_loss(out, y).backward()
        outputs.append(out)
    assert 1e-3 < relative_error(outputs[1], outputs[0]) < 0.02  # float8 GEMMs ran, and ran right
    want = dict(plain.named_parameters())
    for name, p in converted.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert relative_error(p.grad, want[name].grad) < (0.25 if name.startswith("blocks.") else 0.03), name


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.ops
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_full_checkpointing_keeps_the_float8_amax_reductions(recipe):
    """Full activation checkpointing under fp8 saves the amax reductions of the forward (a scalar or a column
    each) instead of recomputing them: the backward runs fewer of them, and the gradients are bitwise those of
    the plain full recompute."""
    from distributed.parallelize import apply_activation_checkpointing
    amax_ops = {torch.ops.aten.max.default, torch.ops.aten.amax.default}
    torch.manual_seed(0)
    base = tiny_vit().bfloat16()
    apply_float8(base, fp8(recipe), fsdp=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 4, 32, 64, generator=g), torch.randn(2, 4, 32, 64, generator=g)
    counts, grads = [], []
    for save_scales in (False, True):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, "full", 0, save_scales=save_scales)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = relative_l2_loss(model(x), y)
        with _CountOps(amax_ops) as counter:
            loss.backward()
        counts.append(counter.count)
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert counts[1] < counts[0], counts
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


@pytest.mark.parametrize("save,compiled,policy", [(True, False, "_scale_policy"), (True, True, "_scale_policy"),
                                                   (False, True, "_recompute_policy"), (False, False, None)])
def test_fp8_save_scales_picks_the_checkpoint_policy(save, compiled, policy):
    """``--fp8_save_scales`` reaches the checkpointed blocks through ``parallelize_model``: with it each block's
    recompute runs under the scale-saving policy (a ``context_fn``); without it, compiled, under the policy that
    recomputes every op (so that ops inside autograd functions are tagged too), eager the plain full recompute."""
    from distributed.launch import LaunchEnv
    from distributed.parallelize import parallelize_model
    from distributed.world import World
    from utils.config.schema import ParallelConfig
    precision = fp8(activation_checkpointing="full", fp8_save_scales=save, enable_jit=compiled)
    model = parallelize_model(tiny_vit(), ParallelConfig(), precision, World(LaunchEnv(), torch.device("cpu")))
    contexts = [block.checkpoint_fn.keywords.get("context_fn") for block in model.blocks]
    assert len(contexts) == 2
    assert all((c.args[0].__name__ if c else None) == policy for c in contexts), contexts


@pytest.mark.parametrize("img_size,padded", [((32, 64), False), ((20, 36), True)])
def test_gemms_are_padded_only_when_tokens_per_sample_are_not_a_multiple_of_16(img_size, padded):
    model = tiny_vit(img_size)  # 8 x 16 = 128 tokens per sample; 5 x 9 = 45
    apply_float8(model, fp8(), fsdp=False)
    assert {m.config.pad_inner_dim for m in float8_linears(model).values()} == {padded}


@pytest.mark.parametrize("precision,fsdp,wanted", [
    (fp8(), True, True),
    (fp8(), False, False),  # one process: nothing is gathered
    (fp8(fp8_all_gather=False), True, False),
    (fp8("rowwise"), True, False),  # rowwise scales: gathered in bf16
    (fp8("rowwise_with_gw_hp"), True, False),
    (PrecisionConfig(amp_mode="bf16"), True, False),
])
def test_step_hook_only_with_float8_all_gather(precision, fsdp, wanted):
    assert (float8_step_hook(tiny_vit(), precision, fsdp) is not None) == wanted


def test_a_short_fp8_run_trains_and_exports_a_plain_checkpoint(tiny_data, tmp_path):
    """The trainer's path (parallelize, train step, checkpoints, export) with float8 linears on one process."""
    state = train_checkpoint(tiny_params(tiny_data, tmp_path, amp_mode="fp8", num_iters=4))
    model = tiny_vit()
    model.load_state_dict(state)
    assert all(torch.isfinite(t).all() for t in state.values())


# ---------------------------------------------------------------- FSDP2 on two gloo ranks
def one_process_reference(cfg, state: dict, float8_gather: bool) -> nn.Module:
    """The single-process float8 model that computes what FSDP does with ``state``: FSDP computes with bf16
    copies of the parameters (its mixed-precision policy), except that with float8 all-gather the block
    linears' weights are cast to float8 straight from the fp32 shards, so those stay fp32 here."""
    model = build_model(cfg.model, cfg.data)
    apply_float8(model, cfg.precision, fsdp=False)
    model.load_state_dict(state)
    for name, p in model.named_parameters():
        if not (float8_gather and BLOCK_LINEAR_WEIGHT.fullmatch(name)):
            p.data = p.data.bfloat16()
    return model


@contextlib.contextmanager
def all_gather_bytes():
    """The sizes of the all-gathers run inside the block, in bytes (FSDP2 gathers with dist.all_gather_single)."""
    import torch.distributed as dist
    sizes, all_gather_single = [], dist.all_gather_single

    def counted(output, *args, **kwargs):
        sizes.append(output.nbytes)
        return all_gather_single(output, *args, **kwargs)
    dist.all_gather_single = counted
    try:
        yield sizes
    finally:
        dist.all_gather_single = all_gather_single


def _fsdp_float8_against_one_process(rank: int, world_size: int, out: str) -> None:
    """run_distributed target: for float8 all-gather on and off, the FSDP model's outputs equal the
    reference's before and after two training steps (with the step hook), the float8 gathers move
    fewer bytes, and (all-gather on) a sharded checkpoint and the full weights are written to ``out``."""
    from distributed.checkpoint.sharded import load_sharded, save_sharded
    from distributed.world import init_distributed
    from training.loop.step import build_training_step

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, 32, 64, generator=g), torch.randn(4, 4, 32, 64, generator=g)
    mine = slice(2 * rank, 2 * rank + 2)  # this rank's half of the batch
    gathered, world = {}, None
    for float8_gather in (True, False):
        cfg = load_config("config/ViT.yaml", "tiny", {"amp_mode": "fp8", "fsdp": "zero3", "global_batch_size": "4",
                                                      "fp8_all_gather": str(float8_gather).lower()})
        world = world or init_distributed(cfg.parallel)
        step = build_training_step(cfg, world)  # seeded: the weights of build_model after manual_seed(0)
        assert (step.after_step is not None) == float8_gather
        torch.manual_seed(cfg.optim.seed)
        state = build_model(cfg.model, cfg.data).state_dict()
        for i in range(3):
            with torch.no_grad(), step.autocast(), all_gather_bytes() as sizes:
                got = step.model(x[mine])
            with torch.no_grad(), step.autocast():
                want = one_process_reference(cfg, state, float8_gather)(x[mine])
            assert relative_error(got, want) < 1e-4, (float8_gather, i, relative_error(got, want))
            gathered[float8_gather] = sum(sizes)
            if i < 2:
                step(iter([(x[mine], y[mine, None], torch.arange(2))]))
                state = {k: v.full_tensor() for k, v in step.model.state_dict().items()}
        if float8_gather:  # checkpoints: written as plain tensors, and read back into a float8 model (resume)
            save_sharded(step.model, step.optimizer, f"{out}/sharded")
            if rank == 0:
                torch.save(state, f"{out}/full.pt")
            resumed = build_training_step(cfg, world)
            load_sharded(resumed.model, resumed.optimizer, f"{out}/sharded")
            assert all(torch.equal(v.full_tensor(), state[k]) for k, v in resumed.model.state_dict().items())
    # the blocks' float8 weights take 1 byte instead of bf16's 2 (root and norms stay bf16): ~0.6 here
    assert gathered[True] < 0.7 * gathered[False], gathered


def test_fsdp_float8_all_gather_matches_one_process_and_saves_plain_checkpoints(tmp_path):
    run_distributed(_fsdp_float8_against_one_process, 2, str(tmp_path))
    # the sharded checkpoint loads into the plain model without torchao's classes allowed for unpickling
    model = tiny_vit()
    state = {"model": model.state_dict()}
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        dcp.load(state, checkpoint_id=tmp_path / "sharded", no_dist=True)
    finally:
        torch.serialization.add_safe_globals(allowed)
    want = torch.load(tmp_path / "full.pt")
    assert all(torch.equal(state["model"][k], want[k]) for k in want)
