"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .mtp_loss import MTPLoss, mtp_targets
from .train import DraftTrainConfig, train_draft

__all__ = ["DraftTrainConfig", "MTPLoss", "mtp_targets", "train_draft"]
