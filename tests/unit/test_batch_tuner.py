"""The batch-size tuner's search core (training/tuner/search.py) against a fake step with a memory model: the
boundary within the promised number of trials, the choices, the deadline, the agreement of two gloo ranks,
the learning-rate rule, the train.py arguments and the report files; and the CPU trials' host heap setting."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from distributed.launch import LaunchEnv
from distributed.world import World
from tests.dist_utils import run_distributed, subprocess_env
from tests.forked import run_forked
from training.tuner.report import plot, report_table, save_json
from training.tuner.tune import short_epochs, short_runs
from training.tuner.search import NoCleanTrial, OBJECTIVES, Trial, agree, choice_args, choose, combine, scaled_lr, search
from utils.config.command_line import cli_config
from utils.config.loading import load_config

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3
WORLD = World(LaunchEnv(), torch.device("cpu"))  # one process: no collective


@dataclass
class Fake:
    """A step with memory ``base + per_sample * batch`` GiB: allocator retries above ``retry_gib``, OOM above
    ``oom_gib``; samples/s rise and saturate (``rate * b / (b + 16)``), 30 % lower in the retry zone.
    ``calls`` records every batch it was asked to run."""

    base_gib: float = 2.0
    per_sample_gib: float = 0.75
    retry_gib: float = 72.0
    oom_gib: float = 80.0
    rate: float = 200.0
    dp: int = 1
    calls: list[int] = field(default_factory=list)

    def memory_gib(self, batch: int) -> float:
        return self.base_gib + self.per_sample_gib * batch

    def clean(self, batch: int) -> bool:
        return self.memory_gib(batch) <= self.retry_gib

    def __call__(self, batch: int) -> Trial:
        self.calls.append(batch)
        mem = self.memory_gib(batch)
        trial = Trial(batch, batch * self.dp, peak_allocated_bytes=int(0.9 * mem * GIB),
                      peak_reserved_bytes=int(mem * GIB), inactive_split_bytes=int(0.05 * mem * GIB))
        if mem > self.oom_gib:
            return replace(trial, ooms=1)
        retrying = mem > self.retry_gib
        rate = self.rate * batch / (batch + 16) * (0.7 if retrying else 1.0)
        return replace(trial, samples_per_s=rate, step_time_s=batch * self.dp / rate, mfu=rate / 1000,
                       alloc_retries=3 if retrying else 0)


def batches(trials: list[Trial]) -> list[int]:
    return [t.local_batch_size for t in trials]


def largest_clean(trials: list[Trial]) -> int:
    return max((t.local_batch_size for t in trials if t.clean), default=0)


@pytest.mark.parametrize("fake, start, max_batch", [
    (Fake(), 8, 4096),                      # retries from 96, OOM from 112: the boundary is 88
    (Fake(per_sample_gib=0.3), 8, 4096),    # boundary 232, between the doublings 128 and 256
    (Fake(per_sample_gib=2.5), 16, 4096),   # boundary 24: one doubling, then the bisection
    (Fake(), 24, 4096),                     # (48, 96): midpoints off the doubling grid, rounded to multiples of 8
    (Fake(per_sample_gib=0.01), 8, 256),    # never fails: stops at max_batch
])
def test_search_finds_the_boundary_within_the_promised_trials(fake, start, max_batch):
    resolution, below = 8, 2
    trials = search(fake, WORLD, start=start, resolution=resolution, max_batch=max_batch, below=below)
    measured = batches(trials)
    assert fake.calls == measured and len(set(measured)) == len(measured)  # never the same batch twice
    assert all(b % resolution == 0 for b in measured)
    want = max(b for b in range(resolution, max_batch + 1, resolution) if fake.clean(b))
    assert largest_clean(trials) == want
    if want + resolution <= max_batch:  # resolved: the next multiple was measured and failed
        assert not next(t for t in trials if t.local_batch_size == want + resolution).clean
    # the promise of search(): log2(L/start) + 2 doublings, ceil(log2(L/resolution)) bisections, `below` more
    last_doubling = max(b for b in (start * 2**k for k in range(20)) if b <= want)
    bound = math.log2(last_doubling / start) + 2 + max(0, math.ceil(math.log2(last_doubling / resolution))) + below
    assert len(trials) <= bound
    assert {want - resolution, want - 2 * resolution} <= set(measured)  # the curve just below the boundary


def test_search_order_and_agreed_values_for_the_default_fake():
    trials = search(Fake(), WORLD)
    # doubling to the OOM at 128, bisecting (64, 128) on multiples of 8, then 80 (done) and 72 below 88
    assert batches(trials) == [8, 16, 32, 64, 128, 96, 80, 88, 72]
    assert [t.verdict for t in trials] == ["clean"] * 4 + ["OOM", "retries", "clean", "clean", "clean"]
    assert trials[4].samples_per_s is None and trials[4].mfu is None  # None survives the agreement
    assert agree(trials[4], WORLD) == (trials[4], False)


def test_search_when_start_fails_halves_to_a_batch_that_fits():
    fake = Fake(per_sample_gib=20.0)  # retries above 3.5, OOM above 3.9
    trials = search(fake, WORLD, start=64)
    assert batches(trials)[:4] == [64, 32, 16, 8]  # bisection on multiples of 8, then halving below 8
    assert largest_clean(trials) == 2
    assert len(trials) <= 1 + math.ceil(math.log2(64)) + 2


def test_search_never_clean_returns_failures_and_choose_says_why():
    trials = search(Fake(base_gib=100.0), WORLD, start=8)
    assert batches(trials) == [8, 4, 2, 1] and not any(t.clean for t in trials)
    with pytest.raises(NoCleanTrial, match="smallest tried, 1, gave OOM"):
        choose(trials)


@pytest.mark.parametrize("n", [1, 3, 6, 8])
def test_deadline_stops_early_with_the_trials_so_far(n):
    now = [0.0]

    def ten_seconds(batch):
        now[0] += 10.0
        return Fake()(batch)

    # the search stops when a next 10 s trial would end after the deadline: after n trials
    trials = search(ten_seconds, WORLD, deadline=10.0 * n + 5, clock=lambda: now[0])
    assert trials == search(Fake(), WORLD)[:n]
    assert choose(trials)["max-throughput"] == max((t for t in trials if t.clean), key=lambda t: t.samples_per_s)


def t_(batch, rate, **kw) -> Trial:
    return Trial(batch, 2 * batch, samples_per_s=rate, **kw)


def test_choose_objectives_and_tolerance():
    trials = [t_(8, 100.0), t_(16, 150.0), t_(32, 196.0), t_(64, 200.0), t_(96, 200.0),
              t_(104, 250.0, alloc_retries=2), t_(112, 260.0, over_budget=True), t_(120, 300.0, error="x"),
              t_(128, None, ooms=1)]
    picked = choose(trials)
    assert picked["max-throughput"].local_batch_size == 64  # faster unclean trials lose; a tie goes to 64
    assert picked["min-batch-at-peak"].local_batch_size == 32  # 196 >= 0.98 * 200
    assert choose(trials, tolerance=0.01)["min-batch-at-peak"].local_batch_size == 64
    assert choose(trials, tolerance=0.25)["min-batch-at-peak"].local_batch_size == 16
    assert choose(trials, tolerance=0.0)["min-batch-at-peak"].local_batch_size == 64
    with pytest.raises(ValueError):
        choose(trials, tolerance=1.0)
    with pytest.raises(NoCleanTrial, match="smallest tried, 104, gave retries"):
        choose([t for t in trials if not t.clean])
    # a clean batch above a failed one of the same setting is never chosen: the boundary is not sharp there
    noisy = trials + [t_(48, 90.0, over_budget=True)]
    assert choose(noisy)["max-throughput"].local_batch_size == 32
    other_setting = trials + [replace(t_(48, 90.0, over_budget=True), setting=1)]
    assert choose(other_setting)["max-throughput"].local_batch_size == 64
    with pytest.raises(NoCleanTrial, match="lies above one that failed .local batch 4: over budget"):
        choose(trials + [t_(4, 50.0, over_budget=True)])
    # a global batch above the training samples is measured but never chosen: its command could not train
    fit = choose(trials, samples=127)
    assert fit["max-throughput"].local_batch_size == 32 and fit["min-batch-at-peak"].local_batch_size == 32
    assert choose(trials, samples=128)["max-throughput"].local_batch_size == 64
    with pytest.raises(NoCleanTrial, match="more than the 15 training samples .the smallest a global batch of 16"):
        choose(trials, samples=15)


def test_scaled_lr_follows_the_config_ladder():
    base = load_config(ROOT / "config/ViT.yaml", "bs16_opt").optim
    for b in (32, 64, 128, 256, 512, 1024, 2048):
        rung = load_config(ROOT / "config/ViT.yaml", f"bs{b}_opt").optim
        assert scaled_lr(base.lr, base.global_batch_size, rung.global_batch_size) == pytest.approx(rung.lr, rel=5e-3)
    with pytest.raises(ValueError):
        scaled_lr(0.0, 16, 32)


def test_choice_args_train_with_the_choice():
    base = ["--config", "tiny", "--lr", "1e-3", "--local_batch_size", "4"]
    args = choice_args(Trial(32, 64), base, lr=1e-3, base_global=8)
    assert args[:len(base)] == base
    cfg = cli_config(args, "tiny")  # the real parser: the appended keys win
    assert cfg.optim.local_batch_size == 32 and cfg.optim.lr == pytest.approx(1e-3 * math.sqrt(8), rel=1e-5)
    same = choice_args(Trial(8, 16), base, lr=1e-3, base_global=16, num_iters=800)
    assert same == base + ["--local_batch_size", "8"]  # same global batch: the lr is left alone
    longer = cli_config(choice_args(Trial(32, 64), base, lr=1e-3, base_global=8, num_iters=800), "tiny")
    assert longer.optim.num_iters == 100  # the samples of 800 steps at 8: 800 x 8 / 64


def test_a_choice_that_leaves_epochs_of_few_steps_says_so():
    cfg = cli_config(["--config", "tiny", "--data_loader_config", "synthetic", "--limit_nsamples", "504"], "tiny")
    notes = short_epochs(cfg, {"max-throughput": Trial(256, 256), "min-batch-at-peak": Trial(64, 64)})
    assert notes == ["max-throughput: global batch 256 leaves 1 step(s) per epoch of 504 training samples (248 "
                     "unused each epoch); train on more samples, or pass a smaller --local_batch_size"]


def test_a_command_scaled_to_a_few_steps_says_so():
    notes = short_runs(128, 16, {"max-throughput": Trial(512, 8192), "min-batch-at-peak": Trial(32, 512)})
    assert notes == ["max-throughput: the config's 128 iterations at global batch 16 are 1 step(s) at global batch "
                     "8192; pass a larger --num_iters for a real run"]  # 128 x 16 / 512 = 4 steps: no note


def test_report_table_json_and_png(tmp_path):
    trials = search(Fake(), WORLD)
    table = report_table(trials).splitlines()
    assert table[0].split() == ["local", "global", "samples/s", "MFU", "step", "s", "alloc", "GiB", "reserved",
                                "GiB", "frag", "GiB", "retries", "OOM", "verdict"]
    rows = [line.split() for line in table[2:]]
    assert [int(r[0]) for r in rows] == sorted(batches(trials))
    assert rows[-1] == ["128", "128", "-", "-", "-", "88.20", "98.00", "4.90", "0", "1", "OOM"]
    assert rows[-2][-3:] == ["3", "0", "retries"] and rows[0][3] == "6.7%"

    choices = choose(trials)
    args = {name: choice_args(t, ["--config", "short"], 5e-4, 16) for name, t in choices.items()}
    save_json(tmp_path / "out" / "tune.json", trials, choices, args)
    data = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert set(data) == {"trials", "choice"} and set(data["choice"]) == set(OBJECTIVES)
    assert [t["local_batch_size"] for t in data["trials"]] == batches(trials)
    for name in OBJECTIVES:
        assert data["choice"][name]["local_batch_size"] == choices[name].local_batch_size
        assert data["choice"][name]["samples_per_s"] == choices[name].samples_per_s
        assert data["choice"][name]["args"] == args[name]
    save_json(tmp_path / "none.json", trials, {}, {})
    assert json.loads((tmp_path / "none.json").read_text())["choice"] == {name: None for name in OBJECTIVES}

    fig = plot(tmp_path / "tune.png", trials, choices, budget_bytes=90 * GIB)
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = {text.get_text() for text in fig.axes[0].get_legend().get_texts()}
    picks = {f"pick: {name} ({choices[name].local_batch_size})" for name in OBJECTIVES}
    assert {"samples/s", "peak reserved", "peak allocated", "allocator retries", "OOM", "memory budget"} | picks <= labels
    assert "GPU" not in fig.axes[0].get_title() and "CUDA" in fig.axes[0].get_title()
    cpu = plot(tmp_path / "cpu.png", trials, device="cpu")
    cpu_labels = {text.get_text() for text in cpu.axes[0].get_legend().get_texts()}
    assert "peak RSS" in cpu_labels and "peak allocated" not in cpu_labels and "peak reserved" not in cpu_labels


def _two_ranks(rank: int, world_size: int, out: str) -> None:
    world = World(LaunchEnv(rank=rank, world_size=world_size), torch.device("cpu"))
    # rank 1 holds 10 GiB more and is slower: it retries from 88 where rank 0 is clean, and sets the pace
    mismatch = search(Fake(base_gib=2.0 + 10.0 * rank, rate=200.0 - 50.0 * rank, dp=2), world)

    def fails_on_rank_1(batch):
        trial = Fake(dp=2)(batch)
        return replace(trial, error="boom") if rank == 1 and batch == 32 else trial

    erring = search(fails_on_rank_1, world)
    now = [0.0]

    def slow_on_rank_0(batch):  # only rank 0's clock moves: only rank 0 sees the deadline come
        now[0] += 10.0 if rank == 0 else 0.0
        return Fake(dp=2)(batch)

    late = search(slow_on_rank_0, world, deadline=35.0, clock=lambda: now[0])
    result = {name: [t.to_dict() for t in trials] for name, trials in
              (("mismatch", mismatch), ("erring", erring), ("late", late))}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(120)  # a rank left waiting in a collective fails the test instead of hanging it
def test_two_ranks_agree_on_every_verdict(tmp_path):
    run_distributed(_two_ranks, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    mismatch = {t["local_batch_size"]: t for t in ranks[0]["mismatch"]}
    assert max(b for b, t in mismatch.items() if t["clean"]) == 80  # rank 1's boundary, not rank 0's 88
    assert mismatch[88]["verdict"] == "retries"  # rank 0 ran 88 clean and still records rank 1's retries
    rank0, rank1 = Fake(dp=2)(64), Fake(base_gib=12.0, rate=150.0, dp=2)(64)
    assert mismatch[64]["samples_per_s"] == rank1.samples_per_s < rank0.samples_per_s  # the slowest rank
    assert mismatch[64]["step_time_s"] == rank1.step_time_s
    assert mismatch[64]["peak_reserved_bytes"] == rank1.peak_reserved_bytes  # the fullest rank
    erring = {t["local_batch_size"]: t for t in ranks[0]["erring"]}
    assert erring[32]["error"] == "rank 1: boom" and erring[32]["verdict"] == "error"
    assert [t["local_batch_size"] for t in ranks[0]["late"]] == [8, 16, 32]


# ---------------------------------------------------------------- a second dimension at a fixed global batch
@dataclass
class FakeAC:
    """A step at global batch 64 whose activations shrink with the checkpointed blocks ``a`` (of 8) and grow
    with the micro-batch ``b``: memory ``4 + b * (8 - a) / 8`` GiB, clean up to 20 GiB; each checkpointed block
    costs 5 % of the rate and each extra micro-batch of accumulation 10 %."""

    calls: list[tuple[int, int]] = field(default_factory=list)

    def __call__(self, a: int, b: int) -> Trial:
        self.calls.append((a, b))
        mem = 4 + b * (8 - a) / 8
        trial = Trial(b, 64, peak_reserved_bytes=int(mem * GIB))
        if mem > 20:
            return replace(trial, ooms=1)
        rate = 100 * (1 - 0.05 * a) * (1 - 0.1 * (64 // b - 1))
        return replace(trial, samples_per_s=rate, step_time_s=64 / rate)


def test_combine_finds_each_settings_largest_clean_batch_and_stops_when_nothing_is_accumulated():
    fake = FakeAC()
    trials = combine(fake, WORLD, settings=[0, 2, 4, 6, 8], local_batches=[64, 32, 16, 8], monotone=True)
    # a=0: 64 and 32 OOM, 16 fits; a=2: 16 (64 * 6/8 = 48 > 16); a=4: 32; a=6: 64 runs clean, so a=8 is skipped
    assert fake.calls == [(0, 64), (0, 32), (0, 16), (2, 64), (2, 32), (2, 16), (4, 64), (4, 32), (6, 64)]
    assert [(t.setting, t.local_batch_size, t.clean) for t in trials if t.clean] == [(0, 16, True), (2, 16, True),
                                                                                      (4, 32, True), (6, 64, True)]
    best = choose(trials)["max-throughput"]
    # rates 70 (a=0, 4 micro-batches), 63, 72 (a=4, 2 micro-batches), 70 (a=6, none): half the blocks win
    assert (best.setting, best.local_batch_size) == (4, 32) and best.samples_per_s == pytest.approx(72)
    table = report_table(trials, "ac_blocks").splitlines()
    assert table[0].split()[:2] == ["ac_blocks", "local"] and len(table) == 2 + len(trials)


def test_combine_without_monotone_tries_every_setting_and_keeps_the_deadline():
    fake = FakeAC()
    combine(fake, WORLD, settings=[6, 8], local_batches=[64, 32], monotone=False)
    assert fake.calls == [(6, 64), (8, 64)]  # fsdp_prefetch-like: a clean setting does not end the search
    clock = iter(range(100)).__next__
    late = combine(FakeAC(), WORLD, settings=[0, 2], local_batches=[64, 32, 16], monotone=False, deadline=0.5,
                   clock=clock)
    assert len(late) == 2  # the trial that passed the deadline is the last
    with pytest.raises(ValueError):
        combine(fake, WORLD, settings=[], local_batches=[64], monotone=True)


def test_journal_drops_a_torn_last_line_and_keeps_the_trials(tmp_path, caplog):
    """A job killed while appending leaves half a line: the rerun continues from the trials before it."""
    from training.tuner.trials import Journal
    path = tmp_path / "tune.journal.jsonl"
    fingerprint = {"config": "tiny"}
    done = Trial(4, 4, samples_per_s=10.0, peak_reserved_bytes=1)
    path.write_text(json.dumps({"fingerprint": fingerprint}) + "\n" + json.dumps({"trial": done.to_dict()}) + "\n"
                    + '{"running": 8, "glo')
    journal = Journal(path, fingerprint, WORLD)
    assert list(journal.trials) == [4] and journal.trials[4].samples_per_s == 10.0
    assert any("torn last line 3" in r.getMessage() for r in caplog.records)


def test_a_hard_linked_journal_is_refused_before_any_trial(tmp_path):
    """The journal is appended to: a hard link there (#45 item 3) would carry the trials into the other name's file."""
    from training.tuner.trials import Journal
    from utils.core.files import NotOurs
    outside = tmp_path / "outside.txt"
    outside.write_text(json.dumps({"fingerprint": {"config": "tiny"}}) + "\n")
    path = tmp_path / "tune.journal.jsonl"
    os.link(outside, path)
    with pytest.raises(NotOurs, match="tune.journal.jsonl has 2 hard links"):
        Journal(path, {"config": "tiny"}, WORLD)


# A process with the CPU trials' heap setting frees buffers from large to small, as the search measures after
# a failure: glibc's default would then carve the smaller ones from the heap and keep their pages once freed.
HEAP_PROBE = """
import torch
from training.monitor.memory import map_large_host_buffers, trim_host_heap
from training.monitor.memory_profile import host_memory
assert map_large_host_buffers()
torch.ones(8).sum()  # torch's lazy set-up, before the baseline
trim_host_heap()
before = host_memory()["host_rss_bytes"]
for mib in (24, 16, 8):
    x = torch.ones(mib * 2**18)  # float32, written: resident
    del x
print(host_memory()["host_rss_bytes"] - before)
"""


def test_cpu_trials_give_each_freed_buffer_back_after_larger_ones(tmp_path):
    probe = run_forked(["-c", HEAP_PROBE], tmp_path, subprocess_env())
    assert probe.returncode == 0, probe.stderr
    assert int(probe.stdout) < 2**20  # without the setting: 16 MiB kept
