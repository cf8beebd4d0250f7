"""nanoqwen's CPU kernels and how an engine chooses them: the C++ extension's Python face (kernels.py; the
sources in csrc/, compiled by build.py), the matmul path a model's layers multiply through (matmul.py),
measured per machine (probes.py) and chosen from those measurements (selection.py), the CPU's model and
flags (cpu_info.py), and memory: the heap, and buffers in 2 MiB pages (memory.py)."""
