"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .config import DraftTrainConfig
from .mtp_loss import MTPLoss, mtp_targets
from .new_mtp import add_mtp_modules
from .train import train_draft

__all__ = ["DraftTrainConfig", "MTPLoss", "add_mtp_modules", "mtp_targets", "train_draft"]
