"""The one training loop (``trainer.py``) and what it runs and keeps: the optimizer step (``step.py``), the train
state (``state.py``) and the run directory (``run_dir.py``); preemption is ``utils/core/signals.py`` and the
checkpoint manager's cadence."""
