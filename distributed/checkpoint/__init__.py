"""Checkpoints: the run's checkpoint folder (``files.py``), the sharded checkpoints a run resumes from
(``manager.py``), how they are written (``storage.py``, ``staging.py``) and the single-file model
(``export.py``)."""
