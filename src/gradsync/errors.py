"""The errors gradsync raises for problems a user can fix.

Every message says what is wrong and what to change. They derive from one base class so a
script (or `gradsync run`) can tell a gradsync diagnosis from a crash deep inside torch.
"""


class GradsyncError(Exception):
    """A problem the user can fix; the message says what is wrong and how to fix it."""


class ConfigError(GradsyncError, ValueError):
    """An option or argument has a value gradsync cannot work with."""


class PeerError(GradsyncError):
    """Another rank failed a check, so this rank stops too instead of waiting for it forever."""
