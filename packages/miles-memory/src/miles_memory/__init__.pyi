"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

__all__: list[str] = []
