"""autopar: an auto-parallel compiler for PyTorch training."""
