"""miles-rollout."""
