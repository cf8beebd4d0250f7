"""Tensor functions below the layers, no modules and no state: weight quantisation formats (quantize.py)
and nanoqwen's CPU kernels with their plain references (cpu/)."""
