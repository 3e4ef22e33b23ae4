"""Communication performance: gradient compression hooks (and, with them, what they cost)."""

from gradsync.comm.compression import COMPRESSIONS, CompressionConfig, CompressionHook, make_hook

__all__ = ["COMPRESSIONS", "CompressionConfig", "CompressionHook", "make_hook"]
