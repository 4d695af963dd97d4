"""ddptrain: train image classifiers with PyTorch data parallelism."""

__version__ = "0.1.0"
