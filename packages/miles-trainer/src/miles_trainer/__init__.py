"""miles-trainer."""
