"""The input-only channels of a split (utils/data/forcing_source.py): the valid time of each sample's rollout
step, the synthetic loader's nominal times, the static fields after the forcings, and what needs a date."""

from __future__ import annotations

from datetime import timedelta

import h5py
import numpy as np
import pytest
import torch

from utils.config.schema import DataConfig
from utils.core.errors import UserError
from utils.data.dataset import ERA5Dataset
from utils.data.forcing_source import dataset_forcings, nominal_forcings, target_time
from utils.data.forcings import calendar_clock, forcing_fields
from utils.data.loaders import build_data

NAMES = ("cos_solar_zenith_angle", "sin_local_time", "sin_latitude")


def config(data_path, **kw) -> DataConfig:
    return DataConfig(**{"data_path": str(data_path), "img_size": (32, 64), "n_in_channels": 4, "n_out_channels": 4,
                         **kw})


def test_each_step_reads_the_forcings_of_its_targets_valid_time(tiny_data):
    dataset = ERA5Dataset(tiny_data / "valid", 4, (32, 64), 1, target_steps=3)
    lat = np.linspace(90, -90, 32)
    inputs = dataset_forcings(config(tiny_data, forcings=NAMES), dataset, lat, "cpu")
    idx = torch.tensor([0, 7, 20])
    for step in range(3):
        times = [dataset.times(i)[step + 1] for i in idx.tolist()]
        assert [target_time(dataset, i, step) for i in idx.tolist()] == times
        want = forcing_fields(NAMES, torch.from_numpy(calendar_clock(times)), torch.from_numpy(lat),
                              torch.from_numpy(dataset.files[0].axis.longitude))
        assert torch.equal(inputs(idx, step), want)
    assert not torch.equal(inputs(idx, 0), inputs(idx, 1))  # 6 hours later: another sun


def test_the_synthetic_loader_dates_sample_i_i_steps_after_2000(tmp_path):
    cfg = config(tmp_path, data_loader_config="synthetic", forcings=NAMES, static_fields=("lsm",), img_size=(8, 16),
                 limit_nsamples=16, limit_nsamples_val=16)
    data = build_data(cfg, 4, 0, 1, torch.device("cpu"))
    fields = data.train_forcings(torch.tensor([0, 3]), 1)
    assert fields.shape == (2, 4, 8, 16)  # three forcings, then one static field
    import cftime
    times = [cftime.datetime(2000, 1, 1, calendar="standard") + timedelta(hours=6 * (i + 2)) for i in (0, 3)]
    want = forcing_fields(NAMES, torch.from_numpy(calendar_clock(times)), torch.linspace(90, -90, 8).double(),
                          torch.from_numpy(np.linspace(0, 360, 16, endpoint=False)))
    torch.testing.assert_close(fields[:, :3], want)
    assert torch.equal(fields[0, 3], fields[1, 3])  # static
    assert nominal_forcings(config(tmp_path), 6.0, "cpu") is None


def test_time_forcings_need_dated_files_but_grid_ones_do_not(tiny_data, tmp_path):
    undated = tmp_path / "valid"
    undated.mkdir()
    src = next((tiny_data / "valid").glob("*.h5"))
    with h5py.File(src, "r") as f, h5py.File(undated / src.name, "w") as g:
        for key in f:
            f.copy(key, g)
        del g["fields"].attrs["start_time"]
    dataset = ERA5Dataset(undated, 4, (32, 64), 1)
    lat = np.linspace(90, -90, 32)
    with pytest.raises(UserError, match="forcings cos_solar_zenith_angle, sin_local_time need the time of each step.*no start_time"):
        dataset_forcings(config(tiny_data, forcings=NAMES), dataset, lat, "cpu")
    inputs = dataset_forcings(config(tiny_data, forcings=("sin_latitude",)), dataset, lat, "cpu")
    assert inputs(torch.tensor([1]), 0).shape == (1, 1, 32, 64)


def test_synthetic_grid_forcings_and_static_fields_date_nothing(tmp_path):
    """Without a forcing of the valid time no sample is dated: the fields come from the grid and the file alone."""
    inputs = nominal_forcings(config(tmp_path, forcings=("sin_latitude",), static_fields=("lsm",), img_size=(8, 16)),
                              6.0, "cpu")
    assert inputs.valid_time is None and not inputs.timed
    fields = inputs(torch.tensor([0, 5]), 1)
    assert fields.shape == (2, 2, 8, 16) and torch.equal(fields[0], fields[1])
