"""The typed config: schema (``schema.py``, ``types.py``), named YAML configs and command-line overrides
(``loading.py``), generated help (``help.py``) and the cross-field checks (``validate.py``)."""
