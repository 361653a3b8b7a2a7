"""The application above ``distributed/``: monitoring and evaluation (``monitor/``, ``evaluation/``), the one
training loop (``loop/``) and the batch-size tuner and job planner (``tuner/``). Imports go one way, bottom to top:
``utils`` -> ``networks``, ``kernels`` -> ``distributed`` -> ``training`` -> the entry points and ``tools/``
(``tests/unit/test_imports.py`` enforces it)."""
