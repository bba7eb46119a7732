"""The optimizer update alone, as its own recorded command buffer.

Data-parallel training splits a graph-path step in two submits: forward +
backward (the step program, reading the gradients back), then, once the
ranks have averaged the gradients on the host, this program: the averaged
gradients and the step's hyper-parameters are written into one packed
staging buffer, copied to the device in one transfer, and the optimizer's
recorded update runs on them against the resident params and state."""
from __future__ import annotations

import math
import weakref

import numpy as np

from flowgrad.dtypes import device_array
from flowgrad.exec_vulkan.encoder import encode
from flowgrad.exec_vulkan.limits import ALIGN, align_up
from flowgrad.exec_vulkan.optim_records import update_record
from flowgrad.exec_vulkan.program import free_program
from flowgrad.exec_vulkan.recorder import BufView, Recorder
from flowgrad.grad_paths import updated_params


class UpdateProgram:
    def __init__(self, sess, optimizer):
        device, graph = sess.device, sess.graph
        self.device = device
        offset = 0
        layout = {}
        trained = graph.trainable()   # state (batch norm's running statistics) takes no update
        for name, i in trained.items():
            node = graph.nodes[i]
            layout[name] = (offset, node.shape, node.dtype)
            offset = align_up(offset + max(node.type.nbytes, 4), ALIGN)
        h = np.asarray(optimizer.hyper(1, 1), np.float32)
        self.hyper_offset = offset
        self.nbytes = align_up(offset + max(h.nbytes, 4), ALIGN)
        self.staging = device.buffer(self.nbytes, "upload")
        self.packed = device.buffer(self.nbytes, "device")
        self.grads = {name: BufView(self.packed, off, shape, dtype) for name, (off, shape, dtype) in layout.items()}
        hyper = BufView(self.packed, self.hyper_offset, h.shape, "f32")
        params = {name: sess.param_view(name) for name in updated_params(graph)}   # those the loss reaches
        state = sess.optimizer_state_views(optimizer)
        words = (self.nbytes // 4,)
        rec = Recorder(device)
        with rec.section("averaged gradients in", "transfer"):
            rec.copy(BufView(self.staging, 0, words, "f32"), BufView(self.packed, 0, words, "f32"))
        with rec.section("optimizer", "optimizer"):
            update_record(optimizer)(rec, params, {name: self.grads[name] for name in params}, state, hyper)
        self.dispatches = rec.counts()["dispatches"]
        rec.arena.materialize(device)
        self.cmd = device.command_buffer()
        self.enc = encode(device, self.cmd, rec.commands)
        owned = [self.staging, self.packed]
        self._finalizer = weakref.finalize(self, free_program, device, self.cmd, self.enc, owned, rec.arena)
        self._finalizer.atexit = False

    def run(self, grads: dict[str, np.ndarray], hyper: np.ndarray) -> None:
        for name, view in self.grads.items():
            data = device_array(grads[name], view.dtype).reshape(-1)
            if data.size != math.prod(view.shape):
                raise ValueError(f"gradient {name!r} has {data.size} values, expected {view.shape}")
            self.staging.write(data, view.offset)
        self.staging.write(np.asarray(hyper, np.float32), self.hyper_offset)
        self.device.stats["dispatches"] += self.dispatches
        self.device.stats["uploads"] += 1
        self.device.submit_and_wait(self.cmd, "running the optimizer update")

    def free(self) -> None:
        self._finalizer()
