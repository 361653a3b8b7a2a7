"""Tests of the typed config (utils/config/schema.py, utils/config/loading.py) and config/ViT.yaml, plus the batch-size and
lr-schedule helpers."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ruamel.yaml import YAML

from utils.config.command_line import cli_config, config_list, full_help, key_help, markdown_flags
from utils.config.loading import load_config, parse_overrides, to_yaml
from utils.core.errors import UserError
from utils.config.schema import Config, KEYS
from utils.config.validate import Launch, batch_sizes, validate

REPO = Path(__file__).resolve().parents[2]
YAML_PATH = REPO / "config" / "ViT.yaml"
LADDER = [16, 32, 64, 128, 256, 512, 1024, 2048]
NAMES = (["base", "short", "short_opt", "opt"] + [f"bs{n}_opt" for n in LADDER]
         + ["mp", "vit_2b", "tiny", "tiny_curriculum", "era5_sample", "era5_uk"])


def load_cfg(name="base", **overrides) -> Config:
    return load_config(YAML_PATH, name, overrides)


def load(name="base", **overrides) -> SimpleNamespace:
    """Flat view of a loaded config (every key as an attribute, lists for tuples, plus ``config``)."""
    cfg = load_cfg(name, **overrides)
    return SimpleNamespace(**cfg.flat(), config=cfg.name)


@pytest.fixture(scope="module")
def base():
    return load("base")


# ---------------------------------------------------------------- the named configs
@pytest.mark.parametrize("name", NAMES)
def test_every_named_config_loads(name, base):
    p = load(name)
    assert p.config == name
    # the model it describes is valid
    h, w = p.img_size
    assert h % p.patch_size == 0 and w % p.patch_size == 0
    assert p.embed_dim % p.num_heads == 0
    assert p.n_in_channels == p.n_out_channels


def test_yaml_has_exactly_the_expected_configs():
    data = YAML(typ="safe", pure=True).load(YAML_PATH.read_text())
    assert set(data) == set(NAMES)


def test_base_values(base):
    assert base.nettype == "VisionTransformer"
    assert (base.embed_dim, base.depth, base.num_heads, base.patch_size) == (384, 12, 8, 8)
    assert base.mlp_ratio == 4.0
    assert base.n_in_channels == 20 and base.n_out_channels == 20
    assert base.img_size == [360, 720]
    assert base.global_batch_size == 16
    assert base.local_batch_size is None
    assert base.lr == pytest.approx(5e-4) and isinstance(base.lr, float)
    assert base.betas == [0.9, 0.95]
    assert base.lr_schedule == "cosine"
    assert base.num_iters == 30000
    assert base.dt == 1
    assert base.limit_nsamples is None and base.limit_nsamples_val is None
    assert base.amp_mode == "none" and base.enable_fused is False and base.enable_jit is False
    assert base.grad_accum_steps == 1
    assert base.run_num == "auto"  # a string: the next free run number


def test_short_configs():
    short = load("short")
    assert (short.limit_nsamples, short.limit_nsamples_val, short.num_iters) == (512, 128, 128)
    assert short.embed_dim == 384  # inherited from base
    short_opt = load("short_opt")
    assert (short_opt.limit_nsamples, short_opt.limit_nsamples_val, short_opt.num_iters) == (512, 128, 128)
    for p in (short_opt, load("opt")):
        assert p.data_loader_config == "dali"
        assert p.amp_mode == "bf16_pure"
        assert p.enable_fused is True and p.enable_jit is True
        assert p.num_data_workers == 8
    assert load("opt").num_iters == 30000


@pytest.mark.parametrize("n", LADDER)
def test_batch_size_ladder(n):
    p = load(f"bs{n}_opt")
    assert p.global_batch_size == n
    assert p.lr == pytest.approx(5e-4 * math.sqrt(n / 16), rel=0.01)
    # same number of samples seen (same epochs): iterations scale as 16 / N
    assert p.num_iters * n == pytest.approx(30000 * 16, rel=0.01)
    assert p.amp_mode == "bf16_pure" and p.data_loader_config == "dali"


def vit_param_count(p) -> int:
    """Parameters of networks/vit.py's VisionTransformer, counted from the config."""
    d, c_in, c_out, k = p.embed_dim, p.n_in_channels, p.n_out_channels, p.patch_size
    hidden = int(d * p.mlp_ratio)
    n = (p.img_size[0] // k) * (p.img_size[1] // k)
    embed = c_in * k * k * d + d + n * d
    block = (2 * d  # norm1
             + d * 3 * d + 3 * d  # qkv
             + d * d + d  # proj
             + 2 * d  # norm2
             + d * hidden + hidden + hidden * d + d)  # mlp
    head = 2 * d + d * c_out * k * k + c_out * k * k  # norm + head
    return embed + p.depth * block + head


def test_param_formula_matches_a_real_model():
    from networks.vit import build_model

    p = load("tiny")
    cfg = load_cfg("tiny")
    assert vit_param_count(p) == sum(t.numel() for t in build_model(cfg.model, cfg.data).parameters())


def test_vit_2b_size():
    from networks.vit import build_model

    p = load("vit_2b")
    assert (p.embed_dim, p.depth, p.num_heads) == (2560, 24, 20)
    assert p.activation_checkpointing == "full"
    assert p.limit_nsamples == 512  # inherited from mp
    n = vit_param_count(p)
    assert 1.8e9 <= n <= 2.2e9
    cfg = load_cfg("vit_2b")
    with torch.device("meta"):  # no memory: just shapes
        model = build_model(cfg.model, cfg.data)
    assert sum(t.numel() for t in model.parameters()) == n


def test_mp_config():
    p = load("mp")
    assert p.embed_dim == 1024 and p.num_heads == 8
    assert p.amp_mode == "bf16_pure"  # from opt


def test_tiny_and_sample_configs():
    tiny = load("tiny")
    assert tiny.img_size == [32, 64] and tiny.n_in_channels == 4 and tiny.patch_size == 4
    assert tiny.data_loader_config == "pytorch" and tiny.amp_mode == "none"
    sample = load("era5_sample")
    assert sample.img_size == [60, 120]
    assert sample.embed_dim == tiny.embed_dim and sample.n_in_channels == 4  # from tiny
    uk = load("era5_uk")  # make uk_sample: t2m on the 32 x 48 grid of --trim_to_multiple 8, hourly
    assert uk.img_size == [32, 48] and uk.n_in_channels == uk.n_out_channels == 1 and uk.data_path == "data/era5_uk"
    assert uk.embed_dim == tiny.embed_dim and uk.dt == 1


# ---------------------------------------------------------------- overrides
def test_int_override():
    p = load(depth="6", num_data_workers="2")
    assert p.depth == 6 and type(p.depth) is int
    assert p.num_data_workers == 2
    assert load(depth="6.0").depth == 6  # integral floats are fine


@pytest.mark.parametrize("raw,want", [("1e-3", 1e-3), ("0.002", 2e-3), ("3", 3.0), ("5.0E-4", 5e-4)])
def test_float_override(raw, want):
    p = load(lr=raw)
    assert type(p.lr) is float
    assert p.lr == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("raw,want", [("true", True), ("false", False), ("False", False), ("1", True),
                                      ("0", False), ("yes", True), ("off", False)])
def test_bool_override(raw, want):
    assert load(enable_fused=raw).enable_fused is want


def test_bare_flag_means_true():
    ov = parse_overrides(["--enable_fused", "--depth", "3"])
    assert ov == {"enable_fused": "true", "depth": "3"}
    p = load("base", **ov)
    assert p.enable_fused is True and p.depth == 3
    # a flag followed by another option is still a flag
    assert parse_overrides(["--enable_jit", "--enable_fused"]) == {"enable_jit": "true", "enable_fused": "true"}
    # and false can be given explicitly, turning off what a config turned on
    assert load("opt", **parse_overrides(["--enable_jit", "false"])).enable_jit is False


@pytest.mark.parametrize("raw", ["[180,360]", "180,360", "[180, 360]"])
def test_list_override(raw):
    p = load(img_size=raw)
    assert p.img_size == [180, 360]
    assert all(type(v) is int for v in p.img_size)


def test_float_list_override():
    assert load(betas="0.8,0.99").betas == [0.8, 0.99]


def test_nullable_int_override():
    assert load(limit_nsamples="100").limit_nsamples == 100
    assert load(limit_nsamples="null").limit_nsamples is None
    assert load(local_batch_size="4").local_batch_size == 4
    assert load(local_batch_size="none").local_batch_size is None


def test_nullable_key_can_be_reset_to_null_where_a_config_sets_it():
    # short sets limit_nsamples: 512; --limit_nsamples null must bring back "all samples"
    p = load("short", limit_nsamples="null")
    assert p.limit_nsamples is None
    assert load("short", limit_nsamples="64").limit_nsamples == 64


def test_string_overrides():
    assert load(run_num="7").run_num == "7"
    assert load(plot_channel="t850").plot_channel == "t850"
    assert load(amp_mode="bf16").amp_mode == "bf16"


def test_key_equals_value_form():
    ov = parse_overrides(["--lr=1e-3", "--img_size=[180,360]", "--local-batch-size=2"])
    assert ov == {"lr": "1e-3", "img_size": "[180,360]", "local_batch_size": "2"}
    p = load("base", **ov)
    assert p.lr == pytest.approx(1e-3) and p.img_size == [180, 360] and p.local_batch_size == 2


def test_overrides_do_not_leak_between_loads():
    load(depth="3")
    assert load().depth == 12


# ---------------------------------------------------------------- errors
def test_unknown_key_suggests_the_closest():
    with pytest.raises(UserError, match="unknown config key --embed_dm") as exc:
        load(embed_dm="3")
    assert "did you mean" in str(exc.value) and "embed_dim" in str(exc.value)
    with pytest.raises(UserError, match="did you mean.*lr_schedule"):
        load(lr_schedul="constant")


@pytest.mark.parametrize("key,raw,pattern", [
    ("depth", "abc", "--depth expects an integer"),
    ("depth", "6.5", "--depth expects an integer"),
    ("depth", "true", "--depth expects an integer"),
    ("lr", "fast", "--lr expects a number"),
    ("lr", "nan", "--lr expects a finite number"),
    ("enable_fused", "maybe", "--enable_fused expects true or false"),
    ("sequence_parallel", "maybe", "--sequence_parallel expects true or false"),
    ("img_size", "[1,2,3]", "--img_size expects a list of 2"),
    ("img_size", "360", "--img_size expects a list of 2"),
    ("img_size", "[a,b]", "--img_size expects an integer"),
    ("limit_nsamples", "lots", "--limit_nsamples expects an integer"),
    ("depth", "null", "--depth expects an integer"),
    # per-key ranges
    ("depth", "0", "--depth must be >= 1, got 0"),
    ("dt", "0", "--dt must be >= 1"),
    ("num_iters", "-5", "--num_iters must be >= 1"),
    ("limit_nsamples", "0", "--limit_nsamples must be >= 1"),
    ("global_batch_size", "0", "--global_batch_size must be >= 1"),
    ("patch_size", "0", "--patch_size must be >= 1"),
    ("valid_every", "0", "--valid_every must be >= 1"),
    ("lr", "-1", "--lr must be > 0"),
    ("betas", "[0.9,1.5]", "--betas must be in \\[0, 1\\)"),
    ("img_size", "[0,64]", "--img_size must be >= 1"),
])
def test_wrong_type(key, raw, pattern):
    with pytest.raises(UserError, match=pattern):
        load(**{key: raw})


@pytest.mark.parametrize("key,raw", [("amp_mode", "fp4"), ("lr_schedule", "linear"), ("fsdp", "zero1"),
                                     ("nettype", "ResNet"), ("data_loader_config", "ffcv")])
def test_bad_choice(key, raw):
    with pytest.raises(UserError, match=f"--{key} must be one of") as exc:
        load(**{key: raw})
    assert raw in str(exc.value)


def test_unknown_config_name():
    with pytest.raises(UserError, match="'tinyy' not in") as exc:
        load("tinyy")
    msg = str(exc.value)
    assert "did you mean tiny" in msg
    assert "(python train.py --list-configs lists them all)" in msg and "vit_2b" not in msg


def test_unknown_config_name_of_a_large_file_names_the_nearest_few(tmp_path):
    path = _yaml(tmp_path, "".join(f"run{i:05d}:\n  lr: 1.0e-3\n" for i in range(2_000)))
    with pytest.raises(UserError) as exc:
        load_config(path, "run0042")
    msg = str(exc.value)  # not every name (18 KB): the nearest three and how to list the rest
    assert len(msg) < 300 and msg.count("run0") == 4, msg
    assert f"(python train.py --list-configs --yaml_config {path} lists them all)" in msg


def test_missing_yaml_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.yaml", "base")


def test_malformed_yaml_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: [1, 2\n  x: {")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad, "base")
    flat = tmp_path / "flat.yaml"
    flat.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="must map config names"):
        load_config(flat, "base")


def test_bad_command_line_arguments():
    with pytest.raises(UserError, match="unexpected argument 'lr'"):
        parse_overrides(["lr", "1e-3"])
    with pytest.raises(UserError, match="unexpected argument"):
        parse_overrides(["--"])


# ---------------------------------------------------------------- to_yaml
@pytest.mark.parametrize("name", ["base", "vit_2b", "tiny"])
def test_to_yaml_round_trip(name, tmp_path):
    cfg = load_cfg(name, img_size="[16,32]", lr="1e-3", limit_nsamples="null", enable_fused="true", run_num="00")
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    back = load_config(path, name)  # the saved config is itself a loadable named config
    assert back.flat() == cfg.flat()
    assert back.logging.run_num == "00" and back.data.img_size == (16, 32) and back.data.limit_nsamples is None
    raw = YAML(typ="safe", pure=True).load(path.read_text())[name]
    assert raw == cfg.flat()


# ---------------------------------------------------------------- batch_sizes and lr_lambda
@pytest.fixture(scope="module")
def train_step_mod():
    from training.loop import step as train_step

    return train_step


@pytest.mark.parametrize("overrides,dp,want", [
    ({}, 1, (16, 16)),
    ({}, 4, (4, 16)),
    ({}, 16, (1, 16)),
    ({"global_batch_size": "64", "grad_accum_steps": "2"}, 4, (8, 64)),
    ({"grad_accum_steps": "4"}, 2, (2, 16)),
    ({"local_batch_size": "5"}, 3, (5, 15)),  # local wins, even where global would not divide
    ({"local_batch_size": "3", "grad_accum_steps": "2"}, 2, (3, 12)),
])
def test_batch_sizes(overrides, dp, want):
    optim = load_cfg(**overrides).optim
    local, glob = batch_sizes(optim, dp)
    assert (local, glob) == want
    assert glob == local * dp * optim.grad_accum_steps


@pytest.mark.parametrize("overrides,dp", [({}, 3), ({}, 32), ({"grad_accum_steps": "3"}, 1),
                                          ({"grad_accum_steps": "4"}, 8)])
def test_batch_sizes_not_divisible(overrides, dp):
    with pytest.raises(UserError, match="not divisible") as exc:
        batch_sizes(load_cfg(**overrides).optim, dp)
    assert "--local_batch_size" in str(exc.value)


def test_batch_sizes_rejects_zero_accumulation():
    with pytest.raises(UserError, match="grad_accum_steps must be >= 1"):
        load_cfg(grad_accum_steps="0")


def test_lr_warmup_then_cosine(train_step_mod):
    f = train_step_mod.lr_lambda(load_cfg(warmup="10", num_iters="110", lr_schedule="cosine").optim)
    # linear warmup reaching 1 at the end of warmup
    assert [f(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.5)  # half-way through the decay
    assert f(35) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    decay = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert f(109) < 1e-3
    assert f(110) == pytest.approx(0.0, abs=1e-12)
    assert f(500) == pytest.approx(0.0, abs=1e-12)  # stays at 0 past the end


def test_lr_cosine_without_warmup(train_step_mod):
    f = train_step_mod.lr_lambda(load_cfg(num_iters="100").optim)
    assert f(0) == pytest.approx(1.0)
    assert f(50) == pytest.approx(0.5)
    assert f(100) == pytest.approx(0.0, abs=1e-12)


def test_lr_constant(train_step_mod):
    f = train_step_mod.lr_lambda(load_cfg(lr_schedule="constant", warmup="4", num_iters="100").optim)
    assert f(0) == pytest.approx(0.25) and f(3) == pytest.approx(1.0)
    assert all(f(s) == 1.0 for s in (4, 50, 99, 100, 1000))


def test_lr_lambda_drives_lambda_lr(train_step_mod):
    p = load_cfg(warmup="2", num_iters="10", lr="1e-2").optim
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=p.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train_step_mod.lr_lambda(p))
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(5e-3) and lrs[1] == pytest.approx(1e-2)
    assert lrs[-1] < 1e-3 * 0.5


# ---------------------------------------------------------------- the schema decides types, not the YAML
def _yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_types_come_from_the_schema_not_the_yaml_spelling(tmp_path):
    path = _yaml(tmp_path, "a:\n  max_grad_norm: 1\n  lr: 1\n  run_num: 7\n  img_size: [16, 32]\n")
    cfg = load_config(path, "a", {"max_grad_norm": "0.5"})  # was 'expects int' when types came from YAML
    assert cfg.optim.max_grad_norm == 0.5 and type(cfg.optim.lr) is float and cfg.optim.lr == 1.0
    assert cfg.logging.run_num == "7" and cfg.data.img_size == (16, 32)
    assert type(load_config(path, "a").optim.max_grad_norm) is float


def test_numbers_are_decimal_and_other_spellings_stay_text(tmp_path):
    path = _yaml(tmp_path, "a:\n  lr: 1.0e-3\n  num_iters: 1e3\n  depth: +3\n  seed: 007\n  run_num: 0x10\n")
    cfg = load_config(path, "a")
    assert (cfg.optim.lr, cfg.optim.num_iters, cfg.model.depth, cfg.optim.seed) == (1e-3, 1000, 3, 7)
    assert cfg.logging.run_num == "0x10"  # a string key keeps the text as written, not "16"
    for raw in ("0x10", "1_0", "0b11", "0o17"):  # the command line as the YAML
        with pytest.raises(UserError, match="in plain decimal digits"):
            load_cfg(num_iters=raw)
    with pytest.raises(UserError, match=r"--img_size expects an integer in plain decimal digits"):
        load_cfg(img_size="[0x20,64]")
    with pytest.raises(UserError, match=r"config a: lr expects a finite number"):  # YAML's own NaN
        load_config(_yaml(tmp_path, "a:\n  lr: .nan\n"), "a")


def test_keys_left_out_of_the_yaml_take_the_schema_default(tmp_path):
    cfg = load_config(_yaml(tmp_path, "a:\n  depth: 3\n"), "a")
    assert cfg.model.depth == 3 and cfg.model.embed_dim == 384 and cfg.parallel.rendezvous_timeout_s == 300.0


@pytest.mark.parametrize("text,pattern", [
    ("a:\n  lr: fast\n", r"c.yaml, config a: lr expects a number \(FLOAT\), got 'fast'"),
    ("a:\n  depth: true\n", r"config a: depth expects an integer"),
    ("a:\n  img_size: 64\n", r"config a: img_size expects a list like"),
    ("a:\n  amp_mode: fp4\n", r"config a: amp_mode must be one of none, fp16, bf16, bf16_pure, fp8"),
    ("a:\n  depht: 3\n", r"config a: unknown config key depht; did you mean depth"),
    ("a:\n  depth: 0\n", r"--depth must be >= 1, got 0"),
    # a key repeated inside a config that also uses a merge key: YAML would keep the last silently
    ("b: &b\n  depth: 2\na:\n  <<: *b\n  lr: 1.0e-3\n  lr: 2.0e-3\n", r"line 6: key 'lr' repeats the one on line 5"),    # numbers that YAML (and Python) read in other bases or with underscores: lr 0x10 would train at 16
    ("a:\n  lr: 0x10\n", r"config a: lr expects a number in plain decimal digits \(FLOAT\), got '0x10'"),
    ("a:\n  num_iters: 0b11\n", r"config a: num_iters expects an integer in plain decimal digits"),
    ("a:\n  num_iters: 1_0\n", r"config a: num_iters expects an integer in plain decimal digits"),
    ("a:\n  img_size: [0o40, 64]\n", r"config a: img_size expects an integer in plain decimal digits"),
    ("a:\n  lr: 1_0.5\n", r"config a: lr expects a number in plain decimal digits"),
    ("a:\n  lead_steps: 4\n", r"config a: --lead_steps is an option of evaluate.py .*--valid_rollout_steps"),
])
def test_bad_yaml_values_name_file_config_and_key(tmp_path, text, pattern):
    with pytest.raises(UserError, match=pattern):
        load_config(_yaml(tmp_path, text), "a")


def test_every_named_config_has_its_own_one_line_description():
    from ruamel.yaml import YAML as RoundTrip
    raw = RoundTrip().load(YAML_PATH.read_text())  # round-trip keeps merge keys apart from own keys
    for name, settings in raw.items():
        own = dict(settings.non_merged_items())
        assert own.get("description") and "\n" not in own["description"], name


def test_an_option_given_twice_takes_the_last_value_and_says_so(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    # submit_pm.sh passes --data_path/--expdir defaults before the user's arguments
    assert parse_overrides(["--lr", "1", "--expdir", "a", "--lr=2"]) == {"lr": "2", "expdir": "a"}
    assert capsys.readouterr().err == "note: --lr given twice (1, then 2); using 2\n"
    parse_overrides(["--lr", "1", "--local-batch-size", "2", "--local_batch_size", "4", "--lr", "1"])
    assert capsys.readouterr().err == "note: --local_batch_size given twice (2, then 4); using 4\n"  # lr: same value
    monkeypatch.setenv("RANK", "1")  # rank 0 speaks for the job
    parse_overrides(["--lr", "1", "--lr", "2"])
    assert capsys.readouterr().err == ""


def test_the_tools_parsers_say_which_of_repeated_values_they_use(capsys, monkeypatch):
    """One mechanism for every command line: the project's ArgumentParser (evaluate.py, tools.*) and torchrun's."""
    from torch.distributed.run import get_args_parser

    from training.evaluation.evaluate_run import build_parser
    from utils.core.errors import note_repeated, option_values
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    args = build_parser().parse_args(["--run_dir", "r", "--lead_steps", "4", "--lead_steps=2", "--save_forecasts",
                                      "--save_forecasts"])
    assert args.lead_steps == 2
    assert capsys.readouterr().err == "note: --lead_steps given twice (4, then 2); using 2\n"
    torchrun = ["--nproc_per_node", "2", "--nproc-per-node", "4", "train.py", "--nproc_per_node", "8"]
    assert option_values(get_args_parser(), torchrun) == {"--nproc-per-node": ["2", "4"]}  # not train.py's
    note_repeated({"--x": ["1", "2", "3"]})
    assert capsys.readouterr().err == "note: --x given 3 times (1, then 2, then 3); using 3\n"


def test_a_value_that_looks_like_an_option_is_an_error():
    with pytest.raises(UserError, match=r"--run_num -x: '-x' looks like an option, not a value"):
        parse_overrides(["--run_num", "-x"])
    with pytest.raises(UserError, match=r"--run_num needs a value: --run_num STR"):
        parse_overrides(["--run_num", "--lr", "1e-3"])  # was a run named "true"
    with pytest.raises(UserError, match=r"--depth needs a value: --depth INT"):
        parse_overrides(["--depth"])
    assert parse_overrides(["--lr", "-1", "--seed", "-1e3", "--enable_jit", "--memory_snapshot_on_oom"]) == {
        "lr": "-1", "seed": "-1e3", "enable_jit": "true", "memory_snapshot_on_oom": "true"}  # numbers, flags
    for run_id in ("-x", ".x", "_x"):
        with pytest.raises(UserError, match="must be a plain name that starts with a letter or digit"):
            validate(load_cfg("tiny", run_num=run_id), Launch())


# ---------------------------------------------------------------- cross-field validation
A100, H100 = Launch(cuda=True, cuda_capability=(8, 0)), Launch(cuda=True, cuda_capability=(9, 0))


@pytest.mark.parametrize("overrides,launch,pattern", [
    ({"img_size": "[30,64]", "patch_size": "4"}, Launch(), r"img_size \[30,64\] is not a multiple of patch_size 4"),
    ({"num_heads": "5"}, Launch(), "embed_dim 384 is not divisible by num_heads 5"),
    ({"n_out_channels": "3"}, Launch(), "n_out_channels 3 must equal n_in_channels 20"),
    ({"tensor_parallel": "2"}, Launch(world_size=3), "world size 3 is not divisible by tensor_parallel"),
    ({"global_batch_size": "10"}, Launch(world_size=4), "global_batch_size 10 is not divisible"),
    ({"attention_backend": "cudnn", "amp_mode": "bf16"}, Launch(cuda=False), "needs a CUDA GPU"),
    ({"attention_backend": "cudnn"}, Launch(cuda=True), "runs only in bf16/fp16, but --amp_mode is none"),
    ({"attention_backend": "flash"}, Launch(cuda=True), "runs only in bf16/fp16"),
    ({"compile_mode": "max-autotune"}, Launch(), "has no effect without --enable_jit"),
    ({"fsdp_cpu_offload": "true"}, Launch(world_size=2), "needs FSDP over more than one data-parallel rank"),
    ({"fsdp_cpu_offload": "true", "fsdp": "zero3"}, Launch(world_size=1), "needs FSDP over more than one"),
    ({"fsdp_cpu_offload": "true", "fsdp": "zero3"}, Launch(world_size=2), "no GPU is visible"),
    ({"fsdp_cpu_offload": "true", "fsdp": "zero3", "tensor_parallel": "2"}, Launch(world_size=4, cuda=True),
     "not supported with tensor or context parallelism"),
    ({"fsdp_cpu_offload": "true", "fsdp": "zero3", "amp_mode": "fp16"}, Launch(world_size=2, cuda=True),
     "use --amp_mode bf16"),
    ({"fsdp": "hsdp", "hsdp_shard_size": "3"}, Launch(world_size=4), "--hsdp_shard_size 3 must divide"),
    ({"context_parallel": "2", "cp_attention": "ring"}, Launch(world_size=2, cuda=True),
     "--cp_attention ring runs FlashAttention-2 or cuDNN on GPUs, which need bf16 or fp16, but --amp_mode is none"),
    ({"context_parallel": "2", "cp_attention": "ring", "amp_mode": "bf16", "attention_backend": "efficient"},
     Launch(world_size=2, cuda=True), "not --attention_backend efficient"),
    ({"context_parallel": "2", "cp_attention": "ring", "amp_mode": "bf16", "num_heads": "1"},
     Launch(world_size=2, cuda=True), "needs a head dim up to 256 on GPUs .* embed_dim / num_heads is 384"),
    ({"sp_grad_bucketing": "true", "tensor_parallel": "2", "enable_jit": "true"}, Launch(world_size=2),
     "--sp_grad_bucketing merges the gradient all-reduces that sequence parallelism adds, in compiled graphs; add "
     "--tensor_parallel 2"),
    ({"sp_grad_bucketing": "true", "tensor_parallel": "2", "sequence_parallel": "true"}, Launch(world_size=2),
     "or drop --sp_grad_bucketing"),
    ({"activation_checkpointing": "selective", "ac_blocks": "13"}, Launch(),
     "--ac_blocks 13 exceeds the model depth 12"),
    ({"run_num": "a/b"}, Launch(), "must be a plain name"),
    # --amp_mode fp8: a Hopper GPU, no TP/CP or CPU offload, widths of multiples of 16; its keys need it
    ({"amp_mode": "fp8"}, Launch(), r"compute capability 9.0 \(Hopper\) or newer, but no CUDA GPU is visible; "
                                    "use --amp_mode bf16"),
    ({"amp_mode": "fp8"}, A100, "compute capability 9.0 .* but this GPU's is 8.0; use --amp_mode bf16"),
    ({"amp_mode": "fp8", "tensor_parallel": "2"}, Launch(2, True, (9, 0)), "fp8 is not supported with tensor or"),
    ({"amp_mode": "fp8", "context_parallel": "2"}, Launch(2, True, (9, 0)), "fp8 is not supported with tensor or"),
    ({"amp_mode": "fp8", "fsdp": "zero3", "fsdp_cpu_offload": "true"}, Launch(2, True, (9, 0)),
     "fp8 is not supported with --fsdp_cpu_offload"),
    ({"amp_mode": "fp8", "embed_dim": "392"}, H100, "multiples of 16, but embed_dim is 392 and the MLP hidden "
                                                     r"width \(embed_dim x mlp_ratio\) 1568"),
    ({"amp_mode": "fp8", "mlp_ratio": "4.1"}, H100, "multiples of 16, but embed_dim is 384 and the MLP .* 1574"),
    ({"fp8_recipe": "rowwise"}, H100, "--fp8_recipe has no effect without --amp_mode fp8; add --amp_mode fp8 or drop"),
    ({"fp8_all_gather": "false", "amp_mode": "bf16"}, H100, "--fp8_all_gather has no effect without --amp_mode fp8"),
    ({"fp8_save_scales": "false"}, H100, "--fp8_save_scales has no effect without --amp_mode fp8"),
])
def test_cross_field_checks(overrides, launch, pattern):
    with pytest.raises(UserError, match=pattern):
        validate(load_cfg(**overrides), launch)


def test_valid_settings_pass_validation(tmp_path):
    validate(load_cfg("tiny", expdir=str(tmp_path / "new" / "dir")), Launch())
    validate(load_cfg("short_opt", expdir=str(tmp_path)), Launch(world_size=1, cuda=True))
    validate(load_cfg("mp", fsdp="zero3", fsdp_cpu_offload="true", expdir=str(tmp_path)),
             Launch(world_size=2, cuda=True))
    validate(load_cfg("mp", context_parallel="2", cp_attention="ring", expdir=str(tmp_path)),
             Launch(world_size=2, cuda=True))
    validate(load_cfg("tiny", tensor_parallel="2", sequence_parallel="true", enable_jit="true",
                      sp_grad_bucketing="true", expdir=str(tmp_path)), Launch(world_size=2))


def test_fp8_passes_on_hopper_with_its_keys(tmp_path):
    pytest.importorskip("torchao")
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        validate(load_cfg("short_opt", amp_mode="fp8", fp8_recipe=recipe, expdir=str(tmp_path)), H100)
    validate(load_cfg("short", amp_mode="fp8", fsdp="zero3", fp8_all_gather="false", expdir=str(tmp_path)),
             Launch(2, True, (10, 0)))


def test_fp8_without_torchao_names_the_extra(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "torchao" else find_spec(name, *args))
    with pytest.raises(UserError, match=r"--amp_mode fp8 needs torchao: pip install -e '\.\[fp8\]'"):
        validate(load_cfg(amp_mode="fp8"), H100)


def test_expdir_that_is_a_file_or_read_only_is_rejected(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="is a file, not a directory"):
        validate(load_cfg("tiny", expdir=str(blocker / "runs")), Launch())


# ---------------------------------------------------------------- help, config list, flag table
def test_help_lists_every_key_by_section_within_80_columns():
    text = full_help()
    assert all(len(line) <= 80 for line in text.splitlines()), [line for line in text.splitlines() if len(line) > 80]
    for title in ("model:", "data:", "optimization:", "precision and speed:", "parallelism:", "checkpointing:",
                  "logging and profiling:", "evaluation:"):
        assert f"\n{title}\n" in text
    for name, spec in KEYS.items():
        assert f"--{name} " in text, name
    assert "--amp_mode {none,fp16,bf16,bf16_pure,fp8}  (default none)" in text
    assert "--local_batch_size INT or {auto} or null  (default null)" in text
    assert "--config NAME          named config (default tiny; --list-configs lists them)" in text
    assert "(default mp; --list-configs lists them)" in full_help("train_mp.py", "mp")  # each entry point's own default


def test_help_for_one_key():
    text = key_help("local_batch_size")
    assert text.splitlines()[0] == "--local_batch_size INT or {auto} or null"
    assert "section: optimization" in text and "default: null" in text and "allowed: >= 1 or auto" in text
    assert all(len(line) <= 80 for line in text.splitlines())
    backend = key_help("attention_backend")
    assert "set by named configs:" in backend and "short_opt cudnn" in backend
    with pytest.raises(UserError, match="did you mean local_batch_size"):
        key_help("local_batch")


def test_cli_actions_return_none_after_printing(capsys):
    assert cli_config(["--help"], "tiny") is None
    assert "usage: python train.py" in capsys.readouterr().out
    assert cli_config(["--help", "lr"], "tiny") is None
    assert capsys.readouterr().out.startswith("--lr FLOAT")
    assert cli_config(["--list-configs"], "tiny") is None
    listing = capsys.readouterr().out.splitlines()
    assert len(listing) == len(NAMES) and listing[0].startswith("base ") and all(len(line) <= 80 for line in listing)
    assert cli_config(["--config", "tiny", "--lr", "3e-3", "--print-config"], "tiny") is None
    printed = YAML(typ="safe", pure=True).load(capsys.readouterr().out)
    assert printed["tiny"]["lr"] == 3e-3 and printed["tiny"]["depth"] == 2
    cfg = cli_config(["--config", "short", "--depth", "3"], "tiny")
    assert cfg.name == "short" and cfg.model.depth == 3


def test_config_list_names_every_config():
    names = [line.split()[0] for line in config_list(YAML_PATH).splitlines()]
    assert names == NAMES


def test_docs_flag_table_is_generated_from_the_schema(tmp_path):
    from utils.config.command_line import FLAGS_DOC, update_docs
    docs = FLAGS_DOC.read_text()
    block = re.search(r"<!-- flags:start -->\n(.*?)\n<!-- flags:end -->", docs, re.S)
    assert block, f"{FLAGS_DOC} lacks the generated flag table markers"
    assert block.group(1) == markdown_flags(), \
        "docs/configs.md flag table is stale: run python -m utils.config.command_line --update-docs"
    assert "flags:start" not in (REPO / "README.md").read_text()  # one generated table, in the docs
    stale = tmp_path / "configs.md"
    stale.write_text("# Configs\n<!-- flags:start -->\n| old |\n<!-- flags:end -->\nafter\n")
    update_docs(stale)
    assert stale.read_text() == f"# Configs\n<!-- flags:start -->\n{markdown_flags()}\n<!-- flags:end -->\nafter\n"
    stale.write_text("no markers\n")
    with pytest.raises(UserError, match="needs one <!-- flags:start -->"):
        update_docs(stale)
