"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .mtp_loss import MTPLoss, mtp_targets

__all__ = ["MTPLoss", "mtp_targets"]
