"""The data side: the on-disk layout and its readers and writers, the ERA5 dataset and its statistics,
the native, DALI and synthetic loaders behind one ``Batches`` protocol (``loaders.py``), the converter
and the synthetic-data generator."""
