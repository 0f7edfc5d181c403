"""Steps 2 and 4 of the RL data path: a step's batch (batch.py: generate, score, filter, over-sample), the default
one-turn rollout (single_turn.py), partial rollouts (partial.py), agentic episodes (agentic.py, env_pool.py,
environments.py, tool_calls.py, agent_metrics.py), the sandbox of user code (sandbox.py) and group filters
(filters.py)."""
