"""GPU kernels used in place of a PyTorch op where the stock path costs extra memory passes; each is opt-in
through the config and applied from ``distributed/parallelize.py``."""
