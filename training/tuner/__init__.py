"""The batch-size tuner: the search (``search.py``), trials on the real training step (``trials.py``),
the whole tuning and its report (``tune.py``, ``report.py``)."""
