"""Training: the one loop (``trainer.py``) and what it runs and keeps: the optimizer step (``step.py``),
the train state (``state.py``), preemption (``preemption.py``) and the run directory (``run_dir.py``)."""
