"""Model construction from a preset name or a user factory path.

A job spec names its model either as a preset (``"debug"``, ``"8b"``...) with
optional :class:`LlamaConfig` overrides, or as ``"package.module:callable"``
whose keyword arguments are the overrides. Every failure is a ``ValueError``
whose message says what is wrong and how to fix it, so the CLI can show it
to the user without a traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.models.config import PRESETS, LlamaConfig

if TYPE_CHECKING:  # torch is imported when a model is built, not when a spec is checked
    from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["build_model", "describe_model", "resolve_factory"]

_FORMAT_HINT = "expected 'package.module:function'"


def resolve_factory(path: str, kind: str = "model factory") -> Callable[..., Any]:
    """Import and return the callable named by ``path``.

    Args:
        path: ``"package.module:callable"``; the attribute part may be dotted
            (``"pkg.mod:Class.create"``).
        kind: What the callable is, for messages (``"model factory"``, ``"data.source"``...).

    Returns:
        The callable object (not yet called).

    Raises:
        ValueError: If the format is wrong, the module cannot be imported, the
            attribute is missing or the object is not callable.
    """
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"{kind} {path!r}: {_FORMAT_HINT}")
    module_name, attr_path = path.split(":")
    if not module_name or not attr_path:
        raise ValueError(f"{kind} {path!r}: {_FORMAT_HINT}")
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:  # a script's sys.exit / argparse at import time: not ours to end the process
        raise ValueError(
            f"{kind} {path!r}: importing module {module_name!r} exits the process (SystemExit({exc.code!r})); "
            "a factory's module must not run a program when it is imported: put that under "
            "if __name__ == '__main__':"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any import-time error is a user error here
        raise ValueError(
            f"{kind} {path!r}: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {exc}); check that it is installed or on PYTHONPATH"
        ) from None
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"{kind} {path!r}: module {module_name!r} has no attribute {attr_path!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"{kind} {path!r}: {attr_path!r} is a {type(obj).__name__}, not a callable"
        )
    return obj


def _preset_config(name: str, overrides: Mapping[str, Any]) -> LlamaConfig:
    """Apply ``overrides`` to preset ``name`` and validate the result."""
    valid = [f.name for f in dataclasses.fields(LlamaConfig)]
    for key in overrides:
        if key not in valid:
            raise ValueError(
                f"unknown override {key!r} for preset {name!r}; valid keys: {', '.join(valid)}"
            )
    cfg = dataclasses.replace(PRESETS[name], **overrides)
    try:
        cfg.validate()
    except ValueError as exc:
        raise ValueError(f"preset {name!r} with overrides {dict(overrides)}: {exc}") from None
    return cfg


def _unknown_name(name: str) -> ValueError:
    """Build the error for a name that is neither a preset nor a factory path."""
    return ValueError(
        f"unknown model {name!r}: use a preset ({', '.join(sorted(PRESETS))}) "
        f"or a factory path, {_FORMAT_HINT}"
    )


def describe_model(name: str, overrides: Mapping[str, Any] | None = None) -> LlamaConfig | None:
    """Return the validated config of a preset without building the model.

    Args:
        name: Preset name or factory path.
        overrides: Config field overrides (presets) or factory kwargs.

    Returns:
        The resolved :class:`LlamaConfig` for presets, ``None`` for factories
        (their shape is unknown until they are called).

    Raises:
        ValueError: For unknown presets, bad override keys or invalid shapes.
    """
    overrides = dict(overrides or {})
    if name in PRESETS:
        return _preset_config(name, overrides)
    if ":" in name:
        return None
    raise _unknown_name(name)


def build_model(name: str, overrides: Mapping[str, Any] | None = None) -> nn.Module:
    """Build a model from a preset name or a ``"package.module:callable"`` path.

    Parameters are created on the current default device, so the caller may
    wrap this in ``with torch.device("meta"):`` for deferred initialisation.

    Args:
        name: Preset name (see ``PRESETS``) or factory path.
        overrides: Config field overrides (presets) or factory kwargs.

    Returns:
        The constructed module.

    Raises:
        ValueError: For unknown names, bad overrides, unresolvable factories or
            a factory that does not return an ``nn.Module``.
    """
    from torch import nn

    from raytrain_ckpt.models.llama import Llama

    overrides = dict(overrides or {})
    if name in PRESETS:
        return Llama(_preset_config(name, overrides))
    if ":" not in name:
        raise _unknown_name(name)
    factory = resolve_factory(name)
    try:
        model = factory(**overrides)
    except TypeError as exc:
        # Most often a misspelt keyword in the spec's overrides.
        raise ValueError(f"model factory {name!r} rejected overrides {overrides}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model factory {name!r} returned {type(model).__name__}, expected a torch.nn.Module"
        )
    logger.debug("built model %s from factory with overrides %s", name, overrides)
    return model
