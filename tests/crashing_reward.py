"""A GRPO reward that crashes its process in native code, as a segfaulting extension does
(tests/test_watchdog.py): it reads address 8 through ctypes (a null pointer's field), which the kernel
answers with SIGSEGV."""

from __future__ import annotations

import ctypes


def crash_in_native_code(response: str, sample: dict) -> float:
    return float(len(ctypes.string_at(8, 1)))
