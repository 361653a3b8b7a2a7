"""The typed config: schema (``schema.py``, ``types.py``), named YAML configs and command-line overrides
(``loading.py``), the command line, its help and the generated flag table (``command_line.py``) and the
cross-field checks (``validate.py``)."""
