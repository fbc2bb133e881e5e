"""The state of one half (teacher or student) of one shard on disk. Torch-free: `status` reads it."""

from enum import StrEnum


class HalfState(StrEnum):
    CURRENT = "current"
    MISSING = "missing"  # not written (yet)
    STALE = "stale"  # written under other settings or inputs
    CORRUPT = "corrupt"  # its bytes changed since they were written
