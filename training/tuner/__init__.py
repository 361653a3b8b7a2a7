"""The batch-size tuner: the search (``search.py``), trials on the real training step (``trials.py``), the whole
tuning and its report (``tune.py``, ``report.py``, ``auto.py``, ``command.py``); the job planner of
``--simulate_world_size`` (``planner.py``, ``rank_plan.py``, ``dry_run.py``, ``estimates.py``)."""
