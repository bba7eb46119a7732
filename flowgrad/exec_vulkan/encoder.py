"""Vulkan encoding: a Recorder's command list -> a command buffer, with
descriptor sets, push constants, the barriers Hazards asks for, and optional
timestamp queries (one interval per node and direction, for profiling)."""
from __future__ import annotations

import time

from flowgrad.exec_vulkan.device import PUSH_BYTES
from flowgrad.exec_vulkan.instance import load_vulkan, vk_errors
from flowgrad.exec_vulkan.recorder import ALL_STAGES, COMPUTE, TRANSFER, Dispatch, Fill, Hazards, Mark, Signal


def _handle(buffer):
    return buffer.handle


class Encoding:
    """Vulkan objects an encoded command list holds (descriptor pool, query
    pool, the events of its marks); free() when its command buffer is no
    longer used."""

    def __init__(self, device):
        self.device = device
        self.descriptor_pool = None
        self.query_pool = None
        self.query_labels: list = []   # labels of the intervals between timestamps
        self.events: list = []

    def free(self) -> None:
        vk = load_vulkan()
        if self.device.handle is None:
            return
        if self.descriptor_pool is not None:
            vk.vkDestroyDescriptorPool(self.device.handle, self.descriptor_pool, None)
            self.descriptor_pool = None
        if self.query_pool is not None:
            vk.vkDestroyQueryPool(self.device.handle, self.query_pool, None)
            self.query_pool = None
        for event in self.events:
            vk.vkDestroyEvent(self.device.handle, event, None)
            self.device.objects["event"] -= 1
        self.events.clear()


def encode(device, cmd, commands, timestamps: bool = False) -> Encoding:
    """Record `commands` into the command buffer `cmd` (begun and ended here).
    With timestamps=True a timestamp is written at every change of label
    (node, direction), for per-node GPU times (see read_timestamps)."""
    vk = load_vulkan()
    enc = Encoding(device)
    try:
        # recording uses the device's command pool, which one thread at a time may use
        with device.lock, vk_errors("recording a command buffer"):
            _encode(vk, device, cmd, commands, timestamps, enc, PUSH_BYTES)
    except BaseException:
        enc.free()
        raise
    return enc


def timed_submits(device, commands, times: int, what: str) -> list[float]:
    """Encode `commands` once into a fresh command buffer, submit it `times`
    times and return each submit's wall seconds (submit to fence)."""
    cmd = device.command_buffer()
    try:
        enc = encode(device, cmd, commands)
        try:
            out = []
            for _ in range(times):
                t0 = time.perf_counter()
                device.submit_and_wait(cmd, what)
                out.append(time.perf_counter() - t0)
            return out
        finally:
            enc.free()
    finally:
        device.free_command_buffer(cmd)


def _descriptor_sets(vk, device, dispatches, enc):
    if not dispatches:
        return []
    pipelines = [device.pipeline(d.shader, d.variant, d.spec) for d in dispatches]
    total = sum(max(1, p.bindings) for p in pipelines)
    sizes = [vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=total)]
    info = vk.VkDescriptorPoolCreateInfo(maxSets=len(dispatches), poolSizeCount=1, pPoolSizes=sizes)
    enc.descriptor_pool = vk.vkCreateDescriptorPool(device.handle, info, None)
    layouts = [p.set_layout for p in pipelines]
    alloc = vk.VkDescriptorSetAllocateInfo(descriptorPool=enc.descriptor_pool, descriptorSetCount=len(layouts),
                                           pSetLayouts=layouts)
    sets = vk.vkAllocateDescriptorSets(device.handle, alloc)
    writes, keep = [], []
    for d, s in zip(dispatches, sets):
        if not d.views:
            continue
        infos = [vk.VkDescriptorBufferInfo(buffer=_handle(v.buffer), offset=v.offset, range=max(v.nbytes, 4))
                 for v in d.views]
        keep.append(infos)
        writes.append(vk.VkWriteDescriptorSet(dstSet=s, dstBinding=0, descriptorCount=len(infos),
                                              descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                              pBufferInfo=infos))
    if writes:
        vk.vkUpdateDescriptorSets(device.handle, len(writes), writes, 0, None)
    return list(zip(pipelines, sets))


def _scopes(vk, stages: int, dst_host: bool = False):
    """(source stages, destination stages, memory barriers) of a wait for
    the earlier work of `stages` whose writes later commands (or the host) see."""
    src, wrote = 0, 0
    if stages & COMPUTE:
        src |= vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        wrote |= vk.VK_ACCESS_SHADER_WRITE_BIT
    if stages & TRANSFER:
        src |= vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        wrote |= vk.VK_ACCESS_TRANSFER_WRITE_BIT
    if dst_host:
        dst, access = vk.VK_PIPELINE_STAGE_HOST_BIT, vk.VK_ACCESS_HOST_READ_BIT
    else:
        dst = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        access = (vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT
                  | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
    return src, dst, [vk.VkMemoryBarrier(srcAccessMask=wrote, dstAccessMask=access)]


def _barrier(vk, cmd, stages: int = ALL_STAGES, dst_host: bool = False):
    """Later commands (or, with dst_host, the host) wait for the earlier
    work of `stages` and see what it wrote."""
    src, dst, barrier = _scopes(vk, stages, dst_host)
    vk.vkCmdPipelineBarrier(cmd, src, dst, 0, 1, barrier, 0, None, 0, None)


def _set_mark(vk, device, cmd, enc) -> None:
    """An event the device sets once every earlier command is done."""
    with vk_errors("creating a mark's event"):
        enc.events.append(vk.vkCreateEvent(device.handle, vk.VkEventCreateInfo(), None))
    device.objects["event"] += 1
    vk.vkCmdSetEvent(cmd, enc.events[-1], _scopes(vk, ALL_STAGES)[0])


def _wait_mark(vk, cmd, enc, stages: int) -> None:
    """Later commands wait for the commands before the last mark (its set
    event), not for those after it."""
    _src, dst, barrier = _scopes(vk, stages)
    vk.vkCmdWaitEvents(cmd, 1, [enc.events[-1]], _scopes(vk, ALL_STAGES)[0], dst, 1, barrier, 0, None, 0, None)


def _encode(vk, device, cmd, commands, timestamps, enc, push_bytes):
    dispatches = [c for c in commands if isinstance(c, Dispatch)]
    bound = iter(_descriptor_sets(vk, device, dispatches, enc))
    labels = _label_runs(commands) if timestamps else []
    if timestamps:
        qinfo = vk.VkQueryPoolCreateInfo(queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=len(labels) + 1)
        enc.query_pool = vk.vkCreateQueryPool(device.handle, qinfo, None)
        enc.query_labels = [label for label, _ in labels]
    starts = {start: n for n, (_, start) in enumerate(labels)}
    begin = vk.VkCommandBufferBeginInfo()
    vk.vkBeginCommandBuffer(cmd, begin)
    if timestamps:
        vk.vkCmdResetQueryPool(cmd, enc.query_pool, 0, len(labels) + 1)
    # what earlier submissions (or the host) wrote is visible to this one
    _barrier(vk, cmd)
    hazards = Hazards()
    pipeline = None
    stage = vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT
    for i, c in enumerate(commands):
        if i in starts:
            # serialize at each node boundary so each interval is that node's work alone
            _barrier(vk, cmd)
            hazards.clear()
            vk.vkCmdWriteTimestamp(cmd, stage, enc.query_pool, starts[i])
        stages = hazards.wait_for(c)
        if stages and hazards.early:
            _wait_mark(vk, cmd, enc, stages)
        elif stages:
            _barrier(vk, cmd, stages)
        if stages:
            hazards.clear(stages, hazards.early)
        hazards.note(c)
        if isinstance(c, Mark):
            _set_mark(vk, device, cmd, enc)
        elif isinstance(c, Dispatch):
            pipe, dset = next(bound)
            if pipe.handle is not pipeline:
                vk.vkCmdBindPipeline(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.handle)
                pipeline = pipe.handle
            vk.vkCmdBindDescriptorSets(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe.layout, 0, 1, [dset], 0, None)
            data = vk.ffi.from_buffer(c.push.ljust(push_bytes, b"\0"))
            vk.vkCmdPushConstants(cmd, pipe.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, push_bytes, data)
            vk.vkCmdDispatch(cmd, *c.groups)
        elif isinstance(c, Fill):
            vk.vkCmdFillBuffer(cmd, _handle(c.view.buffer), c.view.offset, c.view.nbytes, c.value)
        elif isinstance(c, Signal):
            # the host reads the copies' staging once it sees the event; no later command waits
            _barrier(vk, cmd, TRANSFER, dst_host=True)
            vk.vkCmdSetEvent(cmd, c.events.handles[c.index], vk.VK_PIPELINE_STAGE_TRANSFER_BIT)
        else:
            region = [vk.VkBufferCopy(srcOffset=c.src.offset, dstOffset=c.dst.offset, size=c.src.nbytes)]
            vk.vkCmdCopyBuffer(cmd, _handle(c.src.buffer), _handle(c.dst.buffer), 1, region)
    if timestamps:
        _barrier(vk, cmd)
        vk.vkCmdWriteTimestamp(cmd, stage, enc.query_pool, len(labels))
    _barrier(vk, cmd, dst_host=True)
    for event in enc.events:   # unset for the next submission, once every wait on it is past
        vk.vkCmdResetEvent(cmd, event, _scopes(vk, ALL_STAGES)[0])
    vk.vkEndCommandBuffer(cmd)


def _label_runs(commands) -> list[tuple]:
    """[(label, index of its first command)] for each run of equal labels."""
    runs = []
    for i, c in enumerate(commands):
        if not runs or runs[-1][0] != c.label:
            runs.append((c.label, i))
    return runs


def read_timestamps(device, enc: Encoding) -> list[tuple]:
    """[(label, seconds)] for an encoding made with timestamps=True, after its
    submission has finished."""
    vk = load_vulkan()
    n = len(enc.query_labels) + 1
    data = vk.ffi.new("uint64_t[]", n)
    with vk_errors("reading timestamp queries"):
        vk.vkGetQueryPoolResults(device.handle, enc.query_pool, 0, n, n * 8, data, 8,
                                 vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT)
    ticks = [int(data[i]) for i in range(n)]
    scale = device.timestamp_period * 1e-9
    return [(label, max(0, ticks[i + 1] - ticks[i]) * scale) for i, label in enumerate(enc.query_labels)]
