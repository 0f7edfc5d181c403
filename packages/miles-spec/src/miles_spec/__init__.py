"""miles-spec: the speculative-decoding draft trained online on the rollout data: the policy's MTP modules
(`MTPLoss`) or an EAGLE-3 draft (`Eagle3Loss`), auxiliary losses of the trainer's step (docs/architecture.md,
"Auxiliary losses").

Attributes load on first use (`lazy_loader`, from the imports listed in `__init__.pyi`): importing the package
does not import torch.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
