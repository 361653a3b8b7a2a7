"""Checkpoints: the run's checkpoint folder (``folder.py``), the sharded checkpoints a run resumes from
(``manager.py``, ``sharded.py``, ``views.py``), how they are written (``storage.py``, ``staging.py``) and gathering a
parallel run into the single-file model (``export.py``; the file's contents: ``networks/model_file.py``)."""
