"""The typed config: one dataclass per section, every key with a type, a default and a one-line doc.

The YAML named configs (``config/ViT.yaml``) and the command line fill a :class:`Config`
(``utils/config/loading.py``); types always come from the annotations here, never from how a YAML default
is spelled (``utils/config/types.py``). ``utils/config/validate.py`` runs the cross-field checks in one step,
before anything is built or written. Each component receives only its own section (``cfg.data``,
``cfg.parallel``, ...).

This package imports nothing heavy (no torch), so ``--help`` and config errors answer at once.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from utils.config.types import (AT_LEAST_1, BATCH_OR_AUTO, CLOSED_UNIT_INTERVAL, NON_NEGATIVE, POSITIVE, SEED_RANGE, UNIT_INTERVAL, Check,
                                KeySpec, key, plain)
from utils.precision.fp8_advice import help_note

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")


CUDA_ONLY_ATTENTION = ("cudnn", "cudnn_packed", "flash", "efficient")


# SDPA kernels that take half precision only (PyTorch docs, torch.nn.attention.SDPBackend)
HALF_ONLY_ATTENTION = ("cudnn", "cudnn_packed", "flash")


# keys that matter only with --amp_mode fp8; float8 tensor cores start with Hopper (sm_90)
FP8_KEYS = ("fp8_recipe", "fp8_all_gather", "fp8_save_scales")


FP8_MIN_CAPABILITY = (9, 0)


# --simulate_rank all-distinct: every rank whose shard sizes differ from those of the ranks before it
ALL_DISTINCT = "all-distinct"


RANK_OR_ALL_DISTINCT = Check(f">= 0 or {ALL_DISTINCT}", lambda v: v == ALL_DISTINCT or v >= 0)


@dataclass
class ModelConfig:
    """The network (``networks/``)."""

    nettype: Literal["VisionTransformer"] = key("VisionTransformer", "model class in networks.vit.MODELS")
    embed_dim: int = key(384, "transformer width D", AT_LEAST_1)
    depth: int = key(12, "number of transformer blocks", AT_LEAST_1)
    num_heads: int = key(8, "attention heads; must divide embed_dim", AT_LEAST_1)
    mlp_ratio: float = key(4.0, "MLP hidden width / embed_dim", POSITIVE)
    patch_size: int = key(8, "patch edge in grid points; must divide both img_size dims", AT_LEAST_1)
    residual: bool = key(False, "predict the change over one step: the output is the input state plus the network's "
                                "(GraphCast's and FourCastNet 3's residual); false: the state itself")
    noise_channels: int = key(0, "stochastic model: Gaussian noise fields read as extra input channels, a fresh draw "
                                 "per ensemble member and step (0: deterministic; docs/ensembles.md)", NON_NEGATIVE)


@dataclass
class DataConfig:
    """Data layout, samples and loaders (``utils/data/loaders.py``, ``utils/data/dali.py``)."""

    data_path: str = key("/data", "data root: train/, valid/ and stats/ (docs/data.md)")
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
    forcings: tuple[str, ...] = key((), "input-only channels computed for the valid time of each step's target "
                                        "(cos_solar_zenith_angle, sin/cos_local_time, sin/cos_julian_day, "
                                        "sin/cos_latitude, sin/cos_longitude; docs/data.md#forcings)")
    static_fields: tuple[str, ...] = key((), "input-only static channels read from static_path (e.g. lsm, z), each "
                                             "normalized with its own mean and std")
    static_path: str = key("", "HDF5 file of the static fields (empty: <data_path>/static.h5, written by "
                                "tools.convert_era5 when the input has them)")

    @property
    def model_in_channels(self) -> int:
        """Channels the model reads: the C prognostic ones, then the forcings, then the static fields."""
        return self.n_in_channels + len(self.forcings) + len(self.static_fields)


@dataclass
class OptimConfig:
    """Batch sizes, optimizer, schedule and seed (``training/loop/trainer.py``)."""

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
    train_rollout_steps: int = key(1, "rollout training: the model is applied K times, each step fed its previous "
                                      "forecast, and the loss is the weighted mean over the K steps (1: one-step "
                                      "training); with rollout_max_steps, the curriculum's first K", AT_LEAST_1)
    rollout_max_steps: int = key(0, "rollout curriculum: raise K by 1 every rollout_raise_every iterations or epochs "
                                    "up to this K (0: no curriculum, K stays train_rollout_steps)", NON_NEGATIVE)
    rollout_raise_every: int = key(1000, "rollout curriculum: iterations or epochs (rollout_raise_unit) between raises "
                                         "of K", AT_LEAST_1)
    rollout_raise_unit: Literal["iterations", "epochs"] = key("iterations", "rollout curriculum: the unit of "
                                                                            "rollout_raise_every")
    rollout_step_weights: tuple[float, ...] = key((), "rollout: weight of each step's loss, one per step up to the "
                                                      "largest K (at K steps the first K, normalized; []: uniform)",
                                                  NON_NEGATIVE)
    loss: Literal["l2", "crps"] = key("l2", "training loss: l2 (relative L2 of one forecast) or crps (the almost fair "
                                            "CRPS of ensemble_members members; docs/ensembles.md)")
    ensemble_members: int = key(1, "members per initial state in training, each with its own noise (loss crps)",
                                AT_LEAST_1)
    crps_alpha: float = key(0.95, "loss crps: the afCRPS alpha (1: fair CRPS, 0: standard CRPS; AIFS-CRPS: 0.95)",
                            CLOSED_UNIT_INTERVAL)


@dataclass
class PrecisionConfig:
    """Precision and speed: AMP, fused Adam, compile, attention kernel, activation checkpointing."""

    amp_mode: Literal["none", "fp16", "bf16", "bf16_pure", "fp8"] = key(
        "none", "autocast dtype; fp16 adds a GradScaler; bf16_pure: bf16 autocast and a bf16 residual stream between "
                "the blocks (fp32 master weights, Adam state, LayerNorm statistics, softmax and loss), the arithmetic "
                "FSDP's bf16 parameters give; fp8: bf16 autocast plus float8 linears (torchao) in the transformer "
                f"blocks (Hopper or newer GPU, the fp8 extra); {help_note()}")
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = key(
        "tensorwise", "fp8: torchao.float8 recipe: per-tensor or per-row dynamic scaling; rowwise_with_gw_hp keeps "
                      "the weight-gradient GEMM in bf16")
    fp8_all_gather: bool = key(True, "fp8 under FSDP with the tensorwise recipe: all-gather weights in float8 (half "
                                     "the bytes of bf16); rowwise recipes gather bf16")
    fp8_save_scales: bool = key(True, "fp8 with activation checkpointing: a recomputed block keeps the forward's amax "
                                      "reductions (its float8 scales) instead of recomputing them; false to time "
                                      "that policy")
    fp8_attention: bool = key(True, "fp8: attention in fp8 too (cuDNN; Hopper at head dim 128, the cudnn extra); "
                                    "elsewhere bf16 attention, and the startup line says why")
    enable_fused: bool = key(False, "fused Adam kernel")
    enable_jit: bool = key(False, "torch.compile the model and the loss")
    compile_mode: Literal["default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"] = key(
        "default", "torch.compile mode (needs enable_jit)")
    compile_pdl: bool = key(False, "compiled kernels use Programmatic Dependent Launch (Hopper+)")
    gc_freeze: bool = key(True, "after the first step and at each later epoch's start, collect Python's garbage and "
                          "freeze the survivors (gc.freeze): automatic full collections skip the compiled graphs' "
                          "objects (at most 0.10 s instead of up to 0.74 s each on an H200's host); all of them "
                          "are walked again at the first epoch start after each 10 minutes of the wall clock")
    attention_backend: Literal["auto", "cudnn", "cudnn_packed", "flash", "efficient", "math"] = key(
        "auto", "scaled_dot_product_attention kernel; cudnn/flash need a GPU and bf16/fp16; cudnn_packed: cuDNN "
                "graphs on the packed QKV, no q/k/v gradient copies (GPU, bf16/fp16, the cudnn extra)")
    activation_checkpointing: Literal["none", "full", "selective"] = key(
        "none", "recompute activations in backward: every block, or selected ones")
    ac_every: int = key(2, "selective: checkpoint every k-th block (0: op-level policy)", NON_NEGATIVE)
    ac_blocks: int = key(0, "selective: checkpoint the first n blocks instead (0: use ac_every)", NON_NEGATIVE)
    rollout_checkpointing: bool = key(False, "rollout training: recompute each model application but the last in "
                                             "backward (on top of the block-level options), so K steps hold about one "
                                             "step's activations")


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
    ensemble_parallel: int = key(1, "ensemble-parallel size: ranks the members of each sample are spread over (must "
                                    "divide ensemble_members)", AT_LEAST_1)
    sequence_parallel: bool = key(False, "tensor_parallel > 1: split the tokens over tp between the attention/MLP "
                                         "GEMMs too, so LayerNorms, residual adds and their activations take 1/tp "
                                         "(Megatron-LM sequence parallelism; the same checkpoints): less memory, "
                                         "a little slower at mp (docs/parallelism.md)")
    async_tp: bool = key(False, "tensor_parallel > 1 with sequence_parallel, compiled without CUDA graphs, on CUDA: "
                                "torch's asynchronous tensor parallel (inductor's micro-pipeline TP on symmetric "
                                "memory) decomposes each all-gather + GEMM and GEMM + reduce-scatter instead of our "
                                "chunked collectives; tokens must split evenly over tp (docs/parallelism.md)")
    sp_grad_bucketing: bool = key(False, "tensor_parallel > 1 with sequence_parallel, compiled: inductor merges the "
                                         "tp all-reduces of the replicated parameters' gradients (LayerNorms, biases, "
                                         "embeddings) into one bucket per compiled graph (docs/parallelism.md)")
    cp_attention: Literal["all_gather", "ring"] = key(
        "all_gather", "context_parallel > 1: how attention reaches the other ranks' keys/values: all_gather them "
                      "first, or ring: pass them around the ranks behind the attention of the chunk in hand "
                      "(docs/parallelism.md)")
    parallel_order: Literal["tp-cp-dp", "cp-tp-dp", "tp-dp-cp", "cp-dp-tp", "dp-tp-cp", "dp-cp-tp"] = key(
        "tp-cp-dp", "mesh dimension order, innermost (adjacent ranks) first")
    bucket_cap_mb: int = key(25, "DDP gradient bucket size, MiB", AT_LEAST_1)
    ddp_static_graph: bool = key(True, "DDP static graph (off under gradient accumulation)")
    rendezvous_timeout_s: float = key(300.0, "seconds to wait for every rank to join before failing", POSITIVE)
    collective_timeout_s: float = key(600.0, "seconds a collective may wait before failing; a rank silent for 3/4 of "
                                      "it (stopped, frozen) stops the job", POSITIVE)
    simulate_world_size: int = key(0, "plan a job of this many ranks on one device: run as one of its ranks on torch's "
                                      "fake process group (collectives move no data: losses meaningless, no "
                                      "communication time, no checkpoint); without a GPU, a dry run on fake tensors "
                                      "(0: off; docs/planning.md)", NON_NEGATIVE)
    simulate_rank: Union[int, Literal["all-distinct"]] = key(
        0, "simulate_world_size: the rank simulated; all-distinct (tuner, dry run): one rank of each group whose shard "
           "sizes differ, the largest first", RANK_OR_ALL_DISTINCT)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints, resume and the model export (``distributed/checkpoint/``)."""

    save_checkpoint: bool = key(True, "write sharded checkpoints and, at the end, checkpoints/model.pt")
    checkpoint_every_steps: int = key(0, "also checkpoint every N optimizer steps (0: by time and at the end only)",
                                      NON_NEGATIVE)
    checkpoint_every_minutes: float = key(30.0, "checkpoint when M minutes passed since the last one (0: off); a "
                                                "killed run loses at most that much",
                                          NON_NEGATIVE)
    keep_checkpoints: int = key(2, "complete checkpoints kept; older ones are deleted", AT_LEAST_1)
    async_checkpoint: bool = key(False, "write checkpoints in the background (DCP async_save)")
    checkpoint_checksums: bool = key(True, "checksum every checkpoint file as it is written and verify before loading")
    resume: str = key("auto", "auto: continue this run from its latest complete checkpoint; never; or a "
                              "checkpoint folder to start from")
    init_from: Optional[str] = key(None, "start a new run from the weights (not optimizer or step) of a finished run's "
                                         "directory or its checkpoints/model.pt: a fine-tune; the same command later "
                                         "resumes the fine-tune's own checkpoints (null: fresh weights)")


@dataclass
class LoggingConfig:
    """Run directory, logs, TensorBoard and profiling windows."""

    description: str = key("", "one line saying what the named config is for")
    expdir: str = key("runs", "root of run directories <expdir>/<config>/<N>GPU/<run_num>/")
    run_num: str = key("auto", "run id; auto: the next free number (00, 01, ...)")
    log_every: int = key(10, "steps between progress lines when not on a terminal", AT_LEAST_1)
    profile_epoch: int = key(2, "epoch of the Nsight window, counted from 1 (ENABLE_PROFILING=1)", AT_LEAST_1)
    profile_start_step: int = key(5, "first step of the Nsight window", NON_NEGATIVE)
    profile_steps: int = key(5, "steps in the Nsight window", AT_LEAST_1)


@dataclass
class MemoryConfig:
    """The memory profiling window and OOM handling (``training/monitor/oom.py``, ``training/monitor/memory_profile.py``)."""

    memory_profile: bool = key(False, "profile memory over a window of steps into <run_dir>/memory/rank<r>/")
    memory_profile_epoch: int = key(1, "epoch of the memory profiling window, counted from 1", AT_LEAST_1)
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
    figure_every: int = key(1, "epochs between the TensorBoard figures, drawn by rank 0 after a validation on a "
                               "thread beside the training (the last validation draws them too; 0: never)",
                            NON_NEGATIVE)
    valid_rollout_steps: int = key(1, "validation: leads scored by feeding the model its forecasts this many "
                                      "times (1: one step ahead)", AT_LEAST_1)
    valid_init_every: int = key(1, "validation: start forecasts at every n-th time step of each validation file "
                                   "(fewer initial times: cheaper rollouts)", AT_LEAST_1)
    valid_ensemble_members: int = key(0, "validation of a stochastic model (noise_channels > 0): members drawn per "
                                         "initial time (0: ensemble_members of training)", NON_NEGATIVE)


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
    """A resolved config: ``name`` (the named config), the YAML file it came from, the keys the command line
    set (``overrides``), and its sections."""

    name: str = "custom"
    yaml_config: str = "config/ViT.yaml"
    overrides: tuple[str, ...] = field(default=(), compare=False)
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


def _collect_keys() -> dict[str, KeySpec]:
    keys: dict[str, KeySpec] = {}
    for attr, (cls, _) in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in keys, f"key {f.name} declared in two sections"
            keys[f.name] = KeySpec(f.name, attr, hints[f.name], f.default, f.metadata["doc"], f.metadata["check"])
    return keys


KEYS: dict[str, KeySpec] = _collect_keys()
