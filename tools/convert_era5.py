"""Convert ERA5-style netCDF, GRIB or zarr (Copernicus CDS, WeatherBench2, ARCO-ERA5) to the training layout.

Usage::

    python -m tools.convert_era5 --input era5.nc --out data/era5 --variables t z --levels 850 500 \\
        [--valid_start 2017-01-02 | --valid_fraction 0.5] [--members all | 0 | 0,3] \\
        [--trim_to_multiple 4] [--select expver=0] [--static_variables lsm z] [--overwrite]

What it does: ``utils/preprocess/convert.py``.
"""

from __future__ import annotations

import sys

from utils.core.errors import ArgumentParser, run_cli
from utils.core.files import output_path_type
from utils.preprocess.convert import convert
from utils.preprocess.convert_plan import parse_select


def build_parser() -> ArgumentParser:
    """The CLI's argument parser (flags mirror :func:`convert`; usage errors are one ``error:`` line)."""
    p = ArgumentParser(prog="python -m tools.convert_era5",
                       description="Convert ERA5-style netCDF, GRIB or zarr to train/, valid/, stats/ HDF5 "
                                   "layout.")
    p.add_argument("--input", required=True,
                   help="netCDF file, GRIB file (needs pip install -e '.[grib]') or zarr store folder")
    p.add_argument("--out", required=True, type=output_path_type("--out"), help="output dataset folder")
    p.add_argument("--variables", nargs="+", required=True, help="variables, e.g. t z t2m (channel order)")
    p.add_argument("--levels", nargs="+", type=float, default=None,
                   help="pressure levels for level variables, e.g. 850 500 (default: all in the file)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--valid_start", default=None,
                       help="ISO time in the input's calendar; steps at or after it are validation")
    split.add_argument("--valid_fraction", type=float, default=None,
                       help="fraction of the last time steps used for validation (default 0.5)")
    p.add_argument("--members", default="all", help="ensemble members: all (default) or numbers like 0 or 0,3")
    p.add_argument("--trim_to_multiple", type=int, default=1, metavar="P",
                   help="drop southern rows / eastern columns so H and W are multiples of P (default 1 = keep)")
    p.add_argument("--select", action="append", default=[], metavar="DIM=INDEX",
                   help="take one entry of an extra dimension, e.g. --select expver=0 (repeatable)")
    p.add_argument("--static_variables", nargs="+", default=[], metavar="NAME",
                   help="variables written to <out>/static.h5 as static fields on the same grid, e.g. lsm z "
                        "(land-sea mask, surface geopotential); constant in time if they have a time dimension")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    return p


def convert_from_args(argv: list[str]) -> None:
    """Parse ``argv`` and convert."""
    args = build_parser().parse_args(argv)
    convert(args.input, args.out, args.variables, args.levels, valid_start=args.valid_start,
            valid_fraction=0.5 if args.valid_fraction is None else args.valid_fraction,
            members=args.members, trim_to_multiple=args.trim_to_multiple,
            select=parse_select(args.select), static_variables=args.static_variables, overwrite=args.overwrite)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 with ``error: ...`` on stderr for bad input)."""
    return run_cli(convert_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
