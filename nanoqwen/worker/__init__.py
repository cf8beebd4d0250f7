"""Running steps on a device: the model loaded with the kernels chosen for it (loading.py,
kernel_selection.py), the KV cache sized (memory.py), each step packed, run and sampled (model_runner.py),
CPU decode steps in one C++ call (fused_decoder.py), CUDA graphs (cuda_graph.py), weights in huge pages
(huge_pages.py), and the tensor-parallel worker processes (tp_worker.py)."""
