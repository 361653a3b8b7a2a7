"""Score a trained run's forecasts by lead time, the WeatherBench 2 way, against persistence and climatology.

    python evaluate.py --run_dir runs/tiny/1GPU/00 --lead_steps 20
    python evaluate.py --run_dir RUN_DIR --lead_steps 40 --split valid --step 500 --init_every 4 --save_forecasts
    torchrun --nproc_per_node 4 evaluate.py --run_dir RUN_DIR --lead_steps 40   # initial times split over ranks

Loads the run's ``config.yaml`` and a checkpoint (sharded, or a single ``.pt`` file), rolls the model out
``--lead_steps`` times from every ``--init_every``-th initial time of the split (of the run's data, or of
``--data_path``, normalized with the run's statistics), and scores each lead
for the model, persistence and climatology (``utils/evaluation/scoring.py``). Writes to ``--out`` (default
``<run_dir>/evaluation/``):

* ``scorecard.json``: ``{"lead_hours": [...], "channels": [...], "initial_times": N, "checkpoint": ...,
  "scores": {"model"|"persistence"|"climatology": {"rmse"|"acc": {channel: [one value per lead]}}}}``;
* ``scorecard.nc``: the same as an xarray DataArray ``skill(metric, forecast, channel, lead_time)``,
  lead time in hours;
* ``scorecard.png``: RMSE and ACC against lead time for the key channels;
* with ``--save_forecasts``: ``forecasts.nc`` (one file per rank under torchrun: ``forecasts_rank<r>.nc``),
  the forecasts in physical units by initial time, lead time, channel, latitude and longitude.

Ends with a table of model vs persistence vs climatology by lead time. Bad input is one ``error:`` line,
exit status 2, on every rank.
"""

import sys

from utils.core.errors import run_cli
from utils.evaluation.evaluate_run import main

if __name__ == "__main__":
    sys.exit(run_cli(main))
