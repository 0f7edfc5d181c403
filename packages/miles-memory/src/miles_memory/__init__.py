"""miles-memory."""
