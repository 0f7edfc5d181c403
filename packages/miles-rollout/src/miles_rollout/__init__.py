"""miles-rollout: the embedded rollout engine, its SGLang-compatible HTTP server and the client for both.

- `Engine` / `EngineConfig`: continuous batching over the miles-kernels model, paged KV cache with a radix
  prefix cache, deterministic mode, weight updates and memory release.
- `create_app`: the FastAPI server (`miles-rollout serve`).
- `Client`: async HTTP client for this server or SGLang; `InProcessClient`: the same interface over an
  `Engine` in this process; `CoalescingClient`: either one, with concurrent `/generate` calls sent as one batch.

Attributes load on first use (`lazy_loader`, from the imports listed in `__init__.pyi`): importing the package,
or its torch-free `miles_rollout.config`, does not import torch (docs/architecture.md, "Config").
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

__version__ = "0.1.0"
