"""The job once it is joined: the :class:`World` (ranks, device, device mesh), the collectives the
components use, and :func:`distributed_session`, which makes every rank stop with one line as soon as
any rank fails.

The mesh has named dimensions ``dp_replicate, dp_shard, ens, cp, tp`` laid out by
``--parallel_order`` (innermost first, default ``tp-cp-dp``: tensor-parallel peers are
adjacent ranks, i.e. on one node; ``ens``, the ensemble-parallel dimension, always sits just inside ``dp``);
``dp`` is the flattened data-parallel dimension (the ranks that read different samples).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from distributed.failure import FailureChannel, finish
from distributed.launch import LaunchEnv, detect_launch, select_device
from distributed.rendezvous import rendezvous
from distributed.simulate import is_simulated, simulated_env, simulating, start_fake_process_group
from utils.config.schema import ParallelConfig
from utils.config.validate import data_parallel_size
from utils.core.errors import NothingToDo, Preempted, UserError, failure_status


@dataclass
class World:
    """This process's place in the job and its device mesh.

    ``dp``, ``ens``, ``cp``, ``tp`` are the data-, ensemble-, context- and tensor-parallel sizes
    (``dp * ens * cp * tp == world_size``); ``dp_rank`` indexes this rank's data shard (the ``ens`` ranks of an
    ensemble group read the same samples and forecast different members of them); ``fsdp`` is the configured
    ``--fsdp`` mode. The questions every mode-dependent piece asks (FSDP? DDP? model parallel?) are answered
    here once (:attr:`model_parallel`, :attr:`uses_fsdp`, :attr:`fsdp_only`, :attr:`ddp`).
    ``meshes`` maps ``dp``, ``ens``, ``cp``, ``tp`` and ``hsdp`` (the 2D ``dp_replicate x dp_shard``
    mesh) to their device meshes (and the gradient-reducing ones of :func:`build_meshes`); empty for one process.
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
    fsdp: str = "none"
    ens: int = 1

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def model_parallel(self) -> bool:
        """Whether tensor or context parallelism splits the model (its parameters are then DTensors on the ``tp``
        mesh, or for context parallelism alone plain tensors whose gradients are partial per ``cp`` rank)."""
        return self.tp > 1 or self.cp > 1

    @property
    def uses_fsdp(self) -> bool:
        """Whether FSDP shards the model: ``--fsdp`` is set and there is more than one rank to shard over (``dp``;
        under tensor/context parallelism ``dp x cp``); one process trains unsharded."""
        ranks = self.dp * self.ens * (self.cp if self.model_parallel else 1)
        return self.fsdp != "none" and ranks > 1

    @property
    def fsdp_only(self) -> bool:
        """FSDP over plain (non-DTensor) parameters: FSDP without tensor or context parallelism."""
        return self.uses_fsdp and not self.model_parallel

    @property
    def ddp(self) -> bool:
        """Plain DDP: more than one data- or ensemble-parallel rank, neither FSDP nor tensor/context parallelism."""
        return self.dp * self.ens > 1 and not self.uses_fsdp and not self.model_parallel

    def note_step(self, step: int) -> None:
        """Tell the failure watchdog the iteration this rank is at (its heartbeats and the line naming
        a stuck rank carry it); a no-op for one process."""
        if self.channel is not None:
            self.channel.note_step(step)

    def group(self, name: str):
        """Process group of mesh dimension ``name`` (``dp``, ``ens``, ``cp``, ``tp``), or None if size 1."""
        size = {"dp": self.dp, "ens": self.ens, "cp": self.cp, "tp": self.tp}[name]
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
                 hsdp_shard: int, ens: int = 1) -> dict[str, DeviceMesh]:
    """One device mesh with dims ``dp_replicate, dp_shard, ens, cp, tp`` ordered by ``order`` (``ens`` just inside
    ``dp``); returns its sub-meshes: ``dp`` (flattened replicate x shard), ``ens``, ``cp``, ``tp``, ``hsdp`` (2D
    replicate x shard), and the meshes gradients are reduced over: ``dp_cp`` (flattened replicate x shard x ens x
    cp, under context parallelism), ``dp_ens`` (replicate x shard x ens), ``hsdp_cp`` and ``hsdp_ens`` (2D
    replicate x (shard x ens x cp) and replicate x (shard x ens)).

    Raises:
        UserError: HSDP with context parallelism where ``order`` does not keep ``cp`` next to ``dp``.
    """
    dp = world_size // (tp * cp * ens)
    rep, shard = hsdp_split(dp, hsdp_shard) if hsdp_shard else (1, dp)
    sizes = {"tp": tp, "cp": cp, "ens": ens, "dp_replicate": rep, "dp_shard": shard}
    dims: list[str] = []
    for name in reversed(order.split("-")):  # outermost first
        dims += ["dp_replicate", "dp_shard", "ens"] if name == "dp" else [name]
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in dims), mesh_dim_names=tuple(dims))
    hsdp = mesh[("dp_replicate", "dp_shard")]
    meshes = {"dp": hsdp._flatten("dp"), "ens": mesh["ens"], "cp": mesh["cp"], "tp": mesh["tp"], "hsdp": hsdp}
    meshes["dp_cp"] = mesh[tuple(d for d in dims if d != "tp")]._flatten("dp_cp")
    meshes["dp_ens"] = mesh[("dp_replicate", "dp_shard", "ens")]._flatten("dp_ens")
    if hsdp_shard and cp > 1:  # HSDP under context parallelism: replicate x (shard x ens x cp)
        meshes["hsdp_cp"] = _hsdp_shard_with(mesh, dims, order, "cp")
    elif hsdp_shard and ens > 1:  # HSDP over members: replicate x (shard x ens)
        meshes["hsdp_ens"] = _hsdp_shard_with(mesh, dims, order, "ens")
    return meshes


def _hsdp_shard_with(mesh: DeviceMesh, dims: list[str], order: str, inner: str) -> DeviceMesh:
    """The 2D ``dp_replicate x (dp_shard x ens [x cp])`` mesh, ``inner`` the innermost dimension it shards over
    (``ens`` or ``cp``). Raises UserError when ``order`` separates cp from dp."""
    sharded = ("dp_shard", "ens", "cp") if inner == "cp" else ("dp_shard", "ens")
    mesh[tuple(d for d in dims if d in sharded)]._flatten(f"dp_shard_{inner}")
    with warnings.catch_warnings():  # torchtitan's way too; torch warns it may one day ask for another
        warnings.simplefilter("ignore", UserWarning)
        try:
            return mesh[("dp_replicate", f"dp_shard_{inner}")]
        except (RuntimeError, KeyError, ValueError):
            raise UserError(f"--fsdp hsdp with context parallelism needs cp next to dp in --parallel_order, got "
                            f"{order}; use tp-cp-dp or cp-dp-tp") from None


def init_distributed(parallel: ParallelConfig, env: LaunchEnv | None = None) -> World:
    """Join the job (bounded rendezvous), start torch.distributed (NCCL on GPUs, gloo on CPU) and
    build the mesh from ``parallel`` (``tensor_parallel``, ``context_parallel``, ``fsdp``, ...).

    One process per GPU: the device is ``cuda:<local_rank>``. A process group started by the
    caller (tests) is reused. With ``simulate_world_size`` this one process is a rank of that world on
    the fake process group (``distributed/simulate.py``).

    Raises:
        UserError: the world size does not divide into tensor x context parallel, the launcher's
            variables are inconsistent, or a rank did not join within ``rendezvous_timeout_s`` s.
    """
    env = env or detect_launch()
    if simulating(parallel):  # one rank of a job on the fake process group (distributed/simulate.py)
        env = simulated_env(parallel, env)
    device = select_device(env)
    tp, cp, ens = parallel.tensor_parallel, parallel.context_parallel, parallel.ensemble_parallel
    dp = data_parallel_size(env.world_size, parallel)
    if env.world_size == 1:
        return World(env, device, fsdp=parallel.fsdp)
    store = None
    if is_simulated(env):
        start_fake_process_group(env.world_size, parallel.simulate_rank)
    elif not dist.is_initialized():
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
    meshes = build_meshes(device.type, env.world_size, tp, cp, parallel.parallel_order, shard, ens)
    return World(env, device, dp, cp, tp, meshes["dp"].get_local_rank(), meshes, store, fsdp=parallel.fsdp,
                 ens=ens)


def broadcast_from_main(obj, world: World):
    """``obj`` as rank 0 has it, on every rank (a picklable object; no-op for one process, also a simulated rank:
    it is the job's only process)."""
    if world.world_size == 1 or not dist.is_initialized() or is_simulated(world.env):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main_decides(decide: Callable[[], Any], world: World, errors: tuple[type[BaseException], ...] = (UserError,)) -> Any:
    """``decide()`` run on rank 0, its answer on every rank (collective). An exception of ``errors`` that it
    raises is raised on every rank instead, so no rank waits for the others; anything else propagates on
    rank 0 only (a bug: the failure channel stops the others)."""
    outcome = None
    if world.is_main:
        try:
            outcome = decide()
        except errors as exc:
            outcome = exc
    outcome = broadcast_from_main(outcome, world)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2, tensor parallel), else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


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

    A :class:`distributed.failure.FailureChannel` watches the job's store: an exception on one
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
        if world.channel is None:
            raise
        lost = world.channel.explain() if _communication_failed(exc) else None
        if lost is not None:  # a peer died under a collective: one line naming it, never gloo's/NCCL's traceback
            world.channel.report(lost, 2)
            raise UserError(lost) from None
        world.channel.report(_failure_line(exc), failure_status(exc))
        raise
    _finish(world, parallel)


def _failure_line(exc: BaseException) -> str:
    """What the other ranks print of this rank's failure: a UserError's own line, ``interrupted`` for Ctrl-C (the
    line one process prints), else the exception's type and message."""
    if isinstance(exc, UserError):
        return str(exc)
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"


def _communication_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure (a reset or closed connection, a timeout), as gloo and NCCL
    raise it, rather than an error of the training itself."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(word in text for word in ("gloo", "NCCL", "Connection", "Timed out"))


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
