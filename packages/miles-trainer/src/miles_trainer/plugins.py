"""Loading the trainer's plug-ins (policy losses, advantage estimators) from `module:function` paths.

`miles_contracts.load_plugin` imports the path; this adds the check that the function takes the positional
tensors the trainer passes, so a wrong signature fails when the config is built, not at the first step.
"""

from __future__ import annotations

import inspect
from typing import Any

from miles_contracts import load_plugin


def load_checked_plugin(path: str, protocol: Any, kind: str, arguments: tuple[str, ...]) -> Any:
    """Import `path` as a `protocol` and check it accepts `arguments` positionally (plus keyword arguments)."""
    fn = load_plugin(path, protocol)
    try:
        inspect.signature(fn).bind(*([None] * len(arguments)))
    except TypeError as error:
        raise TypeError(f"{kind} plug-in {path!r} must accept ({', '.join(arguments)}, **kwargs): {error}") from error
    return fn
