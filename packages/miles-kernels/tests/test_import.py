"""Import tier: miles-kernels imports with its declared dependencies only."""

import miles_kernels


def test_imports() -> None:
    assert miles_kernels.__doc__
