"""Process wire-up: rank, world size and rendezvous from torchrun or SLURM, then the device mesh.

Launchers:
* ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
* ``srun`` (SLURM): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``),
  ``SLURM_LOCALID``; master address = ``MASTER_ADDR`` or the first host of
  ``SLURM_JOB_NODELIST``; port = ``MASTER_PORT`` or 29500 + job id mod 1000.
* anything else: one process.

The mesh has named dimensions ``dp_replicate, dp_shard, cp, tp`` laid out by
``--parallel_order`` (innermost first, default ``tp-cp-dp``: tensor-parallel peers are
adjacent ranks, i.e. on one node); ``dp`` is the flattened data-parallel dimension.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distributed.rendezvous import FailureChannel, finish, rendezvous
from utils.errors import NothingToDo, Preempted, UserError, failure_status
from utils.schema import Launch, ParallelConfig, data_parallel_size


@dataclass
class LaunchEnv:
    """Where this process sits: ``rank`` in ``[0, world_size)``, ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "single"


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"nid[001-004,010],gpu7"`` -> ``"nid001"``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise UserError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR explicitly")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def _int(environ, key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise UserError(f"environment variable {key}={environ[key]!r} is not an integer; "
                        "fix or unset it") from None


def _tasks_per_node(environ) -> int:
    """Tasks on this node from ``SLURM_NTASKS_PER_NODE`` (``4``, ``4(x2)`` or ``4,2``: the first count)."""
    value = environ.get("SLURM_NTASKS_PER_NODE", "1")
    m = re.match(r"\d+", value)
    if not m:
        raise UserError(f"environment variable SLURM_NTASKS_PER_NODE={value!r} is not a task count; "
                        "fix or unset it")
    return int(m.group())


def _port(environ, default: int) -> int:
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else default
    if not 1 <= port <= 65535:
        raise UserError(f"MASTER_PORT={port} is not a TCP port (1-65535); export a free port such as 29500")
    return port


def detect_launch(environ=os.environ) -> LaunchEnv:
    """Read the launcher's environment. Raises UserError when the variables are inconsistent."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        env = LaunchEnv(_int(environ, "RANK"), _int(environ, "WORLD_SIZE"), _int(environ, "LOCAL_RANK")
                        if "LOCAL_RANK" in environ else 0,
                        _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else 1,
                        environ.get("MASTER_ADDR", "127.0.0.1"), _port(environ, 29500), "torchrun")
    elif "SLURM_PROCID" in environ and ("SLURM_STEP_NUM_TASKS" in environ or "SLURM_NTASKS" in environ):
        ntasks_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        if "MASTER_ADDR" in environ:
            addr = environ["MASTER_ADDR"]
        elif "SLURM_JOB_NODELIST" in environ:
            addr = first_slurm_host(environ["SLURM_JOB_NODELIST"])
        else:
            raise UserError("SLURM launch without SLURM_JOB_NODELIST or MASTER_ADDR; export MASTER_ADDR")
        job = _int(environ, "SLURM_JOB_ID") if environ.get("SLURM_JOB_ID") else 0
        env = LaunchEnv(_int(environ, "SLURM_PROCID"), _int(environ, ntasks_key),
                        _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
                        _tasks_per_node(environ),
                        addr, _port(environ, 29500 + job % 1000), "slurm")
    else:
        return LaunchEnv()
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise UserError(f"{env.launcher} gave rank {env.rank} with world size {env.world_size}; "
                        "rank must be in [0, world size): check the launcher's variables")
    if env.local_rank < 0 or env.local_rank > env.rank:
        raise UserError(f"{env.launcher} gave local rank {env.local_rank} for rank {env.rank}; "
                        "check LOCAL_RANK / SLURM_LOCALID")
    return env


@dataclass
class World:
    """This process's place in the job and its device mesh.

    ``dp``, ``cp``, ``tp`` are the data-, context- and tensor-parallel sizes
    (``dp * cp * tp == world_size``); ``dp_rank`` indexes this rank's data shard.
    ``meshes`` maps ``dp``, ``cp``, ``tp`` and ``hsdp`` (the 2D ``dp_replicate x dp_shard``
    mesh) to their device meshes; empty for one process.
    """

    env: LaunchEnv
    device: torch.device
    dp: int = 1
    cp: int = 1
    tp: int = 1
    dp_rank: int = 0
    meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    store: dist.Store | None = field(default=None, repr=False)
    channel: FailureChannel | None = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def note_step(self, step: int) -> None:
        """Tell the failure watchdog the iteration this rank is at (its heartbeats and the line naming
        a stuck rank carry it); a no-op for one process."""
        if self.channel is not None:
            self.channel.note_step(step)

    def group(self, name: str):
        """Process group of mesh dimension ``name`` (``dp``, ``cp``, ``tp``), or None if size 1."""
        size = {"dp": self.dp, "cp": self.cp, "tp": self.tp}[name]
        if not self.meshes or size == 1:
            return None
        return self.meshes[name].get_group()


def hsdp_split(dp: int, shard: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the data-parallel dimension for HSDP. Raises UserError if not divisible."""
    if shard < 1 or dp % shard:
        raise UserError(f"hsdp shard size {shard} must divide the data-parallel size {dp}; "
                        "set --hsdp_shard_size (0 means GPUs per node)")
    return dp // shard, shard


def build_meshes(device_type: str, world_size: int, tp: int, cp: int, order: str,
                 hsdp_shard: int) -> dict[str, DeviceMesh]:
    """One device mesh with dims ``dp_replicate, dp_shard, cp, tp`` ordered by ``order``; returns its
    ``dp`` (flattened replicate x shard), ``cp``, ``tp`` and ``hsdp`` (2D) sub-meshes."""
    dp = world_size // (tp * cp)
    rep, shard = hsdp_split(dp, hsdp_shard) if hsdp_shard else (1, dp)
    sizes = {"tp": tp, "cp": cp, "dp_replicate": rep, "dp_shard": shard}
    dims: list[str] = []
    for name in reversed(order.split("-")):  # outermost first
        dims += ["dp_replicate", "dp_shard"] if name == "dp" else [name]
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in dims), mesh_dim_names=tuple(dims))
    hsdp = mesh[("dp_replicate", "dp_shard")]
    return {"dp": hsdp._flatten("dp"), "cp": mesh["cp"], "tp": mesh["tp"], "hsdp": hsdp}


def validation_launch(env: LaunchEnv) -> Launch:
    """What :func:`utils.schema.validate` checks the config against: the world size, whether a CUDA GPU is
    visible and the compute capability of the one this rank will train on (``cuda:<local rank>``; the first
    when there are fewer GPUs, which :func:`select_device` then refuses)."""
    if not torch.cuda.is_available():
        return Launch(env.world_size)
    index = env.local_rank if env.local_rank < torch.cuda.device_count() else 0
    return Launch(env.world_size, True, torch.cuda.get_device_capability(index))


def select_device(env: LaunchEnv) -> torch.device:
    """``cuda:<local rank>`` (made current) when GPUs are visible, else the CPU.

    Raises:
        UserError: more local ranks than visible GPUs.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if env.local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {env.local_rank} but only {torch.cuda.device_count()} GPUs visible; "
                        "launch one process per GPU")
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    return device


def init_distributed(parallel: ParallelConfig, env: LaunchEnv | None = None) -> World:
    """Join the job (bounded rendezvous), start torch.distributed (NCCL on GPUs, gloo on CPU) and
    build the mesh from ``parallel`` (``tensor_parallel``, ``context_parallel``, ``fsdp``, ...).

    One process per GPU: the device is ``cuda:<local_rank>``. A process group started by the
    caller (tests) is reused.

    Raises:
        UserError: the world size does not divide into tensor x context parallel, the launcher's
            variables are inconsistent, or a rank did not join within ``rendezvous_timeout_s`` s.
    """
    env = env or detect_launch()
    device = select_device(env)
    tp, cp = parallel.tensor_parallel, parallel.context_parallel
    dp = data_parallel_size(env.world_size, parallel)
    if env.world_size == 1:
        return World(env, device)
    store = None
    if not dist.is_initialized():
        store = rendezvous(env, parallel.rendezvous_timeout_s)
        timeout = timedelta(seconds=parallel.collective_timeout_s)
        store.set_timeout(timeout)  # the store's own waits (NCCL's id exchange) follow the collectives'
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=env.rank,
                                world_size=env.world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    shard = 0
    if parallel.fsdp == "hsdp":
        shard = parallel.hsdp_shard_size or min(dp, env.local_world_size if env.local_world_size > 1
                                                else torch.cuda.device_count() or dp)
    meshes = build_meshes(device.type, env.world_size, tp, cp, parallel.parallel_order, shard)
    return World(env, device, dp, cp, tp, meshes["dp"].get_local_rank(), meshes, store)


def broadcast_from_main(obj, world: World):
    """``obj`` as rank 0 has it, on every rank (a picklable object; no-op for one process)."""
    if world.world_size == 1 or not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce(tensor: torch.Tensor, world: World, dim: str | None = None,
               op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce in place over mesh dimension ``dim`` (``dp``, ...) or over all ranks when None."""
    size = world.world_size if dim is None else getattr(world, dim)
    if dist.is_initialized() and size > 1:
        # a size-1 dimension has no group: passing None would reduce over the whole world
        dist.all_reduce(tensor, op=op, group=None if dim is None else world.group(dim))
    return tensor


@contextlib.contextmanager
def distributed_session(parallel: ParallelConfig, env: LaunchEnv):
    """Yield the :class:`World`; make every rank stop, with one line, as soon as any rank fails or
    stops answering.

    A :class:`distributed.rendezvous.FailureChannel` watches the job's store: an exception on one
    rank is published before it propagates, and the other ranks print it and exit (status 2)
    instead of waiting in their next collective. A rank without a heartbeat for
    :data:`SILENCE_SHARE` of ``collective_timeout_s`` (stopped, frozen, node lost) stops the job
    with one line naming it, before the collective's own timeout would. A normal end (also
    :class:`NothingToDo` and :class:`Preempted`, which every rank reaches together) passes a store
    barrier first, so rank 0 (which hosts the store) outlives every rank still polling it.
    """
    world = init_distributed(parallel, env)
    if world.store is not None:
        world.channel = FailureChannel(world.store, world.rank, world.world_size,
                                       silence_s=SILENCE_SHARE * parallel.collective_timeout_s)
        world.channel.start()
    try:
        yield world
    except (NothingToDo, Preempted):  # every rank reached the same verdict: leave together
        _finish(world, parallel)
        raise
    except BaseException as exc:
        if world.channel is not None:
            world.channel.report(str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}",
                                 failure_status(exc))
        raise
    _finish(world, parallel)


# a rank silent this share of the collective timeout is declared lost before gloo/NCCL time out
SILENCE_SHARE = 0.75


def _finish(world: World, parallel: ParallelConfig) -> None:
    if world.channel is not None:
        finish(world.store, world.channel, world.rank, world.world_size, parallel.collective_timeout_s)
    shutdown()


def shutdown() -> None:
    """Destroy the process group (after a successful run). Under gloo, also give its worker threads a moment to release
    their last finished collective: they outlive ``destroy_process_group`` and need the GIL to free
    it, and one caught by interpreter shutdown aborts the rank (``terminate called without an active
    exception``, SIGABRT after a successful run; pytorch/pytorch#190489)."""
    if dist.is_available() and dist.is_initialized():
        gloo = dist.get_backend() == "gloo"
        dist.destroy_process_group()
        if gloo:
            time.sleep(0.05)
