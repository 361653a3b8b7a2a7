"""The models, plain PyTorch that knows nothing of parallelism (``vit.py``), and the single-file model a run
leaves (``model_file.py``)."""
