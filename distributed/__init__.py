"""Parallelism, applied from outside to a plain ``networks/`` model: launch and rendezvous (``launch.py``,
``rendezvous.py``), the job and its mesh (``world.py``: every mode question answered once), failure detection
(``failure.py``), DDP / FSDP / activation checkpointing / compile (``parallelize.py``), tensor and context parallelism
on DTensor with our own autograd mappings (``tensor_parallel.py``, ``layers.py``, ``mappings.py``), the simulated
job of the planner (``simulate.py``) and sharded checkpoints (``checkpoint/``)."""
