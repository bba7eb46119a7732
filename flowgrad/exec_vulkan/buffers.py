"""Device memory: one VkBuffer with its own memory (Buffer), the pool that
reuses buffers across one-op-at-a-time submissions (BufferPool), a typed
window into either (BufView), and memory a recording addresses before it
exists (LateBuffer: the scratch arena, the index flag words).

A Buffer takes the Device that makes it (device.py), which imports this
module: the annotations name it, nothing here imports it."""
from __future__ import annotations

import math
import weakref

import attrs
import numpy as np

from flowgrad.dtypes import ITEMSIZE
from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan import faults
from flowgrad.exec_vulkan.instance import _VK_ERRORS, load_vulkan, vk_errors


class Buffer:
    """One VkBuffer with its own memory. `array` is a uint8 numpy view of the
    mapped memory when the buffer is host-visible, else None."""

    def __init__(self, device: "Device", nbytes: int, kind: str):
        vk = load_vulkan()
        self.device = device
        self.kind = kind
        self.nbytes = int(nbytes)
        size = max(16, -(-self.nbytes // 16) * 16)   # whole words, so fills may cover the tail
        self.size = size
        device.check_allocation(size, kind)
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        info = vk.VkBufferCreateInfo(size=size, usage=usage, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        with vk_errors(f"creating a {size}-byte buffer"):
            self.handle = vk.vkCreateBuffer(device.handle, info, None)
        try:
            req = vk.vkGetBufferMemoryRequirements(device.handle, self.handle)
            type_index, mapped = device.memory_type(kind, req.memoryTypeBits)
            alloc = vk.VkMemoryAllocateInfo(allocationSize=req.size, memoryTypeIndex=type_index)
            what = f"allocating {mib(req.size)} of {kind} memory on {device.info.name}"
            if faults.hit("alloc"):
                raise DeviceError(f"{what} failed: {_VK_ERRORS['VkErrorOutOfDeviceMemory']} (injected fault)")
            with vk_errors(what):
                self.memory = vk.vkAllocateMemory(device.handle, alloc, None)
        except BaseException:
            vk.vkDestroyBuffer(device.handle, self.handle, None)
            raise
        self.array = None
        try:
            with vk_errors("binding buffer memory"):
                vk.vkBindBufferMemory(device.handle, self.handle, self.memory, 0)
            if mapped:
                with vk_errors("mapping buffer memory"):
                    self.array = np.frombuffer(vk.vkMapMemory(device.handle, self.memory, 0, size, 0), np.uint8)
        except BaseException:
            _free(device.handle, self.handle, self.memory)
            raise
        with device.lock:
            device.live_bytes += size
            device.objects["buffer"] += 1
        self._finalizer = weakref.finalize(self, _free_buffer, device, self.handle, self.memory, size)
        self._finalizer.atexit = False

    @property
    def mapped(self) -> bool:
        return self.array is not None

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self.array[offset:offset + raw.size] = raw

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset:offset + nbytes].copy()

    def free(self) -> None:
        self._finalizer()


def _free(dev, buf, mem):
    vk = load_vulkan()
    vk.vkDestroyBuffer(dev, buf, None)
    vk.vkFreeMemory(dev, mem, None)


def _free_buffer(device, buf, mem, size):
    if device.handle is None:
        return
    _free(device.handle, buf, mem)
    with device.lock:
        device.live_bytes -= size
        device.objects["buffer"] -= 1


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


class BufferPool:
    """Reuses buffers across one-op-at-a-time submissions (the closure path
    would otherwise allocate device memory for every op). Sizes are rounded
    to powers of two; at most `keep` bytes are kept per kind. Every session
    on the device shares it, from any thread: it is used under the device's lock."""

    def __init__(self, device: "Device", keep: int = 256 * 2**20):
        self.device = device
        self.keep = keep
        self.free: dict[tuple[str, int], list[Buffer]] = {}
        self.kept = 0

    def acquire(self, nbytes: int, kind: str) -> Buffer:
        size = 256
        while size < nbytes:
            size *= 2
        with self.device.lock:
            bucket = self.free.get((kind, size))
            if bucket:
                self.kept -= size
                return bucket.pop()
        return self.device.buffer(size, kind)

    def release(self, buf: Buffer) -> None:
        with self.device.lock:
            if self.kept + buf.nbytes <= self.keep:
                self.kept += buf.nbytes
                self.free.setdefault((buf.kind, buf.nbytes), []).append(buf)
                return
        buf.free()

    def drain(self) -> None:
        """Free every idle buffer: a leak check counts what is in use, not
        what the pool keeps for the next one-op submission."""
        with self.device.lock:
            idle = [buf for bucket in self.free.values() for buf in bucket]
            self.free.clear()
            self.kept = 0
        for buf in idle:
            buf.free()


@attrs.frozen
class BufView:
    """A typed window into a buffer: `offset` bytes in, `shape` of `dtype`."""

    buffer: object
    offset: int
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * ITEMSIZE[self.dtype]

    def view(self, elem_offset: int, shape) -> BufView:
        """The same buffer, `elem_offset` elements further in, with `shape`."""
        shape = tuple(int(d) for d in shape)
        if elem_offset < 0 or elem_offset + math.prod(shape) > self.size:
            raise ValueError(f"view of {list(shape)} at element {elem_offset} does not fit in a "
                             f"{self.dtype}{list(self.shape)} view")
        return BufView(self.buffer, self.offset + elem_offset * ITEMSIZE[self.dtype], shape, self.dtype)

    def reshape(self, shape) -> BufView:
        shape = tuple(int(d) for d in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape a {self.dtype}{list(self.shape)} view to {list(shape)}")
        return BufView(self.buffer, self.offset, shape, self.dtype)


class LateBuffer:
    """Memory that commands address while they are recorded (BufViews into
    this object) but that is created only after recording, at its final
    size: from a BufferPool (and returned to it by free) or a buffer of its
    own. `what` names it in the error for a use before allocation."""

    what = "buffer"

    def __init__(self):
        self.buffer = None   # the runtime Buffer, once allocated
        self.pool = None     # the BufferPool it came from, if any

    def allocate(self, device, nbytes: int, pool=None) -> None:
        if self.buffer is None and nbytes:
            self.pool = pool
            self.buffer = pool.acquire(nbytes, "device") if pool is not None else device.buffer(nbytes, "device")

    @property
    def handle(self):
        if self.buffer is None:
            raise DeviceError(f"internal error: {self.what} used before its buffer was allocated")
        return self.buffer.handle

    def free(self) -> None:
        if self.buffer is not None:
            if self.pool is not None:
                self.pool.release(self.buffer)
            else:
                self.buffer.free()
            self.buffer = None
