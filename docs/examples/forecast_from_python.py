# %% [markdown]
# # A forecast from Python
#
# Load a trained model, take an initial state from the data, roll the model out and plot the forecast against
# what happened. Run it as a script from the repository root (or cell by cell in an editor that knows `# %%`):
#
#     python docs/examples/forecast_from_python.py --run_dir runs/tiny/1CPU/00   # writes <run_dir>/forecast.png
#
# After `make train` the defaults find the `tiny` run and its data. Only the model file is needed to forecast:
# `Forecaster.from_file("runs/tiny/1CPU/00/checkpoints/model.pt")` works without the run directory or the data
# folder (docs/python-api.md); the data here give the initial state and the truth to compare with.

# %%
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the project runs from its repository root; nothing is installed

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from utils.core.errors import ArgumentParser  # noqa: E402
from utils.data.layout import resolve_data_path  # noqa: E402
from training.evaluation.forecast import Forecaster  # noqa: E402

parser = ArgumentParser(description="Forecast from Python and plot it against the data.")
parser.add_argument("--run_dir", type=Path, default=None, help="a run directory (default: the newest tiny run)")
parser.add_argument("--lead_steps", type=int, default=8, help="model steps to roll out (default 8)")
parser.add_argument("--channel", default=None, help="channel to plot (default: the first)")
parser.add_argument("--out", type=Path, default=None, help="the figure (default: forecast.png in the run directory)")
args = parser.parse_args()
run_dir = args.run_dir or max((REPO / "runs" / "tiny").glob("*/[0-9]*"))
out = args.out or run_dir / "forecast.png"  # beside the run, never in the repository

# %% [markdown]
# ## The model
# `from_run` picks the run's latest checkpoint; `from_file` reads one self-contained model file.

# %%
forecaster = Forecaster.from_run(run_dir)  # on the GPU when one is visible, else the CPU
print(f"{run_dir}: step {forecaster.step}, channels {forecaster.channels}, one model step = {forecaster.time_step}, "
      f"grid {forecaster.latitude.size} x {forecaster.longitude.size}")

# %% [markdown]
# ## An initial state
# Any `xarray.Dataset` with one variable per channel on the model's grid will do; here, the first time step of
# the run's first validation file (physical units, with its time).

# %%
data = resolve_data_path(forecaster.config.data.data_path)  # a relative path: from here, else the repository
valid = sorted((data / "valid").glob("*.h5"))[0]
h, w = forecaster.latitude.size, forecaster.longitude.size
state = Forecaster.read_state(valid, 0, (h, w))
print(state)

# %% [markdown]
# ## The forecast
# An `xarray.Dataset` in physical units: one variable per channel over (lead_time, latitude, longitude).

# %%
forecast = forecaster.forecast(state, lead_steps=args.lead_steps)
print(forecast)
truth = Forecaster.read_state(valid, args.lead_steps, (h, w))

# %% [markdown]
# ## A plot: the forecast at the last lead, the data at that time, and their difference

# %%
channel = args.channel or forecaster.channels[0]
units = forecast[channel].attrs.get("units") or "channel units"
last = forecast[channel].isel(lead_time=-1)
lead = f"{float(last.lead_time):g} {forecast.lead_time.attrs['units']}"
fig, axes = plt.subplots(1, 3, figsize=(14, 3.4), constrained_layout=True)
for ax, field, title in ((axes[0], last, f"forecast, lead {lead}"), (axes[1], truth[channel], "data"),
                         (axes[2], last - truth[channel], "forecast - data")):
    field.plot(ax=ax, x="longitude", y="latitude", cbar_kwargs={"label": f"{channel} ({units})"})
    ax.set_title(title)
    ax.set_xlabel("longitude (degrees east)")
    ax.set_ylabel("latitude (degrees north)")
start = state.time.item() if "time" in state.coords else "the first step"
fig.suptitle(f"{channel}: run {run_dir}, step {forecaster.step}, forecast from {start}")
fig.savefig(out, dpi=100)
print(f"wrote {out}")
