"""Any time step: the step in its own unit (utils/data/timestep.py) and samples that run across the files of a split
(utils/data/dataset.py), read by the native loader as one stream that resumes exactly."""

from __future__ import annotations

from pathlib import Path

import cftime
import numpy as np
import pytest
import torch

from utils.core.errors import UserError
from utils.data.dataset import ERA5Dataset, make_sampler
from utils.data.native import DeviceBatches
from utils.data.stats import Stats
from utils.data.timestep import TimeStep, infer_time_step, lead_label
from utils.preprocess.writer import FieldFileWriter

C, IMG = 2, (4, 8)
LAT, LON = np.linspace(60, -60, IMG[0]), np.arange(IMG[1]) * 45.0


def dates(calendar: str, *ymdh) -> np.ndarray:
    return np.array([cftime.datetime(*t, calendar=calendar) for t in ymdh])


@pytest.mark.parametrize("times,want", [
    (dates("standard", (2000, 1, 1, 0), (2000, 1, 1, 6), (2000, 1, 1, 12)), TimeStep(6.0, "hours")),
    (dates("noleap", (2000, 2, 27), (2000, 2, 28), (2000, 3, 1)), TimeStep(1.0, "days")),
    (dates("standard", (2000, 1, 1, 0), (2000, 1, 1, 1, 30)), TimeStep(1.5, "hours")),
    # 360_day months are all 30 days: constant seconds, same day of month -> months, not "30 days"
    (dates("360_day", (1850, 1, 16), (1850, 2, 16), (1850, 3, 16)), TimeStep(1, "months")),
    # mid-month stamps of a standard calendar wander (Jan 16 12:00, Feb 15, Mar 16 12:00)
    (dates("standard", (1850, 1, 16, 12), (1850, 2, 15), (1850, 3, 16, 12), (1850, 4, 16)), TimeStep(1, "months")),
    (dates("standard", (1850, 1, 1), (1850, 4, 1), (1850, 7, 1)), TimeStep(3, "months")),
    # annual means: leap years make the seconds differ; a gap of two years is a gap, not another step
    (dates("standard", (1850, 7, 2, 12), (1851, 7, 2, 12), (1852, 7, 2), (1855, 7, 2, 12)), TimeStep(1, "years")),
    (dates("noleap", (2000, 1, 1), (2001, 1, 1), (2002, 1, 1)), TimeStep(1, "years")),
    # 31-day steps drift through the months: a fixed step
    (dates("standard", *[(2001, 1, 1)] + [(2001, m, d) for m, d in ((2, 1), (3, 4), (4, 4), (5, 5), (6, 5), (7, 6))]),
     TimeStep(31.0, "days")),
])
def test_time_step_in_its_own_unit(times, want):
    assert infer_time_step(times) == want


def test_adding_steps_in_the_calendar():
    jan31 = cftime.datetime(2001, 1, 31, 6, calendar="standard")
    assert TimeStep(1, "months").add(jan31, 1) == cftime.datetime(2001, 2, 28, 6, calendar="standard")
    assert TimeStep(1, "months").add(jan31, 13) == cftime.datetime(2002, 2, 28, 6, calendar="standard")
    feb30 = cftime.datetime(2001, 2, 30, calendar="360_day")
    assert TimeStep(2, "years").add(feb30, 1) == cftime.datetime(2003, 2, 30, calendar="360_day")
    assert TimeStep(6.0, "hours").add(jan31, 3) == cftime.datetime(2001, 1, 31, 0, calendar="standard") + \
        (cftime.datetime(2001, 2, 1, calendar="standard") - cftime.datetime(2001, 1, 31, 0, calendar="standard"))
    assert TimeStep(1, "months").steps_between(cftime.datetime(1850, 1, 16, 12, calendar="standard"),
                                               cftime.datetime(1851, 1, 15, calendar="standard")) == 12
    assert TimeStep(1, "years").hours("360_day") == 360 * 24 and TimeStep(1, "months").hours("noleap") == 730.0
    assert [lead_label(v, u) for v, u in ((6, "hours"), (2, "days"), (3, "months"), (10, "years"), (1.5, "hours"))] \
        == ["006h", "002d", "003mo", "010y", "1.5h"]
    with pytest.raises(ValueError, match="whole"):
        TimeStep(1.5, "months")


def write(path: Path, first_value: int, n: int, start: str | None, step: TimeStep, calendar: str = "360_day"):
    """A file whose step t holds ``first_value + t`` everywhere: the value names the state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (first_value + np.arange(n, dtype=np.float32))[:, None, None, None] * np.ones((1, C, *IMG), np.float32)
    with FieldFileWriter(path, ["a", "b"], LAT, LON, n, None, start, calendar, step=step) as w:
        w.write(0, data)


MONTH = TimeStep(1, "months")


@pytest.fixture(scope="module")
def monthly(tmp_path_factory) -> Path:
    """train/: 1850 and 1851 (12 months each, continuous), then 1853 after a gap; members _m01 of 1850 and 1851."""
    root = tmp_path_factory.mktemp("monthly") / "train"
    write(root / "1850.h5", 0, 12, "1850-01-16T00:00:00", MONTH)
    write(root / "1851.h5", 12, 12, "1851-01-16T00:00:00", MONTH)
    write(root / "1853.h5", 100, 12, "1853-01-16T00:00:00", MONTH)
    write(root / "1850_m01.h5", 200, 12, "1850-01-16T00:00:00", MONTH)
    write(root / "1851_m01.h5", 212, 12, "1851-01-16T00:00:00", MONTH)
    return root


def test_samples_run_across_continuing_files_only(monthly):
    ds = ERA5Dataset(monthly, C, IMG, 1, target_steps=2)
    names = [f.path.name for f in ds.files]
    runs = [[names[i] for i in run.files] for run in ds.runs]
    assert runs == [["1850.h5", "1851.h5"], ["1850_m01.h5", "1851_m01.h5"], ["1853.h5"]]
    values = [(ds[i][0][0, 0, 0].item(), ds[i][1][:, 0, 0, 0].tolist()) for i in range(len(ds))]
    first = [v for v, _ in values]
    # 24 - 2 initial times of the continuous years, 22 of the member, 10 of the year after the gap
    assert len(ds) == 22 + 22 + 10 and first[:22] == list(range(22)) and first[44:] == list(range(100, 110))
    assert values[10] == (10.0, [11.0, 12.0])  # Nov 1850 -> Dec 1850, Jan 1851
    assert values[33] == (211.0, [212.0, 213.0])  # the member's own continuation, never the other series
    assert ds.describe(10) == "train/1850.h5 time 10 -> 11, 1851.h5 time 0"
    assert ds.describe(11) == "train/1850.h5 time 11 -> 1851.h5 time 0..1"
    assert ds.times(11)[1] == cftime.datetime(1851, 1, 16, calendar="360_day")
    assert ds.time_step == MONTH


def test_annual_files_of_one_step_chain(tmp_path):
    year = TimeStep(1, "years")
    for y in range(1850, 1860):  # mid-year stamps; the leap years' fall 12 hours earlier
        hour = "00" if y % 4 == 0 else "12"
        write(tmp_path / "train" / f"{y}.h5", y, 1, f"{y}-07-02T{hour}:00:00", year, "standard")
    ds = ERA5Dataset(tmp_path / "train", C, IMG, 2, target_steps=3)
    assert len(ds.runs) == 1 and len(ds) == 10 - 6
    inp, tar, _ = ds[1]
    assert inp[0, 0, 0].item() == 1851 and tar[:, 0, 0, 0].tolist() == [1853, 1855, 1857]


def test_a_gap_ends_the_run_and_the_message_says_so(tmp_path):
    write(tmp_path / "train" / "1850.h5", 0, 2, "1850-01-16T00:00:00", MONTH)
    write(tmp_path / "train" / "1851.h5", 10, 12, "1851-03-16T00:00:00", MONTH)  # Jan and Feb 1851 missing
    with pytest.raises(UserError, match=r"1850\.h5 has 2 time steps, too few for 3 rollout steps .*; use at most 1 "
                                        r"rollout steps \(1851\.h5 does not start one 1 months step after "
                                        r"1850\.h5 ends"):
        ERA5Dataset(tmp_path / "train", C, IMG, 1, target_steps=3)


def test_the_loader_resumes_exactly_across_file_boundaries(monthly):
    """The native loader's epoch over a chained split, started at batch k, is the tail of the whole epoch."""
    ds = ERA5Dataset(monthly, C, IMG, 1)
    stats = Stats.identity(C, IMG, "cpu")

    def epoch(start: int) -> list:
        batches = DeviceBatches(ds, make_sampler(ds, 5, True, 0, 1), 4, True, 0, device=torch.device("cpu"),
                                stats=stats)
        batches.set_epoch(3, start_batch=start)
        out = [(inp.clone(), tar.clone(), idx.clone()) for inp, tar, idx in batches]
        batches.close()
        return out

    whole, rest = epoch(0), epoch(5)
    assert len(whole) == len(ds) // 4 and len(rest) == len(whole) - 5
    for (a, b, i), (c, d, j) in zip(whole[5:], rest):
        assert torch.equal(i, j) and torch.equal(a, c) and torch.equal(b, d)
    # the batches are the dataset's samples, those across the new year included
    for inp, tar, idx in whole:
        for n, i in enumerate(idx.tolist()):
            want_inp, want_tar = ds.read_sample(i)
            assert np.array_equal(inp[n].numpy(), want_inp) and np.array_equal(tar[n].numpy(), want_tar)
