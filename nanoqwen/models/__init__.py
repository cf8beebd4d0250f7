"""The Qwen3 model math: qwen3.py, one file read top to bottom."""
