"""Reading data: the on-disk layout (``layout.py``, ``metadata.py``, ``timestep.py``), the ERA5 dataset and its
statistics and climatology (``dataset.py``, ``stats.py``, ``climatology.py``), and the native, DALI and synthetic
loaders behind one ``Batches`` protocol (``loaders.py``, ``native.py``, ``dali.py``, ``synthetic_loader.py``).
Making datasets is ``utils/preprocess/``."""
