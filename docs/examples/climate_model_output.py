"""Write a small netCDF file shaped like climate-model output, to try the converter on monthly or annual means.

    python docs/examples/climate_model_output.py --kind annual --out annual_means.nc    # 60 years, noleap calendar
    python docs/examples/climate_model_output.py --kind monthly --out monthly_means.nc  # 10 years, 360_day calendar

Four variables (``tas`` K, ``pr`` mm/day, ``psl`` hPa, ``ua`` m/s) on a 32 x 64 grid, latitudes south to north as
climate models write them, times as CF numbers in the file's calendar: mid-year (July 2) for annual means,
mid-month (the 16th) for monthly means. The fields are a seasonal cycle, a slow travelling wave, a warming trend
and noise: something a model can learn. docs/evaluation.md ("Your own data") converts, trains and evaluates it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cftime
import numpy as np
import xarray as xr

VARIABLES = {"tas": ("K", 288.0), "pr": ("mm day-1", 3.0), "psl": ("hPa", 1010.0), "ua": ("m s-1", 5.0)}


def times(kind: str) -> tuple[list, str]:
    """The time stamps and the calendar of ``kind`` (``annual`` or ``monthly``)."""
    if kind == "annual":
        return [cftime.datetime(1950 + y, 7, 2, calendar="noleap") for y in range(60)], "noleap"
    return [cftime.datetime(1950 + m // 12, m % 12 + 1, 16, calendar="360_day") for m in range(120)], "360_day"


def climate_model_output(kind: str, seed: int = 0) -> xr.Dataset:
    stamps, calendar = times(kind)
    lat = np.linspace(-87.1875, 87.1875, 32)
    lon = np.arange(64) * 5.625
    rng = np.random.default_rng(seed)
    n = len(stamps)
    phi, lam = np.deg2rad(lat)[None, :, None], np.deg2rad(lon)[None, None, :]
    t = np.arange(n, dtype=np.float64)[:, None, None]
    years = np.array([s.year - 1950 + (s.month - 1) / 12 for s in stamps])[:, None, None]
    season = np.sin(2 * np.pi * (years % 1.0))
    data = {}
    for i, (name, (units, base)) in enumerate(VARIABLES.items()):
        scale = 0.05 * base if name != "ua" else 3.0
        field = (base + scale * (np.cos(phi) ** 2 + 0.5 * season * np.sin(phi) + 0.4 * np.cos(2 * lam - 0.3 * t + i)
                                 + 0.02 * years) + 0.1 * scale * rng.standard_normal((n, lat.size, lon.size)))
        data[name] = (("time", "lat", "lon"), field.astype(np.float32), {"units": units})
    units = "days since 1950-01-01"
    time = xr.Variable("time", cftime.date2num(stamps, units, calendar), {"units": units, "calendar": calendar})
    return xr.Dataset(data, coords={"time": time, "lat": ("lat", lat, {"units": "degrees_north"}),
                                    "lon": ("lon", lon, {"units": "degrees_east"})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # no abbreviated options
    parser.add_argument("--kind", choices=("annual", "monthly"), default="annual")
    parser.add_argument("--out", type=Path, required=True, help="the netCDF file to write")
    args = parser.parse_args()
    climate_model_output(args.kind).to_netcdf(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
