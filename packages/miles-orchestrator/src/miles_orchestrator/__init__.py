"""miles-orchestrator."""
