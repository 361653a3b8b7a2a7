"""Watching a run: the reporter (console, TensorBoard, ``metrics.jsonl``, ``run.json``), memory (the epoch
line, OOM handling, the memory profile), Nsight windows, FLOPs and MFU."""
