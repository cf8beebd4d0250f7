"""How people use nanoqwen: the Python API (llm.py), the `nanoqwen` command (cli.py, with chat.py,
benchmark.py and the engine's flags in engine_args.py), and the OpenAI-compatible HTTP server (server/)."""
