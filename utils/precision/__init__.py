"""Precision, in one place: the autocast dtypes of ``--amp_mode`` and the bf16 residual stream (``amp.py``),
torchao's float8 linears (``float8.py``) and where fp8 measured faster (``fp8_advice.py``, read by ``--help``)."""
