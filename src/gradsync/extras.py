"""The optional packages some of gradsync's faces need, and the one line said when one is missing.

The core (`gradsync run`, the library) installs with torch, numpy, psutil and rich. The report's
figures, TensorBoard, NVML and the demo's data come with extras (pip install 'gradsync[report]'),
so a face that needs a missing one names the extra that brings it instead of an ImportError.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gradsync.errors import GradsyncError

# import name -> (the distribution pip installs, the extra of pyproject.toml that brings it)
EXTRAS = {
    "matplotlib": ("matplotlib", "report"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "pynvml": ("nvidia-ml-py", "gpu"),
    "sklearn": ("scikit-learn", "demo"),
}


class MissingExtra(GradsyncError):
    """An optional package a face needs does not import; the message names the extra that brings it."""


def require(module: str, purpose: str) -> ModuleType:
    """`module` imported, or MissingExtra: "<purpose> with <package>, which is not installed: pip install ...".

    `purpose` says what needs it, e.g. "the report draws its figures".
    """
    distribution, extra = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise MissingExtra(_broken(purpose, distribution, error)) from None
        raise MissingExtra(f"{purpose} with {distribution}, which is not installed: pip install 'gradsync[{extra}]'") from None
    except ImportError as error:
        raise MissingExtra(_broken(purpose, distribution, error)) from None


def _broken(purpose: str, distribution: str, error: ImportError) -> str:
    # Installed but not importable (a dependency of it missing, a wrong build): reinstalling the
    # package alone, since forcing gradsync's extra would reinstall torch too.
    return f"{purpose} with {distribution}, which is installed but does not import ({error}): pip install --force-reinstall {distribution}"


def missing(module: str, purpose: str) -> str | None:
    """The line `require` would raise, or None when `module` imports."""
    try:
        require(module, purpose)
    except MissingExtra as error:
        return str(error)
    return None
