"""The bad-input table: every expected error through the real entry points is one line on stderr,
``error: ...`` naming the problem and the fix, exit status 2, no traceback, on every rank; config, launch
and data errors leave nothing on disk.

Each case is (id, entry point and arguments, environment, how to spoil the data, words the line must
hold, whether the run may already have written its directory). docs/errors.md lists these errors.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest

from tests.dist_utils import free_port, launch_entry, subprocess_env
from tests.forked import run_forked

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- ways to spoil a copy of the tiny data
def _first_train_file(data: Path) -> Path:
    return sorted((data / "train").glob("*.h5"))[0]


def _truncate(data: Path) -> None:
    path = _first_train_file(data)
    path.write_bytes(path.read_bytes()[:4096])


def _empty(data: Path) -> None:
    _first_train_file(data).write_bytes(b"")


def _rename_fields(data: Path) -> None:
    with h5py.File(_first_train_file(data), "r+") as f:
        f.move("fields", "data")


def _fields_group(data: Path) -> None:
    with h5py.File(_first_train_file(data), "r+") as f:
        del f["fields"]
        f.create_group("fields")


def _near_zero_std(data: Path) -> None:
    stds = np.load(data / "stats" / "global_stds.npy")
    stds[0, 1] = 1e-12
    np.save(data / "stats" / "global_stds.npy", stds)


def _attribute(name: str, value: str) -> Callable[[Path], None]:
    """Set one attribute of the first training file's ``fields``."""
    def spoil(data: Path) -> None:
        with h5py.File(_first_train_file(data), "r+") as f:
            f["fields"].attrs[name] = value
    return spoil


def _nan_stds(data: Path) -> None:
    stds = np.load(data / "stats" / "global_stds.npy")
    stds[0, 1] = np.nan
    np.save(data / "stats" / "global_stds.npy", stds)


def _wrong_means_shape(data: Path) -> None:
    np.save(data / "stats" / "global_means.npy", np.zeros((1, 3, 1, 1), np.float32))


def _missing_clim(data: Path) -> None:
    (data / "stats" / "time_means.npy").unlink()


def _truncated_npy(data: Path) -> None:
    path = data / "stats" / "global_means.npy"
    path.write_bytes(path.read_bytes()[:20])


def _bad_latitude(data: Path) -> None:
    with h5py.File(_first_train_file(data), "r+") as f:
        del f["latitude"]
        f["latitude"] = np.full(5, np.nan)


def _nan_in_train(data: Path) -> None:
    with h5py.File(sorted((data / "train").glob("*.h5"))[1], "r+") as f:
        f["fields"][3, 0, 5, 5] = np.nan


def _nan_in_valid(data: Path) -> None:
    with h5py.File(sorted((data / "valid").glob("*.h5"))[0], "r+") as f:
        f["fields"][2, 1, 4, 4] = np.inf


def _no_valid_files(data: Path) -> None:
    for path in (data / "valid").glob("*.h5"):
        path.unlink()


def _yaml(text: str) -> Callable[[Path], list[str]]:
    """A case whose config file is ``text`` (written next to the data)."""
    return _yaml_bytes(text.encode())


def _yaml_bytes(raw: bytes) -> Callable[[Path], list[str]]:
    """A case whose config file holds ``raw`` (another encoding, binary)."""
    def write(data: Path) -> list[str]:
        path = data / "configs.yaml"
        path.write_bytes(raw)
        return ["--yaml_config", str(path), "--config", "a"]
    return write


def _netcdf(name: str, fill: float) -> Callable[[Path], None]:
    """An ERA5-like netCDF file ``<name>.nc`` beside the data whose temperature ``t`` is all ``fill``."""
    def write(data: Path) -> None:
        import pandas as pd
        import xarray as xr
        shape = (8, 2, 8, 16)
        xr.Dataset({"t": (("time", "level", "latitude", "longitude"), np.full(shape, fill, np.float32))},
                   coords={"time": pd.date_range("2000-01-01", periods=8, freq="6h"), "level": [500, 850],
                           "latitude": np.linspace(90, -90, 8), "longitude": np.arange(16) * 22.5}
                   ).to_netcdf(data / f"{name}.nc")
    return write


def _foreign_scorecard(data: Path) -> None:
    """The data folder as a run whose ``evaluation/scorecard.json`` is JSON, but no scorecard of evaluate.py."""
    (data / "evaluation").mkdir()
    (data / "evaluation" / "scorecard.json").write_text('{"scores": {"model": {}}}')


def _init_file(kind: str) -> Callable[[Path], list[str]]:
    """A case whose --init_from is a file next to the data: ``damaged`` (truncated), ``foreign`` (a torch file
    without a model) or ``wider`` (the tiny model with embed_dim 32)."""
    def write(data: Path) -> list[str]:
        import torch
        path = data / "init.pt"
        if kind == "wider":
            from networks.vit import build_model
            from utils.config.loading import load_config
            cfg = load_config(str(ROOT / "config" / "ViT.yaml"), "tiny", {"embed_dim": "32"})
            torch.save({"model": build_model(cfg.model, cfg.data).state_dict()}, path)
        else:
            torch.save({"weights": [1, 2, 3]}, path)
            if kind == "damaged":
                path.write_bytes(path.read_bytes()[:100])
        return ["--init_from", str(path)]
    return write


@dataclass
class Case:
    id: str
    args: list[str]
    needles: list[str]
    env: dict[str, str] = field(default_factory=dict)
    spoil: Callable | None = None  # spoils a copy of the data; may return extra arguments
    entry: str = "train.py"
    writes: bool = False  # the error comes after the run directory exists (mid-training)
    absent: str | None = None  # a path ({data}: the data copy) that must not exist afterwards


LAUNCH = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
CASES = [
    # ---- config: keys, types, ranges, cross-field checks
    Case("unknown key", ["--lrr", "1e-3"], ["unknown config key --lrr", "did you mean lr"]),
    Case("unknown config", ["--config", "tinyy"], ["'tinyy' not in", "did you mean tiny",
                                                   "(python train.py --list-configs lists them all)"]),
    Case("value that looks like an option", ["--run_num", "-x"], ["--run_num -x: '-x' looks like an option"]),
    Case("key without its value", ["--run_num", "--lr", "1e-3"], ["--run_num needs a value: --run_num STR"]),
    Case("run_num not starting with a letter or digit", ["--run_num=-x"], ["starts with a letter or digit"]),
    Case("integer with an underscore", ["--num_iters", "1_0"], ["--num_iters expects an integer in plain decimal"]),
    Case("evaluate.py's option", ["--lead_steps", "0"], ["--lead_steps is an option of evaluate.py",
                                                          "--valid_rollout_steps"]),
    Case("wrong type", ["--num_iters", "many"], ["--num_iters expects an integer"]),
    Case("bad bool", ["--enable_fused", "maybe"], ["--enable_fused expects true or false"]),
    Case("bad choice", ["--amp_mode", "fp4"], ["--amp_mode must be one of none, fp16, bf16, bf16_pure, fp8"]),
    Case("positional argument", ["lr", "1e-3"], ["unexpected argument 'lr'"]),
    Case("global batch 0", ["--global_batch_size", "0"], ["--global_batch_size must be >= 1, got 0"]),
    Case("patch 0", ["--patch_size", "0"], ["--patch_size must be >= 1"]),
    Case("valid_every 0", ["--valid_every", "0"], ["--valid_every must be >= 1"]),
    Case("negative figure_every", ["--figure_every", "-1"], ["--figure_every must be >= 0, got -1"]),
    Case("depth 0", ["--depth", "0"], ["--depth must be >= 1"]),
    Case("dt 0", ["--dt", "0"], ["--dt must be >= 1"]),
    Case("negative iterations", ["--num_iters", "-5"], ["--num_iters must be >= 1"]),
    Case("limit 0 is not 'no limit'", ["--limit_nsamples", "0"], ["--limit_nsamples must be >= 1"]),
    Case("negative lr", ["--lr", "-1"], ["--lr must be > 0"]),
    Case("nan lr", ["--lr", "nan"], ["--lr expects a finite number"]),
    Case("image not a multiple of patch", ["--img_size", "[30,64]"],
         ["img_size [30,64] is not a multiple of patch_size 4"]),
    Case("heads do not divide width", ["--num_heads", "3"], ["embed_dim 64 is not divisible by num_heads 3"]),
    Case("channels differ", ["--n_out_channels", "3"], ["n_out_channels 3 must equal n_in_channels 4"]),
    Case("ac blocks beyond depth", ["--activation_checkpointing", "selective", "--ac_blocks", "5"],
         ["--ac_blocks 5 exceeds the model depth 2"]),
    Case("compile mode without compile", ["--compile_mode", "max-autotune"], ["no effect without --enable_jit"]),
    Case("cuDNN attention on CPU", ["--attention_backend", "cudnn", "--amp_mode", "bf16"], ["needs a CUDA GPU"]),
    Case("packed cuDNN attention on CPU", ["--attention_backend", "cudnn_packed", "--amp_mode", "bf16"],
         ["--attention_backend cudnn_packed needs a CUDA GPU"], env={"CUDA_VISIBLE_DEVICES": ""}),
    Case("CPU offload without FSDP", ["--fsdp_cpu_offload"], ["--fsdp_cpu_offload needs FSDP"]),
    Case("fp8 without a Hopper GPU", ["--amp_mode", "fp8"],
         ["--amp_mode fp8 needs an NVIDIA GPU of compute capability 9.0 (Hopper) or newer", "use --amp_mode bf16"],
         env={"CUDA_VISIBLE_DEVICES": ""}),
    Case("fp8 recipe without fp8", ["--fp8_recipe", "rowwise"], ["--fp8_recipe has no effect without --amp_mode fp8"]),
    Case("fp8 saved scales without fp8", ["--fp8_save_scales", "false"],
         ["--fp8_save_scales has no effect without --amp_mode fp8"]),
    Case("run_num with a slash", ["--run_num", "a/b"], ["must be a plain name"]),
    Case("run_num with a newline", ["--run_num", "00\n"], ["contains the control character '\\n'"]),
    Case("run_num too long", ["--run_num", "r" * 300], ["is 300 bytes, longer than the 255"]),
    Case("empty expdir", ["--expdir", ""], ["--expdir is empty"]),
    Case("rollout steps 0", ["--train_rollout_steps", "0"], ["--train_rollout_steps must be >= 1, got 0"]),
    Case("rollout curriculum that goes down", ["--train_rollout_steps", "3", "--rollout_max_steps", "2"],
         ["--rollout_max_steps 2 is below --train_rollout_steps 3", "only raises K"]),
    Case("rollout weights of another length", ["--train_rollout_steps", "2", "--rollout_step_weights", "[1,1,1]"],
         ["--rollout_step_weights has 3 weight(s) but the run trains up to 2 rollout steps"]),
    Case("memory profile of rollout training", ["--train_rollout_steps", "2", "--memory_profile", "true"],
         ["--memory_profile is not supported with rollout training (2 rollout steps)"]),
    Case("per-step checkpointing without rollout", ["--rollout_checkpointing", "true"],
         ["--rollout_checkpointing has no effect with one rollout step"]),
    Case("CRPS of one member", ["--loss", "crps", "--noise_channels", "4"],
         ["--loss crps scores an ensemble, but --ensemble_members is 1", "--ensemble_members 4"]),
    Case("CRPS of a deterministic model", ["--loss", "crps", "--ensemble_members", "4"],
         ["--loss crps with --noise_channels 0", "--noise_channels 4"]),
    Case("members with the L2 loss", ["--ensemble_members", "4", "--noise_channels", "4"],
         ["--ensemble_members 4 with --loss l2", "add --loss crps"]),
    Case("members not divisible over the ensemble ranks",
         ["--loss", "crps", "--noise_channels", "4", "--ensemble_members", "3", "--ensemble_parallel", "2"],
         ["--ensemble_members 3 is not divisible by --ensemble_parallel 2"], env=LAUNCH),
    Case("init_from a missing run", ["--init_from", "/nonexistent/run"], ["--init_from /nonexistent/run: no such"]),
    Case("init_from a damaged file", [], ["cannot read", "init.pt", "damaged"], spoil=_init_file("damaged")),
    Case("init_from a foreign file", [], ["init.pt is not a model file of this framework"],
         spoil=_init_file("foreign")),
    Case("init_from another model", [], ["parameter pos_embed is (1, 128, 32) there, (1, 128, 64) here"],
         spoil=_init_file("wider")),
    Case("init_from with resume", ["--init_from", "{data}", "--resume", "{data}"], ["pass one of them"]),
    Case("resume from a missing folder", ["--resume", "/nonexistent/ckpt"], ["--resume /nonexistent/ckpt: no such"]),
    Case("help for an unknown key", ["--help", "lrr"], ["--help lrr: unknown config key", "did you mean lr"]),
    # ---- config files
    Case("missing config file", ["--yaml_config", "/nonexistent/c.yaml"], ["/nonexistent/c.yaml not found"]),
    Case("invalid YAML", [], ["is not valid YAML"], spoil=_yaml("a: [1, 2\n  b: {")),
    Case("wrong type in YAML", [], ["config a: lr expects a number", "'fast'"], spoil=_yaml("a:\n  lr: fast\n")),
    Case("duplicated key in a merged config", [], ["key 'lr' repeats the one on line 5"],
         spoil=_yaml("b: &b\n  depth: 2\na:\n  <<: *b\n  lr: 1.0e-3\n  lr: 2.0e-3\n")),
    Case("unknown key in YAML", [], ["config a: unknown config key depht"], spoil=_yaml("a:\n  depht: 3\n")),
    Case("hexadecimal number in YAML", [], ["config a: lr expects a number in plain decimal digits", "'0x10'"],
         spoil=_yaml("a:\n  lr: 0x10\n")),
    Case("UTF-16 YAML", [], ["is UTF-16 text; save it as UTF-8"], spoil=_yaml_bytes("a:\n  lr: 1\n".encode("utf-16"))),
    Case("binary YAML", [], ["is not UTF-8 text", "save it as UTF-8"], spoil=_yaml_bytes(bytes(range(256)) * 4)),
    Case("YAML with NUL bytes", [], ["contains NUL bytes"], spoil=_yaml_bytes(b"a:\n  lr: 1\x00\n")),
    Case("YAML anchor that contains itself", [], ["has an anchor that refers to itself"],
         spoil=_yaml("a: &a\n  b: *a\n")),
    Case("YAML integer key", [], ["config a: key 1 is not a setting name"], spoil=_yaml("a:\n  1: 2\n")),
    Case("YAML integer config name", [], ["config name 7 is not a string"], spoil=_yaml("7:\n  lr: 1\n")),
    Case("a config pointed at data of another grid", [],
         ["the data at ", "are on a 32x64 grid but config a trains on img_size [8,16], 6% of it: they are not this "
          "config's data; pass --img_size [32,64] for the whole grid"],
         spoil=_yaml("a:\n  img_size: [8, 16]\n  patch_size: 4\n  n_in_channels: 4\n  n_out_channels: 4\n"
                     "  embed_dim: 32\n  depth: 1\n  num_heads: 2\n  global_batch_size: 4\n")),
    Case("tuner keys without the tuner", ["--tolerance", "0.1"], ["--tolerance: tuner keys", "--local_batch_size auto"]),
    Case("model too large for the host", ["--embed_dim", "4000000"], ["of host memory", "make the model smaller"]),
    # ---- output paths
    Case("expdir is a file", ["--expdir", "{data}/stats/global_means.npy/runs"], ["is a file, not a directory"]),
    # ---- data: missing, empty, truncated, corrupt files; wrong shapes; bad statistics; NaN
    Case("missing data path", ["--data_path", "/nonexistent/era5"], ["/nonexistent/era5/train does not exist"]),
    Case("crop larger than grid", ["--img_size", "[64,64]"], ["larger than the 32x64 grid"]),
    Case("wrong channel count", ["--n_in_channels", "5", "--n_out_channels", "5"],
         ["has 4 channels", "--n_in_channels 4"]),
    Case("too few samples for a batch", ["--global_batch_size", "4096"], ["fewer than one global batch"]),
    Case("rollout longer than the validation files", ["--valid_rollout_steps", "1000"],
         ["too few for 1000 rollout steps", "use at most"]),
    Case("rollout longer than the training files", ["--train_rollout_steps", "1000"],
         ["too few for 1000 rollout steps", "use at most", "(--train_rollout_steps "]),
    Case("unknown key channel", ["--key_channels", "[nope]"], ["channel 'nope'", "u10m"]),
    Case("unknown plot channel", ["--plot_channel", "nope"], ["channel 'nope'"]),
    Case("file without fields", [], ["has no 'fields' dataset"], spoil=_rename_fields),
    Case("truncated HDF5 file", [], ["cannot read", ".h5"], spoil=_truncate),
    Case("empty HDF5 file", [], ["cannot read", ".h5"], spoil=_empty),
    Case("corrupt latitude metadata", [], ["latitude", ".h5"], spoil=_bad_latitude),
    Case("NaN in global_stds.npy", [], ["global_stds.npy holds 1 NaN/Inf"], spoil=_nan_stds),
    Case("near-zero std", [], ["global_stds.npy: channel 1 has a near-zero standard deviation"],
         spoil=_near_zero_std),
    Case("fields is a group", [], ["'fields' is an HDF5 group, not a dataset"], spoil=_fields_group),
    Case("unknown calendar", [], ["attribute calendar='julius' is not a CF calendar"],
         spoil=_attribute("calendar", "julius")),
    Case("start time not a time", [], ["attribute start_time='yesterday' is not an ISO 8601 time"],
         spoil=_attribute("start_time", "yesterday")),
    Case("start time not in the calendar", [], ["start_time='2001-02-30' is not an ISO 8601 time in the standard"],
         spoil=_attribute("start_time", "2001-02-30")),
    Case("unknown time unit", [], ["time_step_unit='fortnights' are not a positive time step"],
         spoil=_attribute("time_step_unit", "fortnights")),
    Case("wrong shape of global_means.npy", [], ["global_means.npy has shape (1, 3, 1, 1)"], spoil=_wrong_means_shape),
    Case("truncated global_means.npy", [], ["cannot read", "global_means.npy"], spoil=_truncated_npy),
    Case("missing climatology", [], ["missing", "time_means.npy"], spoil=_missing_clim),
    Case("no validation files", [], ["no .h5 files in", "valid"], spoil=_no_valid_files),
    Case("NaN in the training data", ["--num_iters", "40"], ["NaN/Inf in the training data at step", "time"],
         spoil=_nan_in_train, writes=True),
    Case("NaN in the validation data", ["--num_iters", "4"], ["NaN/Inf in the validation data", "valid/"],
         spoil=_nan_in_valid, writes=True),
    Case("diverging model", ["--lr", "1e12", "--num_iters", "40"], ["loss became NaN/Inf at step", "--lr"],
         writes=True),
    # ---- environment and launcher
    Case("MASTER_PORT not a number", [], ["MASTER_PORT='abc' is not an integer"],
         env={**LAUNCH, "MASTER_PORT": "abc"}),
    Case("rank outside world", [], ["rank must be in"], env={**LAUNCH, "RANK": "2"}),
    Case("SLURM without a node list", [], ["MASTER_ADDR"], env={"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}),
    Case("world not divisible by tp", ["--tensor_parallel", "2"], ["world size 3 is not divisible"],
         env={**LAUNCH, "WORLD_SIZE": "3"}),
    Case("global batch not divisible by ranks", ["--global_batch_size", "10"], ["not divisible by data-parallel size 4"],
         env={**LAUNCH, "WORLD_SIZE": "4"}),
    Case("peer never joins", ["--rendezvous_timeout_s", "2"], ["timed out after 2 s", "rank 1 of 2 never joined"],
         env=LAUNCH),
    Case("model parallel on one process", ["--tensor_parallel", "2"], ["world size 1 is not divisible"],
         entry="train_mp.py"),
    Case("sp gradient bucketing without sequence parallelism", ["--sp_grad_bucketing", "true", "--tensor_parallel", "2"],
         ["--sp_grad_bucketing merges the gradient all-reduces that sequence parallelism adds",
          "add --tensor_parallel 2 (or more) --sequence_parallel true --enable_jit true"], env=LAUNCH),
    Case("async tp under CUDA graphs", ["--async_tp", "true", "--tensor_parallel", "2", "--sequence_parallel", "true",
                                        "--enable_jit", "true", "--compile_mode", "reduce-overhead"],
         ["--async_tp cannot run under CUDA graphs (--compile_mode reduce-overhead)",
          "use --compile_mode default or max-autotune-no-cudagraphs"], env=LAUNCH),
    Case("fp8 with tensor parallel", ["--amp_mode", "fp8", "--tensor_parallel", "2"],
         ["--amp_mode fp8 is not supported with tensor or context parallelism", "use --amp_mode bf16"], env=LAUNCH),
    # ---- tools
    Case("compare_runs on a folder without runs", ["--expdir", "{data}"], ["no run"], entry="tools.compare_runs"),
    Case("converter without its input", ["--input", "/nonexistent.nc", "--out", "{data}/x", "--variables", "t"],
         ["/nonexistent.nc"],
         entry="tools.convert_era5"),
    Case("generator with zero channels", ["--out", "{data}/x", "--channels", "0"], ["--channels"],
         entry="tools.make_synthetic_data", absent="{data}/x"),
    Case("generator with negative workers", ["--out", "{data}/x", "--workers", "-2"], ["--workers must be >= 1"],
         entry="tools.make_synthetic_data", absent="{data}/x"),
    Case("generator into an empty path", ["--out", ""], ["--out is empty"], entry="tools.make_synthetic_data",
         absent="train"),
    Case("converter on NaN input", ["--input", "{data}/nan.nc", "--out", "{data}/conv", "--variables", "t"],
         ["has 512 NaN/Inf value(s)"], spoil=_netcdf("nan", np.nan), entry="tools.convert_era5", absent="{data}/conv"),
    Case("converter without the static variable asked for",
         ["--input", "{data}/t.nc", "--out", "{data}/conv", "--variables", "t", "--static_variables", "lsm"],
         ["static variable(s) lsm not in the input; it has: t"], spoil=_netcdf("t", 250.0), entry="tools.convert_era5",
         absent="{data}/conv"),
    Case("converter into a path with a newline", ["--input", "x.nc", "--out", "a\nb", "--variables", "t"],
         ["contains the control character"], entry="tools.convert_era5"),
    Case("tuner on unreadable data", ["--config", "tiny", "--data_path", "{data}", "--expdir", "{data}/runs",
                                      "--tune_data", "real"], ["start_time='yesterday'"],
         spoil=_attribute("start_time", "yesterday"), entry="tools.tune_batch_size", absent="{data}/runs"),
    Case("export_model into an empty path", ["{data}", "--out", ""], ["--out is empty"], entry="tools.export_model"),
    Case("gpu_time on a missing trace", ["{data}/nope.json"], ["cannot read", "nope.json", "profile_step.py --trace"],
         entry="benchmarks/gpu_time.py"),
    Case("gpu_time on a file that is not JSON", ["{data}/stats/global_means.npy"],
         ["global_means.npy is not a JSON Chrome trace"], entry="benchmarks/gpu_time.py"),
    Case("gpu_time on JSON that is not a trace", ["{data}/events.json"], ["not a Chrome trace: no traceEvents list"],
         spoil=lambda data: (data / "events.json").write_text('{"events": []}') and [],
         entry="benchmarks/gpu_time.py"),
    Case("profile_diff on a file that is not profile_step's", ["{data}/stats/global_means.npy",
                                                               "{data}/stats/global_means.npy"],
         ["global_means.npy is not JSON", "name a JSON written by profile_step.py --out"],
         entry="benchmarks/profile_diff.py"),
    Case("rollout_skill on a run without a scorecard", ["--runs", "a={data}", "--out", "{data}/skill.json"],
         ["cannot read", "evaluation/scorecard.json", "run python evaluate.py --run_dir"],
         entry="benchmarks/rollout_skill.py", absent="{data}/skill.json"),
    Case("rollout_skill on a scorecard that is not one", ["--runs", "a={data}", "--out", "{data}/skill.json"],
         ["scorecard.json is not an evaluate.py scorecard", "it needs lead_hours"], spoil=_foreign_scorecard,
         entry="benchmarks/rollout_skill.py", absent="{data}/skill.json"),
    Case("rollout_skill runs without names", ["--runs", "{data}", "--out", "{data}/skill.json"],
         ["is not a new name=run_dir", "--runs k1="], entry="benchmarks/rollout_skill.py", absent="{data}/skill.json"),
    Case("tuner_accuracy adding to a file that is not its output", ["--name", "x", "--out",
                                                                     "{data}/stats/global_means.npy"],
         ["--out", "global_means.npy is not JSON", "name a new --out, or remove that file"],
         entry="benchmarks/tuner_accuracy.py"),
    Case("throughput with an unknown variant", ["--data_path", "{data}", "--variants", "opt_w9", "--out",
                                                "{data}/t.json"],
         ["--variants: no variant opt_w9", "did you mean opt_w8"], entry="benchmarks/throughput.py",
         absent="{data}/t.json"),
    Case("attention_plans with a head dim cuDNN cannot take", ["--head_dim", "50", "--out", "{data}/plans.json"],
         ["--head_dim 50 is not a multiple of 8", "use e.g. 48, 64 or 128"], entry="benchmarks/attention_plans.py",
         absent="{data}/plans.json"),
    Case("gc_pauses with no runs", ["--runs", "0", "--out", "{data}/gc.json"], ["--runs 0: give 1 or more"],
         entry="benchmarks/gc_pauses.py", absent="{data}/gc.json"),
    Case("gc_pauses on 2 ranks without data", ["--gpus", "2", "--expdir", "{data}/gc", "--out", "{data}/gc.json", "--",
                                                "--config", "tiny", "--data_path", "{data}/none"],
         ["the gc_freeze_false_0 run failed (exit status 1): data directory", "none/train does not exist"],
         entry="benchmarks/gc_pauses.py", absent="{data}/gc.json"),
    Case("gc_pauses on no GPUs", ["--gpus", "0", "--out", "{data}/gc.json"], ["--gpus 0: give 1 or more"],
         entry="benchmarks/gc_pauses.py", absent="{data}/gc.json"),
    Case("gc_pauses with a bad train.py option", ["--expdir", "{data}/gc", "--out", "{data}/gc.json", "--", "--config",
                                                   "tiny", "--data_path", "{data}", "--depth", "two"],
         ["--depth"], entry="benchmarks/gc_pauses.py", absent="{data}/gc"),
    Case("figure_cost with no runs", ["--runs", "0", "--out", "{data}/fc.json"], ["--runs 0: give 1 or more"],
         entry="benchmarks/figure_cost.py", absent="{data}/fc.json"),
    Case("figure_cost with 2 epochs", ["--runs", "1", "--expdir", "{data}/fc", "--out", "{data}/fc.json", "--",
                                       "--config", "tiny", "--data_path", "{data}", "--num_iters", "4",
                                       "--limit_nsamples", "16"],
         ["the run trained 2 epoch(s); give --num_iters for 3 or more epochs"], entry="benchmarks/figure_cost.py",
         absent="{data}/fc.json"),
    Case("check resuming a file that is not its output", ["--only", "tp", "--resume", "{data}/stats/global_means.npy",
                                                          "--out", "{data}/check.json"],
         ["--resume", "global_means.npy is not a JSON written by benchmarks/check.py"], entry="benchmarks/check.py",
         absent="{data}/check.json"),
]


def run_entry(entry: str, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``train.py``-style scripts or ``tools.*`` modules as a user would."""
    cmd = [str(ROOT / entry)] if entry.endswith(".py") else ["-m", entry]
    return run_forked([*cmd, *args], cwd, subprocess_env(**(env or {})))


def assert_one_line_error(proc: subprocess.CompletedProcess, needles: list[str]) -> None:
    # a note before it is no error: a test that overrides one of tests/jobs.py's RUN arguments gives it twice
    err = "\n".join(line for line in proc.stderr.strip().splitlines() if not line.startswith("note: "))
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in err and err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line(case, tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    extra = (case.spoil(data) or []) if case.spoil else []
    expdir = tmp_path / "runs"
    args = [a.replace("{data}", str(data)) for a in case.args]
    if case.entry.startswith("train"):
        args = ["--data_path", str(data), "--expdir", str(expdir), "--log_every", "1000", *extra, *args]
    env = {**case.env, "MASTER_PORT": case.env.get("MASTER_PORT", str(free_port()))} if case.env else None
    proc = run_entry(case.entry, args, tmp_path, env)
    assert_one_line_error(proc, case.needles)
    if not case.writes:  # checked before anything was created
        assert not expdir.exists(), list(expdir.rglob("*"))
    if case.absent:
        assert not (tmp_path / case.absent.replace("{data}", str(data))).exists()


def test_table_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("entry,args,note,status", [
    ("train.py", ["--lr", "1e-3", "--lr", "2e-3", "--print-config"], "--lr given twice (1e-3, then 2e-3); using 2e-3", 0),
    ("evaluate.py", ["--run_dir", "nowhere", "--lead_steps", "4", "--lead_steps", "2"],
     "--lead_steps given twice (4, then 2); using 2", 2),
    ("tools.compare_runs", ["--expdir", "a", "--expdir=nowhere"], "--expdir given twice (a, then nowhere); using nowhere",
     2),
])
def test_an_option_given_twice_is_one_note_naming_the_value_used(tmp_path, entry, args, note, status):
    proc = run_entry(entry, args, tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == status and lines[0] == f"note: {note}", proc.stderr
    assert len(lines) == (2 if status else 1) and "Traceback" not in proc.stderr, proc.stderr  # then its error, if any


# ---------------------------------------------------------------- errors on every rank
def test_data_error_is_one_line_on_every_rank(tmp_path):
    for proc in launch_entry(ROOT / "train.py", ["--data_path", str(tmp_path / "missing"), "--expdir",
                                                 str(tmp_path / "runs"), "--rendezvous_timeout_s", "60"], tmp_path, 2):
        assert_one_line_error(proc, ["missing/train does not exist"])
    assert not (tmp_path / "runs").exists()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def test_full_disk_during_checkpoint_stops_every_rank_with_one_line(tiny_data, tmp_path):
    """A real full filesystem (a 400 KiB tmpfs): the first sharded checkpoint does not fit; both ranks
    stop with one line naming the disk, the partial checkpoint is removed and run.json says failed."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "400k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        procs = launch_entry(ROOT / "train.py", ["--data_path", str(tiny_data), "--expdir", str(disk), "--num_iters",
                                                 "130", "--limit_nsamples", "128", "--log_every", "1000",
                                                 "--checkpoint_every_steps", "5"], tmp_path, 2)
        for proc in procs:  # every rank writes its own shards, so every rank meets the full disk
            assert_one_line_error(proc, ["writing checkpoint", "No space left on device", "free"])
        run_dir = next(disk.glob("tiny/2CPU/*"))
        assert not list(run_dir.glob("checkpoints/*.tmp")) and not list(run_dir.glob("checkpoints/step_*"))
        assert '"status": "failed"' in (run_dir / "run.json").read_text()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)


# ---------------------------------------------------------------- evaluate.py
# A tiny run validated with 3 rollout steps, checkpoints at steps 15 and 16 (the last 2 kept): the arguments of ROLLOUT_RUN in
# tests/e2e/test_evaluation.py, so a session that runs both files trains it once (tests/jobs.py reference_run).
# Its valid split is one file of 48 time steps (tests/conftest.py).
EVAL_RUN = ["--num_iters", "16", "--limit_nsamples_val", "null", "--valid_rollout_steps", "3",
            "--key_channels", "[u10m,t2m]", "--figure_every", "2"]


@dataclass
class EvalCase:
    id: str
    args: list[str]  # {run}: the trained run; {bare}: a run directory without checkpoints; {tmp}: the test's folder
    needles: list[str]


EVAL_CASES = [
    EvalCase("lead_steps 0", ["--run_dir", "{run}", "--lead_steps", "0"], ["--lead_steps must be at least 1, got 0"]),
    EvalCase("init_every 0", ["--run_dir", "{run}", "--lead_steps", "1", "--init_every", "0"],
             ["--init_every must be at least 1, got 0"]),
    EvalCase("missing run dir", ["--run_dir", "{tmp}/nope", "--lead_steps", "1"], ["run directory", "nope not found"]),
    EvalCase("run dir without checkpoints", ["--run_dir", "{bare}", "--lead_steps", "1"],
             ["no complete checkpoint in", "--save_checkpoint true"]),
    EvalCase("more lead steps than the split holds", ["--run_dir", "{run}", "--lead_steps", "48"],
             ["48 time steps, too few for 48 rollout steps", "use at most 47 rollout steps"]),
    EvalCase("step not saved", ["--run_dir", "{run}", "--lead_steps", "1", "--step", "999"],
             ["no complete checkpoint step_00000999", "complete steps: 10, 16", "--step"]),
    EvalCase("step and checkpoint", ["--run_dir", "{run}", "--lead_steps", "1", "--step", "5",
                                     "--checkpoint", "{run}/checkpoints/model.pt"], ["--step and --checkpoint"]),
    EvalCase("unknown channel", ["--run_dir", "{run}", "--lead_steps", "1", "--channels", "u10m,nope"],
             ["--channels nope", "u10m, v10m, t2m, sp"]),
    EvalCase("missing checkpoint file", ["--run_dir", "{run}", "--lead_steps", "1", "--checkpoint", "{tmp}/no.pt"],
             ["--checkpoint", "no.pt not found"]),
    EvalCase("unknown split", ["--run_dir", "{run}", "--lead_steps", "1", "--split", "test"],
             ["no split 'test'", "train, valid", "--split"]),
]


@pytest.fixture(scope="module")
def eval_run(tiny_data, tmp_path_factory) -> Path:
    from tests.jobs import reference_run
    return reference_run(tmp_path_factory, tiny_data, EVAL_RUN, 1)()


def _eval_args(args: list[str], run: Path, tmp_path: Path) -> list[str]:
    bare = tmp_path / "bare"  # the run's config without its checkpoints
    if not bare.exists():
        bare.mkdir()
        shutil.copy(run / "config.yaml", bare / "config.yaml")
    return [a.replace("{run}", str(run)).replace("{bare}", str(bare)).replace("{tmp}", str(tmp_path)) for a in args]


@pytest.mark.parametrize("case", EVAL_CASES, ids=[c.id for c in EVAL_CASES])
def test_evaluate_bad_input_is_one_line(case, eval_run, tmp_path):
    out = tmp_path / "out"
    proc = run_entry("evaluate.py", [*_eval_args(case.args, eval_run, tmp_path), "--out", str(out)], tmp_path)
    assert_one_line_error(proc, case.needles)
    assert not out.exists() and not (eval_run / "evaluation").exists()


def test_evaluate_error_is_one_line_on_every_rank(eval_run, tmp_path):
    args = ["--run_dir", str(eval_run), "--lead_steps", "48", "--out", str(tmp_path / "out")]
    for proc in launch_entry(ROOT / "evaluate.py", args, tmp_path, 2):
        assert_one_line_error(proc, ["use at most 47 rollout steps"])
    assert not (tmp_path / "out").exists()
