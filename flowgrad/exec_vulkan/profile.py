"""Per-node times of a recorded step program: GPU timestamps around each
section (node and direction), or, where the device has no timestamps, the
wall time of each section submitted alone. Each returns [(label, [seconds
per run])] in step order."""
from __future__ import annotations


from flowgrad.exec_vulkan.encoder import encode, read_timestamps, timed_submits


def by_timestamps(device, prog, feeds, hyper, steps):
    cmd = device.command_buffer()
    try:
        enc = encode(device, cmd, prog.rec.commands, timestamps=True)
        try:
            runs = [(label, []) for label in enc.query_labels]
            for _ in range(steps):
                prog.write_inputs(feeds, hyper)
                device.submit_and_wait(cmd, "profiling a graph step")
                for (label, times), (_l, seconds) in zip(runs, read_timestamps(device, enc)):
                    times.append(seconds)
        finally:
            enc.free()
    finally:
        device.free_command_buffer(cmd)
    return runs


def by_wall_clock(device, prog, feeds, hyper, steps):
    groups: list[tuple] = []
    for c in prog.rec.commands:
        if not groups or groups[-1][0] != c.label:
            groups.append((c.label, []))
        groups[-1][1].append(c)
    runs = [(label, []) for label, _ in groups]
    for _ in range(steps):
        prog.write_inputs(feeds, hyper)
        for (label, cmds), (_l, times) in zip(groups, runs):
            times += timed_submits(device, cmds, 1, "profiling a graph step")
    return runs
