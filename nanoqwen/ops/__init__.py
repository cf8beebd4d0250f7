"""Kernels behind the model's plain-PyTorch code: paged decode attention for GPUs (with its
reference)."""
