"""gradsync's version, in a module of its own: reading it must not load the trainer."""

__version__ = "0.1.0"
