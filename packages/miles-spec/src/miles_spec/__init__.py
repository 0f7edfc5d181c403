"""miles-spec: the MTP draft trained online on the rollout data (`MTPLoss`, an auxiliary loss of the trainer's
step; see docs/architecture.md, "Auxiliary losses").

Attributes load on first use (`lazy_loader`, from the imports listed in `__init__.pyi`): importing the package
does not import torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
