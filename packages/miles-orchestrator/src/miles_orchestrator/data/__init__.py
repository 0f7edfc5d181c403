"""Step 1 of the RL data path: data sources (sources.py; Hugging Face datasets, hf.py; a plug-in source,
plugin_source.py), the built-in task (task.py) and the default example's bootstrap policy (bootstrap.py)."""
