"""Record, submit, wait: one command buffer for a few commands, with buffers
from the device's pool. The closure path on Vulkan runs each op this way."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import DEVICE_NUMPY, ITEMSIZE, device_array, dtype_of, host_array
from flowgrad.exec_vulkan.encoder import encode
from flowgrad.exec_vulkan.index_checks import UNSET
from flowgrad.exec_vulkan.recorder import BufView, Copy, Fill, Recorder


class OneShot:
    """with OneShot(device) as s:
           x = s.upload(array); y = s.empty(shape, "f32")
           s.rec.dispatch(...)           # or a lowering: low.forward(s.rec, node, [x], y)
           i = s.download(y)
           results = s.run()             # numpy arrays, by download index
    Buffers go back to the pool when the block ends, whatever happened."""

    def __init__(self, device):
        self.device = device
        self.rec = Recorder(device)
        self._pooled = []
        self._downloads = []       # (view, staging BufView or None when read straight from mapped memory)
        self._uploads = []         # staging copies, run before every recorded command

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def _acquire(self, nbytes: int, kind: str):
        buf = self.device.pool.acquire(max(nbytes, 4), kind)
        self._pooled.append(buf)
        return buf

    def empty(self, shape, dtype: str) -> BufView:
        shape = tuple(int(d) for d in shape)
        view = BufView(None, 0, shape, dtype)
        return BufView(self._acquire(view.nbytes, "device"), 0, shape, dtype)

    def upload(self, array, dtype: str | None = None) -> BufView:
        """A device buffer holding `array` (as dtype, default its own) by the time the commands run."""
        dtype = dtype or dtype_of(np.asarray(array), narrow=True)
        view = self.empty(np.shape(array), dtype)
        self.write(view, array)     # mapped: written now (nothing is in flight), else through staging
        return view

    def write(self, view: BufView, array) -> None:
        """Fill an existing device view with `array` by the time the commands run,
        even those recorded before the write (a closure records a lowering
        first, and uploads only once it has taken the shapes)."""
        data = device_array(array, view.dtype).reshape(view.shape)
        with self.device.lock:
            self.device.stats["uploads"] += 1
        if view.buffer.mapped:
            view.buffer.write(data, view.offset)
        else:
            staging = BufView(self._acquire(view.nbytes, "upload"), 0, view.shape, view.dtype)
            staging.buffer.write(data)
            if view.nbytes:
                self._uploads.append(Copy(staging, view, None))

    def download(self, view: BufView) -> int:
        """Ask for `view` back after run(); returns its index in run()'s list."""
        if getattr(view.buffer, "mapped", False):
            self._downloads.append((view, None))
        else:
            staging = BufView(self._acquire(view.nbytes, "download"), 0, view.shape, view.dtype)
            self.rec.copy(view, staging)
            self._downloads.append((view, staging))
        return len(self._downloads) - 1

    def run(self) -> list[np.ndarray]:
        """Under the device's lock, whole: the scratch memory and the
        pool's buffers it takes, the command buffer, the queue."""
        with self.device.lock:
            return self._run()

    def _run(self) -> list[np.ndarray]:
        device = self.device
        device.stats["dispatches"] += self.rec.counts()["dispatches"]
        device.stats["downloads"] += len(self._downloads)
        self.rec.commands[:0], self._uploads = self._uploads, []
        checks = self.rec.checks
        if checks.checks:   # index kernels flag into words reset first and read back last
            self.rec.commands.insert(0, Fill(checks.whole(), UNSET, None))
            flags = self.download(checks.whole())
        if self.rec.commands:
            self.rec.arena.materialize(device, device.pool)   # one-shots reuse scratch memory too
            checks.materialize(device, device.pool)
            cmd = device.command_buffer()
            try:
                enc = encode(device, cmd, self.rec.commands)
                try:
                    device.submit_and_wait(cmd)
                finally:
                    enc.free()
            finally:
                device.free_command_buffer(cmd)
        out = []
        for view, staging in self._downloads:
            src = staging or view
            raw = src.buffer.read(src.offset, src.nbytes) if src.nbytes else np.zeros(0, np.uint8)
            out.append(host_array(raw.view(DEVICE_NUMPY[view.dtype]).reshape(view.shape).copy(), view.dtype))
        if checks.checks:
            checks.raise_flagged(out.pop(flags))
        return out

    def release(self) -> None:
        for buf in self._pooled:
            self.device.pool.release(buf)
        self._pooled.clear()
        self.rec.arena.free()
        self.rec.checks.free()


__all__ = ["OneShot", "ITEMSIZE"]
