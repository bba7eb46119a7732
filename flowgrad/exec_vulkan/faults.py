"""Fault injection for the Vulkan runtime, for tests: make the Nth buffer
allocation fail, the Nth queue submission fail, the Nth fence wait time out,
or the Nth submission lose the device.

    with faults.inject(alloc=3):
        sess.step(feeds)       # DeviceError: allocating ... (injected fault)

Counting starts when the block is entered. An allocation or submission
failure leaves the session usable; a timeout or a lost device marks the
device lost, and every later use of it says so (compile a new session)."""
from __future__ import annotations

import collections
import contextlib

EVENTS = ("alloc", "submit", "fence_timeout", "device_lost")
_armed: dict[str, int] = {}
_seen: collections.Counter = collections.Counter()


@contextlib.contextmanager
def inject(**at: int):
    unknown = set(at) - set(EVENTS)
    if unknown:
        raise ValueError(f"unknown fault {sorted(unknown)}; faults: {', '.join(EVENTS)}")
    _armed.clear()
    _armed.update(at)
    _seen.clear()
    try:
        yield _seen
    finally:
        _armed.clear()
        _seen.clear()


def armed() -> bool:
    return bool(_armed)


def hit(event: str) -> bool:
    """Count one `event`; True when it is the one armed to fail."""
    if event not in _armed:
        return False
    _seen[event] += 1
    return _seen[event] == _armed[event]
