"""The typed config: one dataclass per section, every key with a type, a default and a one-line doc.

The YAML named configs (``config/ViT.yaml``) and the command line fill a :class:`Config`
(``utils/config.py``); types always come from the annotations here, never from how a YAML default is
spelled. :func:`validate` runs the cross-field checks in one step, before anything is built or written.
Each component receives only its own section (``cfg.data``, ``cfg.parallel``, ...).

This module imports nothing heavy (no torch), so ``--help`` and config errors answer at once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from utils.errors import UserError

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
CUDA_ONLY_ATTENTION = ("cudnn", "cudnn_packed", "flash", "efficient")
# SDPA kernels that take half precision only (PyTorch docs, torch.nn.attention.SDPBackend)
HALF_ONLY_ATTENTION = ("cudnn", "cudnn_packed", "flash")
# keys that matter only with --amp_mode fp8; float8 tensor cores start with Hopper (sm_90)
FP8_KEYS = ("fp8_recipe", "fp8_all_gather")
FP8_MIN_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class Check:
    """A per-value constraint: ``ok(value)`` must hold; ``text`` says what is required (``>= 1``)."""

    text: str
    ok: typing.Callable[[Any], bool]


AT_LEAST_1 = Check(">= 1", lambda v: v >= 1)
NON_NEGATIVE = Check(">= 0", lambda v: v >= 0)
POSITIVE = Check("> 0", lambda v: v > 0)
UNIT_INTERVAL = Check("in [0, 1)", lambda v: 0 <= v < 1)
SEED_RANGE = Check("in [0, 2**32)", lambda v: 0 <= v < 2**32)
AUTO = "auto"
BATCH_OR_AUTO = Check(">= 1 or auto", lambda v: v == AUTO or v >= 1)


def key(default: Any, doc: str, check: Check | None = None) -> Any:
    """A config key: its ``default``, a one-line ``doc`` and an optional per-value ``check``."""
    return field(default=default, metadata={"doc": doc, "check": check})


@dataclass
class ModelConfig:
    """The network (``networks/``)."""

    nettype: Literal["VisionTransformer"] = key("VisionTransformer", "model class in networks.MODELS")
    embed_dim: int = key(384, "transformer width D", AT_LEAST_1)
    depth: int = key(12, "number of transformer blocks", AT_LEAST_1)
    num_heads: int = key(8, "attention heads; must divide embed_dim", AT_LEAST_1)
    mlp_ratio: float = key(4.0, "MLP hidden width / embed_dim", POSITIVE)
    patch_size: int = key(8, "patch edge in grid points; must divide both img_size dims", AT_LEAST_1)


@dataclass
class DataConfig:
    """Data layout, samples and loaders (``utils/data_loader.py``, ``utils/dali_loader.py``)."""

    data_path: str = key("/data", "data root: train/, valid/ and stats/ (README: Data layout)")
    img_size: tuple[int, int] = key((360, 720), "(H, W) crop from the north-west corner, grid points",
                                    AT_LEAST_1)
    n_in_channels: int = key(20, "input channels C (must match the files)", AT_LEAST_1)
    n_out_channels: int = key(20, "output channels; equal to n_in_channels", AT_LEAST_1)
    dt: int = key(1, "file time steps between input and target", AT_LEAST_1)
    limit_nsamples: Optional[int] = key(None, "training samples per epoch at most (null: all)", AT_LEAST_1)
    limit_nsamples_val: Optional[int] = key(None, "validation samples at most (null: all)", AT_LEAST_1)
    data_loader_config: Literal["pytorch", "dali", "synthetic"] = key(
        "pytorch", "native h5py loader, NVIDIA DALI, or random device tensors (compute ceiling)")
    num_data_workers: int = key(0, "loader worker processes (0: read in the main process)", NON_NEGATIVE)


@dataclass
class OptimConfig:
    """Batch sizes, optimizer, schedule and seed (``utils/trainer.py``)."""

    global_batch_size: int = key(16, "samples per optimizer step over all data-parallel ranks", AT_LEAST_1)
    local_batch_size: Optional[Union[int, Literal["auto"]]] = key(
        None, "micro-batch per data-parallel rank; set, it overrides global_batch_size (null: global / (dp x "
              "accumulation); auto: the batch tuner's max-throughput choice)", BATCH_OR_AUTO)
    grad_accum_steps: int = key(1, "micro-steps per optimizer step (gradients synced on the last)", AT_LEAST_1)
    num_iters: int = key(30000, "optimizer steps in the run", AT_LEAST_1)
    lr: float = key(5.0e-4, "peak learning rate of Adam", POSITIVE)
    betas: tuple[float, float] = key((0.9, 0.95), "Adam (beta1, beta2)", UNIT_INTERVAL)
    weight_decay: float = key(0.0, "Adam L2 weight decay", NON_NEGATIVE)
    lr_schedule: Literal["cosine", "constant"] = key("cosine", "after warmup: cosine to 0, or constant")
    warmup: int = key(0, "linear warmup steps", NON_NEGATIVE)
    max_grad_norm: float = key(0.0, "clip the global gradient norm to this (0: off)", NON_NEGATIVE)
    seed: int = key(0, "seed of weights, sample order and synthetic data", SEED_RANGE)


@dataclass
class PrecisionConfig:
    """Precision and speed: AMP, fused Adam, compile, attention kernel, activation checkpointing."""

    amp_mode: Literal["none", "fp16", "bf16", "fp8"] = key(
        "none", "autocast dtype; fp16 adds a GradScaler; fp8: bf16 autocast plus float8 linears (torchao) in the "
                "transformer blocks (Hopper or newer GPU, the fp8 extra)")
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = key(
        "tensorwise", "fp8: torchao.float8 recipe: per-tensor or per-row dynamic scaling; rowwise_with_gw_hp keeps "
                      "the weight-gradient GEMM in bf16")
    fp8_all_gather: bool = key(True, "fp8 under FSDP with the tensorwise recipe: all-gather weights in float8 (half "
                                     "the bytes of bf16); rowwise recipes gather bf16")
    enable_fused: bool = key(False, "fused Adam kernel")
    enable_jit: bool = key(False, "torch.compile the model and the loss")
    compile_mode: Literal["default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"] = key(
        "default", "torch.compile mode (needs enable_jit)")
    compile_pdl: bool = key(False, "compiled kernels use Programmatic Dependent Launch (Hopper+)")
    attention_backend: Literal["auto", "cudnn", "cudnn_packed", "flash", "efficient", "math"] = key(
        "auto", "scaled_dot_product_attention kernel; cudnn/flash need a GPU and bf16/fp16; cudnn_packed: cuDNN "
                "graphs on the packed QKV, no q/k/v gradient copies (GPU, bf16/fp16, the cudnn extra)")
    activation_checkpointing: Literal["none", "full", "selective"] = key(
        "none", "recompute activations in backward: every block, or selected ones")
    ac_every: int = key(2, "selective: checkpoint every k-th block (0: op-level policy)", NON_NEGATIVE)
    ac_blocks: int = key(0, "selective: checkpoint the first n blocks instead (0: use ac_every)", NON_NEGATIVE)


@dataclass
class ParallelConfig:
    """Parallelism and process wire-up (``distributed/``)."""

    fsdp: Literal["none", "zero2", "zero3", "hsdp"] = key("none", "FSDP2 sharding (none: DDP when dp > 1)")
    hsdp_shard_size: int = key(0, "hsdp: ranks per shard group (0: GPUs per node)", NON_NEGATIVE)
    fsdp_prefetch: int = key(1, "blocks whose all-gathers may run ahead of compute", NON_NEGATIVE)
    fsdp_cpu_offload: bool = key(False, "keep FSDP shards, gradients and Adam state on the host")
    fsdp_reduce_dtype: Literal["fp32", "param"] = key("fp32", "gradient reduce dtype under AMP")
    tensor_parallel: int = key(1, "tensor-parallel size tp (heads and MLP columns split)", AT_LEAST_1)
    context_parallel: int = key(1, "context-parallel size cp (tokens split)", AT_LEAST_1)
    parallel_order: Literal["tp-cp-dp", "cp-tp-dp", "tp-dp-cp", "cp-dp-tp", "dp-tp-cp", "dp-cp-tp"] = key(
        "tp-cp-dp", "mesh dimension order, innermost (adjacent ranks) first")
    bucket_cap_mb: int = key(25, "DDP gradient bucket size, MiB", AT_LEAST_1)
    ddp_static_graph: bool = key(True, "DDP static graph (off under gradient accumulation)")
    rendezvous_timeout_s: float = key(300.0, "seconds to wait for every rank to join before failing", POSITIVE)
    collective_timeout_s: float = key(600.0, "seconds a collective may wait before failing; a rank silent for 3/4 of "
                                      "it (stopped, frozen) stops the job", POSITIVE)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints, resume and the model export (``distributed/checkpoint.py``)."""

    save_checkpoint: bool = key(True, "write sharded checkpoints and, at the end, checkpoints/model.pt")
    checkpoint_every_steps: int = key(0, "checkpoint every N optimizer steps (0: only at the end)", NON_NEGATIVE)
    checkpoint_every_minutes: float = key(0.0, "checkpoint when M minutes passed since the last one (0: off)",
                                          NON_NEGATIVE)
    keep_checkpoints: int = key(2, "complete checkpoints kept; older ones are deleted", AT_LEAST_1)
    async_checkpoint: bool = key(False, "write checkpoints in the background (DCP async_save)")
    resume: str = key("auto", "auto: continue this run from its latest complete checkpoint; never; or a "
                              "checkpoint folder to start from")


@dataclass
class LoggingConfig:
    """Run directory, logs, TensorBoard and profiling windows."""

    description: str = key("", "one line saying what the named config is for")
    expdir: str = key("runs", "root of run directories <expdir>/<config>/<N>GPU/<run_num>/")
    run_num: str = key("auto", "run id; auto: the next free number (00, 01, ...)")
    log_every: int = key(10, "steps between progress lines when not on a terminal", AT_LEAST_1)
    profile_epoch: int = key(1, "0-based epoch of the Nsight window (ENABLE_PROFILING=1)", NON_NEGATIVE)
    profile_start_step: int = key(5, "first step of the Nsight window", NON_NEGATIVE)
    profile_steps: int = key(5, "steps in the Nsight window", AT_LEAST_1)


@dataclass
class MemoryConfig:
    """The memory profiling window and OOM handling (``utils/memory.py``, ``utils/memory_profile.py``)."""

    memory_profile: bool = key(False, "profile memory over a window of steps into <run_dir>/memory/rank<r>/")
    memory_profile_epoch: int = key(0, "0-based epoch of the memory profiling window", NON_NEGATIVE)
    memory_profile_start_step: int = key(1, "first step (within the epoch) of the memory profiling window",
                                         NON_NEGATIVE)
    memory_profile_steps: int = key(2, "steps in the memory profiling window", AT_LEAST_1)
    memory_profile_max_entries: int = key(100000, "allocator events kept in the window's history (a ring buffer)",
                                          AT_LEAST_1)
    memory_profile_stacks: Literal["python", "all", "none"] = key(
        "python", "stack traces recorded with each allocation: python, all (also C++), none (for big models)")
    memory_profile_depth: int = key(3, "module depth of the per-module memory table (the model is 1, its blocks 3)",
                                    AT_LEAST_1)
    memory_snapshot_on_oom: Optional[bool] = key(None, "write an allocator snapshot when CUDA runs out of memory "
                                                       "(null: on with --memory_profile)")


@dataclass
class EvaluationConfig:
    """Validation and what the epoch line and TensorBoard show."""

    valid_every: int = key(1, "epochs between validations (the last epoch always validates)", AT_LEAST_1)
    key_channels: tuple[str, ...] = key((), "channels in the epoch line and run comparison ([]: first 4)")
    plot_channel: Optional[str] = key(None, "channel of the TensorBoard prediction figure (null: first)")
    valid_rollout_steps: int = key(1, "validation: leads scored by feeding the model its forecasts this many "
                                      "times (1: one step ahead)", AT_LEAST_1)
    valid_init_every: int = key(1, "validation: start forecasts at every n-th time step of each validation file "
                                   "(fewer initial times: cheaper rollouts)", AT_LEAST_1)


@dataclass
class TuneConfig:
    """The batch-size tuner (``tools/tune_batch_size.py``; ``train.py --local_batch_size auto``)."""

    out: Optional[str] = key(None, "tuner: JSON of trials and choices, with a PNG beside it (null: "
                                   "<expdir>/<config>/tune_batch_size.json)")
    tune: Literal["batch", "ac_blocks", "fsdp_prefetch"] = key(
        "batch", "tuner: what to search: the local batch; or, at the fixed global batch, the fastest clean local "
                 "batch with each number of checkpointed blocks (ac_blocks) or FSDP prefetch depth")
    tune_data: Literal["synthetic", "real"] = key("synthetic", "tuner: random batches of the real shape, or the "
                                                               "configured loader")
    tune_start: int = key(8, "tuner: first local batch tried (doubled until a trial fails)", AT_LEAST_1)
    tune_max_batch: int = key(4096, "tuner: largest local batch tried", AT_LEAST_1)
    resolution: int = key(8, "tuner: the boundary is bisected to multiples of this", AT_LEAST_1)
    tune_below: int = key(2, "tuner: batches measured under the largest clean one, resolution apart", NON_NEGATIVE)
    tune_warmup_steps: int = key(3, "tuner: steps run before timing a trial (compilation happens here)", AT_LEAST_1)
    tune_steps: int = key(5, "tuner: timed steps per trial", AT_LEAST_1)
    tolerance: float = key(0.02, "tuner: min-batch-at-peak picks the smallest batch within this fraction of the best",
                           UNIT_INTERVAL)
    memory_budget_gib: Optional[float] = key(None, "tuner: a trial whose peak reserved memory (CPU: peak RSS) exceeds "
                                                   "this many GiB fails (null: the device's memory)", POSITIVE)
    max_minutes: Optional[float] = key(None, "tuner: stop trying batches after this long and report the best so far",
                                       POSITIVE)


SECTIONS: dict[str, tuple[type, str]] = {
    "model": (ModelConfig, "model"),
    "data": (DataConfig, "data"),
    "optim": (OptimConfig, "optimization"),
    "precision": (PrecisionConfig, "precision and speed"),
    "parallel": (ParallelConfig, "parallelism"),
    "checkpoint": (CheckpointConfig, "checkpointing"),
    "logging": (LoggingConfig, "logging and profiling"),
    "memory": (MemoryConfig, "memory profiling and OOM handling"),
    "evaluation": (EvaluationConfig, "evaluation"),
    "tune": (TuneConfig, "batch-size tuner"),
}


@dataclass
class Config:
    """A resolved config: ``name`` (the named config), the YAML file it came from, and its sections."""

    name: str = "custom"
    yaml_config: str = "config/ViT.yaml"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

    def flat(self) -> dict[str, Any]:
        """Every key with its value, sections in schema order (tuples as lists): YAML, run.json, hparams."""
        return {k.name: plain(getattr(getattr(self, k.section), k.name)) for k in KEYS.values()}

    def set(self, name: str, value: Any) -> None:
        """Set key ``name`` (already typed) in its section."""
        setattr(getattr(self, KEYS[name].section), name, value)


def plain(value: Any) -> Any:
    """Tuples as lists, for YAML and JSON."""
    return [plain(v) for v in value] if isinstance(value, tuple) else value


@dataclass(frozen=True)
class KeySpec:
    """One key of the schema: its section attribute, type annotation, default, doc and check."""

    name: str
    section: str
    type: Any
    default: Any
    doc: str
    check: Check | None


def _collect_keys() -> dict[str, KeySpec]:
    keys: dict[str, KeySpec] = {}
    for attr, (cls, _) in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in keys, f"key {f.name} declared in two sections"
            keys[f.name] = KeySpec(f.name, attr, hints[f.name], f.default, f.metadata["doc"], f.metadata["check"])
    return keys


KEYS: dict[str, KeySpec] = _collect_keys()


# ---------------------------------------------------------------- types
def choices(tp: Any) -> tuple | None:
    """The allowed values of a ``Literal`` (also inside ``Optional``), else None."""
    tp = _strip_optional(tp)[0]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else Union[rest]), True
    return tp, False


def type_name(tp: Any) -> str:
    """Short type text for help: ``INT``, ``FLOAT or null``, ``[INT,INT]``, ``{a,b}``, ``[STR,...]``."""
    inner, optional = _strip_optional(tp)
    if typing.get_origin(inner) is Union:
        text = " or ".join(type_name(a) for a in typing.get_args(inner))
    elif typing.get_origin(inner) is Literal:
        text = "{" + ",".join(map(str, typing.get_args(inner))) + "}"
    elif typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        text = (f"[{type_name(args[0])},...]" if len(args) == 2 and args[1] is Ellipsis
                else "[" + ",".join(type_name(a) for a in args) + "]")
    else:
        text = {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR"}[inner]
    return text + (" or null" if optional else "")


def coerce(raw: Any, tp: Any) -> Any:
    """Convert ``raw`` (a command-line string or a YAML value) to type ``tp``.

    Raises:
        ValueError: with a short reason, when ``raw`` does not fit ``tp``.
    """
    inner, optional = _strip_optional(tp)
    if raw is None or (isinstance(raw, str) and raw.lower() in ("null", "none") and optional):
        if optional:
            return None
        raise ValueError("null is not allowed")
    origin = typing.get_origin(inner)
    if origin is Union:  # the first alternative that takes the value (Literal["auto"] before int)
        alternatives = sorted(typing.get_args(inner), key=lambda a: typing.get_origin(a) is not Literal)
        for alternative in alternatives:
            try:
                return coerce(raw, alternative)
            except ValueError:
                pass
        raise ValueError("expects " + " or ".join(_expected(a) for a in alternatives))
    if origin is Literal:
        options = typing.get_args(inner)
        if raw not in options:
            raise ValueError(f"must be one of {', '.join(map(str, options))}")
        return raw
    if origin is tuple:
        return _coerce_tuple(raw, typing.get_args(inner))
    return _coerce_scalar(raw, inner)


def _expected(tp: Any) -> str:
    """``an integer``, ``a number``, ``a string`` or a Literal's options joined by ``or``."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(str, typing.get_args(tp)))
    return {int: "an integer", float: "a number", bool: "true or false"}.get(tp, "a string")


def _coerce_tuple(raw: Any, args: tuple) -> tuple:
    if isinstance(raw, str):
        raw = _parse_list(raw)
    if not isinstance(raw, (list, tuple)):
        raise ValueError("expects a list like [a,b]")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce_scalar(r, args[0]) for r in raw)
    if len(raw) != len(args):
        raise ValueError(f"expects a list of {len(args)} values")
    return tuple(_coerce_scalar(r, a) for r, a in zip(raw, args))


def _parse_list(text: str) -> list:
    """``"[360,720]"``, ``"360,720"``, ``"[t850, z500]"`` or ``"[]"`` -> list of YAML scalars."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError
    text = text.strip()
    try:
        value = YAML(typ="safe", pure=True).load(text if text.startswith("[") else f"[{text}]")
    except YAMLError:
        raise ValueError("expects a list like [a,b]") from None
    if not isinstance(value, list):
        raise ValueError("expects a list like [a,b]")
    return value


def _coerce_scalar(raw: Any, tp: type) -> Any:
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError("expects true or false")
    if tp is str:
        if isinstance(raw, (list, dict, bool)):
            raise ValueError("expects a string")
        return str(raw)
    if isinstance(raw, bool) or isinstance(raw, (list, dict)):
        raise ValueError(f"expects {'an integer' if tp is int else 'a number'}")
    try:
        number = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"expects {'an integer' if tp is int else 'a number'}") from None
    if tp is float:
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError("expects a finite number")
        return number
    if not number.is_integer():
        raise ValueError("expects an integer")
    return int(number)


def check_value(spec: KeySpec, value: Any) -> None:
    """Apply the key's per-value check (element-wise for lists). Raises ValueError."""
    if spec.check is None or value is None:
        return
    for v in (value if isinstance(value, tuple) else (value,)):
        if not spec.check.ok(v):
            raise ValueError(f"must be {spec.check.text}")


# ---------------------------------------------------------------- cross-field checks
@dataclass(frozen=True)
class Launch:
    """What validation needs to know about the job: its world size, whether a CUDA GPU is visible and that
    GPU's compute capability ``(major, minor)``, e.g. ``(9, 0)`` for Hopper (None: no GPU; the entry points
    fill it from ``distributed.env.validation_launch``)."""

    world_size: int = 1
    cuda: bool = False
    cuda_capability: tuple[int, int] | None = None


def validate(cfg: Config, launch: Launch) -> None:
    """Cross-field checks, run once before anything is built or written.

    Raises:
        UserError: the first problem found, naming the keys involved and a fix.
    """
    for check in (_check_model, _check_batches, _check_precision, _check_parallel, _check_checkpoint, _check_paths):
        check(cfg, launch)


def _check_model(cfg: Config, launch: Launch) -> None:
    m, d = cfg.model, cfg.data
    h, w = d.img_size
    if h % m.patch_size or w % m.patch_size:
        raise UserError(f"img_size [{h},{w}] is not a multiple of patch_size {m.patch_size}; pick "
                        f"--img_size [{h - h % m.patch_size},{w - w % m.patch_size}] or another --patch_size")
    if m.embed_dim % m.num_heads:
        raise UserError(f"embed_dim {m.embed_dim} is not divisible by num_heads {m.num_heads}; pick "
                        f"--num_heads from {_divisors(m.embed_dim)}")
    if int(m.embed_dim * m.mlp_ratio) < 1:
        raise UserError(f"mlp_ratio {m.mlp_ratio} gives an MLP of width 0; raise --mlp_ratio")
    if d.n_out_channels != d.n_in_channels:
        raise UserError(f"n_out_channels {d.n_out_channels} must equal n_in_channels {d.n_in_channels}: "
                        "targets are the same fields dt steps later")
    p = cfg.precision
    if p.activation_checkpointing == "selective" and p.ac_blocks > m.depth:
        raise UserError(f"--ac_blocks {p.ac_blocks} exceeds the model depth {m.depth}; use at most {m.depth} "
                        "(or --activation_checkpointing full)")


def _divisors(n: int) -> str:
    small = [k for k in range(1, min(n, 64) + 1) if n % k == 0]
    return ", ".join(map(str, small[:8]))


def data_parallel_size(world_size: int, parallel: ParallelConfig) -> int:
    """``world_size / (tp * cp)``. Raises UserError when it does not divide."""
    tp, cp = parallel.tensor_parallel, parallel.context_parallel
    if world_size % (tp * cp):
        raise UserError(f"world size {world_size} is not divisible by tensor_parallel x context_parallel "
                        f"= {tp} x {cp}; launch a multiple of {tp * cp} processes or change the sizes")
    return world_size // (tp * cp)


def batch_sizes(optim: OptimConfig, dp: int) -> tuple[int, int]:
    """(local micro-batch per data-parallel rank, global batch per optimizer step).

    ``global = local * dp * grad_accum_steps``; ``local_batch_size``, when set, wins.
    Raises UserError when the global batch does not divide over the ranks and micro-steps.
    """
    k = optim.grad_accum_steps
    if optim.local_batch_size == AUTO:
        raise ValueError("local_batch_size auto is resolved by the batch tuner before batch sizes are computed")
    if optim.local_batch_size is not None:
        return optim.local_batch_size, optim.local_batch_size * dp * k
    gbs = optim.global_batch_size
    if gbs % (dp * k):
        raise UserError(f"global_batch_size {gbs} is not divisible by data-parallel size {dp} x "
                        f"grad_accum_steps {k}; pick a multiple of {dp * k} or set --local_batch_size")
    return gbs // (dp * k), gbs


def _check_batches(cfg: Config, launch: Launch) -> None:
    dp = data_parallel_size(launch.world_size, cfg.parallel)
    if cfg.optim.local_batch_size != AUTO:
        batch_sizes(cfg.optim, dp)
    t = cfg.tune
    if t.tune_start > t.tune_max_batch:
        raise UserError(f"--tune_start {t.tune_start} exceeds --tune_max_batch {t.tune_max_batch}; lower the first "
                        "or raise the second")
    if t.tune == "fsdp_prefetch" and cfg.parallel.fsdp == "none":
        raise UserError("--tune fsdp_prefetch tunes FSDP's prefetch depth, but --fsdp is none; add --fsdp zero3 "
                        "(or zero2, hsdp) or tune ac_blocks")


def _check_precision(cfg: Config, launch: Launch) -> None:
    p = cfg.precision
    backend = p.attention_backend
    if backend in CUDA_ONLY_ATTENTION and not launch.cuda:
        raise UserError(f"--attention_backend {backend} needs a CUDA GPU and none is visible; "
                        "use --attention_backend auto (or math) on CPU")
    if backend in HALF_ONLY_ATTENTION and p.amp_mode == "none":
        raise UserError(f"--attention_backend {backend} runs only in bf16/fp16, but --amp_mode is none; "
                        "add --amp_mode bf16 or use --attention_backend auto")
    if backend == "cudnn_packed":
        _check_packed_attention(cfg)
    if p.compile_mode != "default" and not p.enable_jit:
        raise UserError(f"--compile_mode {p.compile_mode} has no effect without --enable_jit; "
                        "add --enable_jit or drop --compile_mode")
    if cfg.data.data_loader_config == "dali" and importlib.util.find_spec("nvidia.dali") is None:
        raise UserError("--data_loader_config dali needs NVIDIA DALI: pip install '.[dali]' "
                        "(nvidia-dali-cuda120; nvidia-dali-cuda130 on CUDA 13), or use --data_loader_config pytorch")
    _check_fp8(cfg, launch)


def model_parallel(par: ParallelConfig) -> bool:
    """Whether tensor or context parallelism replaces the dense layers (``distributed/tensor_parallel.py``)."""
    return par.tensor_parallel > 1 or par.context_parallel > 1


def _check_fp8(cfg: Config, launch: Launch) -> None:
    p, par, m = cfg.precision, cfg.parallel, cfg.model
    if p.amp_mode != "fp8":
        for name in FP8_KEYS:
            if getattr(p, name) != KEYS[name].default:
                raise UserError(f"--{name} has no effect without --amp_mode fp8; add --amp_mode fp8 or drop --{name}")
        return
    # the config's own conflicts first, then what this machine lacks
    if model_parallel(par):
        raise UserError("--amp_mode fp8 is not supported with tensor or context parallelism (their layers run their "
                        "own GEMMs); use --amp_mode bf16, or --tensor_parallel 1 --context_parallel 1")
    if par.fsdp_cpu_offload:
        raise UserError("--amp_mode fp8 is not supported with --fsdp_cpu_offload; drop --fsdp_cpu_offload or use "
                        "--amp_mode bf16")
    hidden = int(m.embed_dim * m.mlp_ratio)
    if m.embed_dim % 16 or hidden % 16:
        raise UserError(f"--amp_mode fp8: float8 GEMMs need widths that are multiples of 16, but embed_dim is "
                        f"{m.embed_dim} and the MLP hidden width (embed_dim x mlp_ratio) {hidden}; pick multiples "
                        "of 16 or use --amp_mode bf16")
    capability = launch.cuda_capability if launch.cuda else None
    if capability is None or capability < FP8_MIN_CAPABILITY:
        found = f"this GPU's is {capability[0]}.{capability[1]}" if capability else "no CUDA GPU is visible"
        raise UserError(f"--amp_mode fp8 needs an NVIDIA GPU of compute capability 9.0 (Hopper) or newer, but {found}; "
                        "use --amp_mode bf16")
    if importlib.util.find_spec("torchao") is None:
        raise UserError("--amp_mode fp8 needs torchao: pip install -e '.[fp8]', or use --amp_mode bf16")


def _check_packed_attention(cfg: Config) -> None:
    if importlib.util.find_spec("cudnn") is None:
        raise UserError("--attention_backend cudnn_packed needs cudnn-frontend: pip install -e '.[cudnn]' "
                        "(nvidia-cudnn-frontend), or use --attention_backend cudnn")
    if model_parallel(cfg.parallel):
        raise UserError("--attention_backend cudnn_packed runs whole-sequence, all-head attention; with tensor or "
                        "context parallelism use --attention_backend cudnn")


def _check_parallel(cfg: Config, launch: Launch) -> None:
    par = cfg.parallel
    dp = data_parallel_size(launch.world_size, par)
    if par.fsdp == "hsdp" and par.hsdp_shard_size and dp % par.hsdp_shard_size:
        raise UserError(f"--hsdp_shard_size {par.hsdp_shard_size} must divide the data-parallel size {dp}")
    if par.fsdp_cpu_offload:
        if par.fsdp == "none" or dp == 1:
            raise UserError("--fsdp_cpu_offload needs FSDP over more than one data-parallel rank; add "
                            "--fsdp zero3 (or zero2/hsdp) and launch 2+ processes, or drop --fsdp_cpu_offload")
        if not launch.cuda:
            raise UserError("--fsdp_cpu_offload moves FSDP shards from the GPU to the host, but no GPU is "
                            "visible; drop --fsdp_cpu_offload on CPU")
        if model_parallel(par):
            raise UserError("--fsdp_cpu_offload is not supported with tensor or context parallelism; "
                            "drop it or use --tensor_parallel 1 --context_parallel 1")
        if cfg.precision.amp_mode == "fp16":
            raise UserError("--fsdp_cpu_offload cannot unscale fp16 gradients on the host; "
                            "use --amp_mode bf16 (no GradScaler needed)")


def _check_checkpoint(cfg: Config, launch: Launch) -> None:
    c = cfg.checkpoint
    if c.resume not in ("auto", "never") and not Path(c.resume).is_dir():
        raise UserError(f"--resume {c.resume}: no such checkpoint folder; pass auto, never, or a folder such as "
                        "runs/<config>/<N>GPU/<run>/checkpoints")


def _check_paths(cfg: Config, launch: Launch) -> None:
    run_num = cfg.logging.run_num
    if not run_num or run_num in (".", "..") or "/" in run_num or "\\" in run_num:
        raise UserError(f"--run_num {run_num!r} must be a plain name like 00 or lr1e-3 (or auto)")
    expdir = Path(cfg.logging.expdir)
    existing = next(p for p in (expdir, *expdir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"--expdir {expdir}: {existing} is a file, not a directory; pass another --expdir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--expdir {expdir}: {existing} is not writable; pass a writable --expdir")
