"""The layers under ``distributed/``, one package per concern, imports one way (bottom to top):

``core`` (errors, files, safe loading, logging, signals, the run lock, the component base) -> ``precision`` (AMP
dtypes, bf16 residual stream, float8, where fp8 pays) -> ``config`` (schema, YAML and command line, checks) ->
``data`` (reading: layout, dataset, statistics, climatology, loaders) and ``preprocess`` (making datasets: convert,
synthetic data on disk, climatology), beside the top-level ``networks`` and ``kernels``. Above them ``distributed/``,
then ``training/``, then the entry points and ``tools/``. ``tests/unit/test_imports.py`` enforces it.
"""
