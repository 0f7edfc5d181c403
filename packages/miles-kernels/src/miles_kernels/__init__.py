"""miles-kernels."""
