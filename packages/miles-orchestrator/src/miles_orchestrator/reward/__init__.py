"""Step 3 of the RL data path: the reward pool (pool.py; built-in and plug-in rewards in sandboxed workers) and the
remote reward over HTTP (http.py)."""
