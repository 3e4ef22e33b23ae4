"""A typed options section, built from an instance or from a dict of its fields.

`gradsync.setup(ddp={"bucket_cap_mb": 50})` and `setup(ddp=DDPConfig(bucket_cap_mb=50))` mean the
same; a key the section does not have is named, with the valid ones, instead of a TypeError.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from gradsync.errors import ConfigError


def section(cls: type, value: Any, where: str) -> Any:
    """Accept a dataclass instance or a mapping of its fields; name unknown keys clearly."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{where} expects a {cls.__name__} or a dict of its fields, got {type(value).__name__}."
        )
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown option(s) {', '.join(unknown)}; valid options are "
            f"{', '.join(sorted(known))}."
        )
    return cls(**value)
