"""Planning an N-rank job on one device (distributed/simulate.py, training/tuner/planner.py): a simulated rank takes
rank r's place in the mesh on the fake process group; a ZeRO-3 world of two holds the bytes the sharding rule
predicts (fake tensors and real CPU tensors); uneven shards are found; the dry run's parts add up; the NCCL
allowance and the submit line; bad inputs are one-line errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from distributed.launch import LaunchEnv
from distributed.simulate import simulated_env, simulation_config
from distributed.world import broadcast_from_main, init_distributed, shutdown
from networks.vit import build_model
from utils.config.command_line import cli_config
from utils.config.validate import Launch, validate
from utils.core.errors import UserError
from training.monitor.activations import gradient_bytes, optimizer_state_bytes, tensor_bytes
from training.loop.step import build_training_step
from training.tuner.dry_run import dry_run
from training.tuner.estimates import NCCL_BUFFSIZE_DEFAULT, nccl_allowance
from training.tuner.rank_plan import distinct_ranks
from training.tuner.report import PARTS, plan_table, submit_line
from training.tuner.tune import without_tuner_keys

TINY = ["--config", "tiny", "--local_batch_size", "2"]


def config(*args: str):
    return cli_config([*TINY, *args], "tiny")


@pytest.fixture
def simulated():
    """A simulated world of ``config(*args)`` (the fake process group), destroyed after the test."""
    worlds = []

    def start(*args: str):
        cfg = config(*args)
        worlds.append(init_distributed(cfg.parallel, LaunchEnv()))
        return cfg, worlds[-1]

    yield start
    shutdown()


def expected_zero3_bytes(world_size: int, rank: int) -> dict[str, int]:
    """Bytes of rank ``rank``'s ZeRO-3 shards of tiny, from torch.chunk of the plain model's real tensors."""
    params = list(build_model(config().model, config().data).parameters())
    chunks = [torch.chunk(p.detach(), world_size, dim=0) for p in params]
    numel = sum(c[rank].numel() if rank < len(c) else 0 for c in chunks)
    return {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer state": 8 * numel + 4 * len(params)}


@pytest.mark.parametrize("args, message", [
    (["--simulate_rank", "1"], "--simulate_rank 1 has no effect without --simulate_world_size"),
    (["--simulate_world_size", "4", "--simulate_rank", "4"], "--simulate_rank 4 is outside the simulated world of 4"),
    (["--simulate_world_size", "8", "--fsdp", "hsdp"], "needs --hsdp_shard_size"),
    (["--simulate_world_size", "2", "--amp_mode", "fp16"], "--amp_mode fp16 under --simulate_world_size"),
    (["--simulate_world_size", "2", "--resume", "runs/x"], "writes no checkpoint and continues none"),
    (["--simulate_world_size", "4", "--resume", "never", "--local_batch_size", "1"], None),
    (["--simulate_world_size", "3"], "global_batch_size 8 is not divisible by data-parallel size 3"),
])
def test_simulation_inputs_are_checked_against_the_simulated_job(args, message):
    cfg = cli_config(["--config", "tiny", *args], "tiny")
    if message is None:
        validate(cfg, Launch())
        return
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as err:
        validate(cfg, Launch())
    assert "\n" not in str(err.value)


def test_a_simulation_is_one_process_of_one_rank():
    cfg = config("--simulate_world_size", "4")
    with pytest.raises(UserError, match="this job has 2 processes; start it as one process"):
        validate(cfg, Launch(world_size=2))
    with pytest.raises(UserError, match="rank 1 of 2"):
        simulated_env(cfg.parallel, LaunchEnv(rank=1, world_size=2, local_rank=1))
    with pytest.raises(UserError, match="plans several ranks, which training cannot"):
        simulated_env(config("--simulate_world_size", "4", "--simulate_rank", "all-distinct").parallel, LaunchEnv())
    resolved = simulation_config(cfg)
    assert not resolved.checkpoint.save_checkpoint and resolved.checkpoint.resume == "never"
    assert without_tuner_keys(["--config", "tiny", "--simulate_world_size", "4", "--simulate_rank=2", "--lr", "1"]) \
        == ["--config", "tiny", "--lr", "1"]


def test_a_simulated_rank_holds_rank_r_place_in_the_mesh(simulated):
    cfg, world = simulated("--simulate_world_size", "16", "--fsdp", "hsdp", "--hsdp_shard_size", "2",
                           "--tensor_parallel", "2", "--context_parallel", "2", "--simulate_rank", "13")
    layout = torch.arange(16).view(2, 2, 2, 2)  # tp-cp-dp: dp_replicate, dp_shard, cp, tp (outermost first)
    rep, shard, cp, tp = (int(i) for i in (layout == 13).nonzero()[0])
    assert (world.dp, world.cp, world.tp, world.dp_rank) == (4, 2, 2, 2 * rep + shard)
    assert (world.meshes["cp"].get_local_rank(), world.meshes["tp"].get_local_rank()) == (cp, tp)
    assert world.is_main and world.env.launcher == "simulated"  # the one process keeps the records
    assert broadcast_from_main("mine", world) == "mine"


def test_zero3_world_of_two_holds_the_analytic_shards_and_its_parts_add_up():
    cfg = config("--fsdp", "zero3", "--simulate_world_size", "2", "--simulate_rank", "all-distinct",
                 "--memory_budget_gib", "1")
    plans = dry_run(cfg, LaunchEnv())  # both ranks: tiny's pos_embed (1, 128, 64) is rank 0's alone
    assert [(p.rank, p.local_batch, p.global_batch) for p in plans] == [(0, 2, 4), (1, 2, 4)]
    for plan in plans:
        assert plan.shards == expected_zero3_bytes(2, plan.rank) == plan.analytic
        assert set(plan.parts) == set(PARTS) and sum(plan.parts.values()) == plan.tensor_peak
        assert plan.parts["parameters"] > 0 and plan.parts["activations"] > 0 and plan.parts["optimizer state"] > 0
        assert plan.nccl.groups == [("world", 2), ("dp", 2)]
        assert plan.nccl.total == 2 * NCCL_BUFFSIZE_DEFAULT * 32 * 1  # a ring of two: one peer
    text = plan_table(plans, "title", 2**30)
    assert "rank 0" in text and "rank 1" in text and "NCCL_BUFFSIZE 4 MiB x 32 channels" in text
    assert "estimated: fake tensors" in text and "plan for rank 0:" in text  # rank 0 holds pos_embed


def test_zero3_world_of_two_holds_the_analytic_shards_on_real_cpu_tensors(simulated):
    cfg, world = simulated("--fsdp", "zero3", "--simulate_world_size", "2", "--simulate_rank", "1")
    step = build_training_step(cfg, world)  # as the GPU planner's trials build it
    grads = []
    step.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(gradient_bytes(opt)))
    batch = (torch.randn(2, 4, 32, 64), torch.randn(2, 1, 4, 32, 64), torch.arange(2))
    step(itertools.repeat(batch))
    counted = {"parameters": tensor_bytes(step.model.parameters()), "gradients": grads[0],
               "optimizer state": optimizer_state_bytes(step.optimizer)}
    assert counted == expected_zero3_bytes(2, 1)


def test_ddp_world_of_two_steps_on_real_cpu_tensors(simulated):
    """DDP's reducer rejects the fake process group's all-reduce result (None); the simulated rank steps with the
    full gradients a DDP rank holds."""
    cfg, world = simulated("--simulate_world_size", "2", "--simulate_rank", "1")
    step = build_training_step(cfg, world)
    grads = []
    step.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(gradient_bytes(opt)))
    batch = (torch.randn(2, 4, 32, 64), torch.randn(2, 1, 4, 32, 64), torch.arange(2))
    step(itertools.repeat(batch))
    assert grads == [tensor_bytes(step.model.parameters())] and world.dp == 2


def test_uneven_shards_are_found_and_the_largest_planned_first():
    # tiny's pos_embed (1, 128, 64) is split along its first axis of length 1: only rank 0 holds it
    cfg = config("--fsdp", "zero3", "--simulate_world_size", "4", "--simulate_rank", "all-distinct")
    assert distinct_ranks(cfg, LaunchEnv()) == [0, 1]
    even = config("--fsdp", "zero3", "--simulate_world_size", "4", "--tensor_parallel", "2")
    # tp is innermost: rank 1 is rank 0's tensor-parallel peer (equal heads, so equal bytes), rank 2 the next dp shard
    assert distinct_ranks(even, LaunchEnv()) == [0, 2]


def test_nccl_allowance_follows_the_job_environment(simulated):
    cfg, world = simulated("--simulate_world_size", "8", "--tensor_parallel", "2", "--fsdp", "zero3")
    allowance = nccl_allowance(cfg, world, {"NCCL_BUFFSIZE": str(2**20), "NCCL_MAX_NCHANNELS": "4"})
    assert allowance.groups == [("world", 8), ("dp", 4), ("tp", 2)]
    assert allowance.total == 2**20 * 4 * (2 + 2 + 1)  # ring peers: 2, and 1 in the group of 2


def test_submit_line_launches_the_planned_world():
    assert submit_line(256, ["--config", "vit_2b"]) == "sbatch -N 64 submit_pm.sh --config vit_2b"
    assert submit_line(2, ["--config", "tiny"]) == \
        "sbatch -N 1 --ntasks-per-node 2 --gpus-per-node 2 submit_pm.sh --config tiny"
    assert submit_line(6, []).startswith("(no submit_pm.sh line: 6 GPUs")



def test_the_plan_measures_k_rollout_steps_and_per_step_checkpointing():
    """The dry run steps the run's largest K: activations grow with K, and per-step checkpointing brings K = 4
    back to near one step's."""
    def activations(*args):
        cfg = config("--fsdp", "zero3", "--simulate_world_size", "2", *args)
        return dry_run(cfg, LaunchEnv())[0].parts["activations"]
    one, four = activations(), activations("--train_rollout_steps", "4")
    checkpointed = activations("--train_rollout_steps", "4", "--rollout_checkpointing", "true")
    assert four > 3 * one and checkpointed < 1.5 * one, (one, four, checkpointed)


def test_the_plan_counts_the_forcing_and_static_channels():
    """Forcings and static fields widen the model's input: the dry run steps them (nominal times, random static
    fields) and the patch embedding's parameters and the activations grow with them."""
    def plan(*args):
        cfg = config("--fsdp", "zero3", "--simulate_world_size", "2", *args)
        return dry_run(cfg, LaunchEnv())[0].parts
    base = plan()
    wide = plan("--forcings", "[cos_solar_zenith_angle,sin_local_time,cos_local_time,sin_latitude]",
                "--static_fields", "[lsm,z]")
    # rank 0's ZeRO-3 share of the patch embedding weight: 64 x (C x 4 x 4) floats, C 4 -> 10
    assert wide["parameters"] - base["parameters"] == 4 * 64 * 6 * 16 // 2
    assert wide["activations"] > base["activations"]


def test_the_plan_counts_the_members_on_a_rank_and_the_ensemble_group():
    """A rank forecasting m members of each sample holds about m times a deterministic rank's activations; spread
    over an ensemble group of 2 it holds half of them, and NCCL's allowance counts the ensemble group."""
    stochastic = ["--noise_channels", "2", "--fsdp", "zero3", "--simulate_world_size", "4"]

    def activations(*args):
        return dry_run(config(*stochastic, *args), LaunchEnv())[0].parts["activations"]
    one = activations()
    four = activations("--loss", "crps", "--ensemble_members", "4")
    spread = activations("--loss", "crps", "--ensemble_members", "4", "--ensemble_parallel", "2")
    assert 3 * one < four and 1.5 * one < spread < 0.75 * four, (one, four, spread)


def test_nccl_allowance_counts_the_ensemble_group(simulated):
    cfg, world = simulated("--simulate_world_size", "8", "--noise_channels", "2", "--loss", "crps",
                           "--ensemble_members", "4", "--ensemble_parallel", "2")
    assert nccl_allowance(cfg, world, {}).groups == [("world", 8), ("dp", 4), ("ens", 2), ("dp_ens", 8)]
