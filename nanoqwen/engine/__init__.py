"""The engine: requests in, tokens out, one step at a time (llm_engine.py), with what comes before a
request reaches the scheduler (input_processor.py) and what the user sees after a step
(output_processor.py)."""
