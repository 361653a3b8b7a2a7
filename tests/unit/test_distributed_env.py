"""Launcher wire-up (torchrun, SLURM) and parallel-size errors, without starting processes."""

from __future__ import annotations

import pytest

from distributed.launch import detect_launch, first_slurm_host
from distributed.world import hsdp_split
from utils.core.errors import UserError


def test_torchrun_variables():
    env = detect_launch({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                         "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == \
        (3, 8, 1, "node7", 1234, "torchrun")


def test_slurm_variables_master_from_nodelist_and_port_from_job_id():
    env = detect_launch({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
                         "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "nid[001-002]", "SLURM_JOB_ID": "123456"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 8, 1, "slurm")
    assert env.master_addr == "nid001" and env.master_port == 29500 + 123456 % 1000


def test_slurm_master_addr_and_port_from_environment_win():
    env = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a1",
                         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 4000)


@pytest.mark.parametrize("nodelist,first", [
    ("nid001234", "nid001234"), ("nid[001-004,010]", "nid001"), ("gpu[07,09],cpu3", "gpu07"),
    ("host-a,host-b", "host-a"), ("r[2-3]n[1-2]", "r2"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("value,want", [("4", 4), ("4(x2)", 4), ("2,1", 2)])
def test_slurm_tasks_per_node_forms(value, want):
    env = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a1",
                         "SLURM_NTASKS_PER_NODE": value})
    assert env.local_world_size == want


def test_single_process_without_launcher():
    env = detect_launch({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


@pytest.mark.parametrize("environ,match", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank must be in"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "local rank 1 for rank 0"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a1", "SLURM_JOB_ID": "x"},
     "SLURM_JOB_ID='x' is not an integer"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a1", "SLURM_NTASKS_PER_NODE": "abc"},
     "SLURM_NTASKS_PER_NODE='abc' is not a task count"),
])
def test_inconsistent_launcher_variables_are_clear_errors(environ, match):
    with pytest.raises(UserError, match=match):
        detect_launch(environ)


def test_hsdp_sizes():
    assert hsdp_split(8, 4) == (2, 4)
    with pytest.raises(UserError, match="hsdp shard size 3 must divide"):
        hsdp_split(8, 3)
