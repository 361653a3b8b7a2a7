"""Making datasets (apart from reading them, utils/data/): converting ERA5 inputs (``convert.py``, its plan
``convert_plan.py``, input formats ``formats.py``), writing the training layout (``writer.py``), synthetic datasets
on disk (``synthetic_dataset.py``) and the climatology (``climatology_builder.py``)."""
