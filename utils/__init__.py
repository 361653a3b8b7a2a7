"""The library under the entry points, one package per concern, imports one way (bottom to top):

``core`` (errors, files, logging) -> ``config`` -> ``data`` (beside ``networks``, ``kernels``) ->
``distributed`` (top-level package) -> ``monitor``, ``evaluation`` -> ``train`` -> ``tuner`` -> the entry points
and ``tools/``. ``tests/unit/test_imports.py`` enforces it.
"""
