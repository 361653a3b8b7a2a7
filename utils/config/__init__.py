"""The typed config: schema (``schema.py``, ``types.py``), named YAML configs and command-line overrides
(``loading.py``), the command line, its help and the generated flag table (``cli.py``), the cross-field checks
(``validate.py``) and the measured fp8 speed-ups the advice quotes (``fp8_speed.py``)."""
