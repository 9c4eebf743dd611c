"""tiering: move segments of bytes among device memory, host memory and NVMe files, asynchronously, under
hard budgets. Usable on its own; zero/ is its first client."""
from .aio_config import AioConfig
from .aligned import ALIGNMENT, align_up, aligned_empty
from .errors import (
    AlignmentError,
    BudgetExceededError,
    ChecksumMismatchError,
    DeviceOutOfMemoryError,
    DirectIOUnsupportedError,
    EngineUnavailableError,
    IllegalTransitionError,
    IOFailedError,
    NvmePathError,
    NvmeSpaceError,
    PinnedMemoryError,
    StoreFullError,
    StoreRangeError,
    TieringConfigError,
    TieringError,
)
from .extents import Extent, ExtentAllocator
from .handle import Handle, completed, gather
from .host_pool import HostBuffer, HostBufferPool, HostPoolConfig
from .nvme_store import NvmeStore, NvmeStoreConfig
from .nvme_room import check_room
from .residency import Residency, Tier
from .swap_config import SwapConfig
from .swap_manager import SwapManager

__all__ = [
    "AioConfig", "align_up", "aligned_empty", "ALIGNMENT", "AlignmentError", "BudgetExceededError",
    "check_room", "ChecksumMismatchError", "completed", "DeviceOutOfMemoryError", "DirectIOUnsupportedError",
    "EngineUnavailableError", "Extent", "ExtentAllocator", "gather", "Handle", "HostBuffer", "HostBufferPool",
    "HostPoolConfig", "IllegalTransitionError", "IOFailedError", "NvmePathError", "NvmeSpaceError", "NvmeStore",
    "NvmeStoreConfig", "PinnedMemoryError", "Residency", "StoreFullError", "StoreRangeError", "SwapConfig",
    "SwapManager", "Tier", "TieringConfigError", "TieringError",
]
