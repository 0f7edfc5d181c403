"""miles-spec."""
