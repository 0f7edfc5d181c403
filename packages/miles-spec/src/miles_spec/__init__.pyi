"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .config import DraftTrainConfig
from .eagle3_loss import Eagle3Loss, eagle3_targets
from .mtp_loss import MTPLoss, mtp_targets
from .new_mtp import add_mtp_modules
from .train import train_draft

__all__ = [
    "DraftTrainConfig",
    "Eagle3Loss",
    "MTPLoss",
    "add_mtp_modules",
    "eagle3_targets",
    "mtp_targets",
    "train_draft",
]
