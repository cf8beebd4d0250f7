"""The engine's bookkeeping, independent of any model: sequences (sequence.py), their KV-cache blocks with
prefix caching (block_manager.py), and which tokens run in each step (scheduler.py)."""
