"""From a model name to weights in memory: where the folder is (hub.py), its safetensors files
(weight_files.py), the weights copied into a model (loader.py), and random-weight checkpoints of the
exact Qwen3 shapes for offline work (init_random.py)."""
