# Two commands on a fresh machine (each creates .venv and installs what it needs):
#   make train   -> set up, generate the embedded sample data, train the `tiny` ViT on CPU/GPU
#   make test    -> set up and run the test suite
# Others: make data (the sample data only), make era5_sample and make uk_sample (convert a real ERA5 sample
# shipped in samples/, train on it; uk_sample also evaluates), make clean.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TINY := data/tiny/stats/time_means.npy
# the real ERA5 sample, shipped with the project (source and licence: samples/README.md)
ERA5_SAMPLE_NC ?= samples/era5-levels-members.nc
# more train.py flags for it, e.g. make era5_sample ERA5_SAMPLE_ARGS="--num_iters 400"
ERA5_SAMPLE_ARGS ?=
# the real hourly ERA5 sample: t2m over the British Isles, March 2019 (samples/README.md)
UK_SAMPLE_GRIB ?= samples/era5-2mt-2019-03-uk.grib
# more train.py flags for it, e.g. make uk_sample UK_SAMPLE_ARGS="--num_iters 400"
UK_SAMPLE_ARGS ?=
# its run: runs/era5_uk/1CPU/uk (1GPU on a GPU); a fixed name, so that evaluate.py finds it (run again, it is
# complete and only evaluated; other UK_SAMPLE_ARGS that change the training need another UK_RUN_NUM)
UK_RUN_NUM ?= uk

.PHONY: setup train test data era5_sample uk_sample clean

setup: $(STAMP)

# torch first and pinned, so no other requirement pulls a different (CUDA) build
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[data,dev,dali,grib,fp8]'
	touch $@

data: $(TINY)
$(TINY): | $(STAMP)
	$(BIN)/python -m tools.make_synthetic_data --out data/tiny --train_years 4 --steps_per_year 128 --overwrite

train: setup data
	$(BIN)/python train.py --yaml_config config/ViT.yaml --config tiny

test: setup
	$(BIN)/python -m pytest -q -n 2

era5_sample: setup
	$(BIN)/python -m tools.convert_era5 --input $(ERA5_SAMPLE_NC) --out data/era5_sample \
		--variables t z --levels 850 500 --trim_to_multiple 4 --overwrite
	$(BIN)/python train.py --config era5_sample $(ERA5_SAMPLE_ARGS)

# the run folder is 1CPU or 1GPU by the device train.py found: the newest of the two is this run
uk_sample: setup
	$(BIN)/python -m tools.convert_era5 --input $(UK_SAMPLE_GRIB) --out data/era5_uk \
		--variables t2m --valid_start 2019-03-25 --trim_to_multiple 8 --overwrite
	$(BIN)/python train.py --config era5_uk --run_num $(UK_RUN_NUM) $(UK_SAMPLE_ARGS)
	$(BIN)/python evaluate.py --run_dir "$$(ls -dt runs/era5_uk/1*/$(UK_RUN_NUM) | head -n 1)" --lead_steps 48

clean:
	rm -rf $(VENV) data runs
