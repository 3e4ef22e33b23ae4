"""Communication performance: gradient compression hooks (and, with them, what they cost), and
periodic synchronisation (local SGD, DiLoCo) for links too slow for any compressor."""

from gradsync.comm.compression import COMPRESSIONS, CompressionConfig, CompressionHook, make_hook
from gradsync.comm.periodic import PeriodicSync, PeriodicSyncConfig

__all__ = ["COMPRESSIONS", "CompressionConfig", "CompressionHook", "PeriodicSync", "PeriodicSyncConfig", "make_hook"]
