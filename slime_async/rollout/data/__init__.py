"""Where prompts come from and how answers are scored: the built-in digit tasks, jsonl/parquet
datasets, reasoning-gym, the prompt sources the data worker draws from, reward functions, and
the run's data plan (`plan.make_data_plan`). Nothing here sends a request to an engine.
"""
