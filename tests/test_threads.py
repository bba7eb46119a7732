"""Sessions used from several threads: each in a process of its own (a race
could crash the interpreter, which a test in this one would not outlive),
comparing the threads' results with the same steps run one after another.
On Vulkan (lavapipe) both paths, graph and closures, and on numpy."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import env_with_path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent('''
    import sys, threading, warnings
    import numpy as np
    import flowgrad as fg
    from flowgrad.exec_vulkan import runtime
    from flowgrad.training.optim import Adam

    device, backward, mode = sys.argv[1:]
    SRC = """
    config { batch = 4 }
    input x: f32[batch, 8]
    input y: i32[batch]
    param w: f32[8, 5] = normal(std=0.3)
    param b: f32[5] = zeros()
    h = tanh(x @ w + b)
    loss = cross_entropy(h, y)
    output h
    minimize loss
    """
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((4, 8)).astype(np.float32), "y": rng.integers(0, 5, 4).astype(np.int32)}
             for _ in range(6)]

    def make(seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sess = fg.loads(SRC).compile(device=device, backward=backward, seed=seed)
        assert sess.last_path.startswith(backward if device == "vulkan" else "closures"), sess.last_path
        return sess

    def steps(sess, opt, out, each=feeds):
        for f in each:
            out.append(sess.step(f, optimizer=opt).loss)
            out.append(sess.predict({"x": f["x"][:3]}, outputs=["h"])["h"])   # another size: a session of its own

    def threaded(target, args):
        threads = [threading.Thread(target=target, args=a) for a in args]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    if mode == "two-sessions":
        # two sessions on one device, each in its own thread, against each alone
        def train(sess, out):
            steps(sess, Adam(lr=0.05), out)
            out.append(sess.params["w"])

        want = [[], []]
        for seed, out in zip((1, 2), want):
            train(make(seed), out)
        got = [[], []]
        threaded(train, [(make(seed), out) for seed, out in zip((1, 2), got)])
        same = all(len(g) == len(w) and all(np.array_equal(a, b) for a, b in zip(w, g)) for w, g in zip(want, got))
    else:
        # one session stepped from two threads: every step whole, as if one after the other
        # (the same feed each step, so that the order does not matter)
        one = [feeds[0]] * 4
        alone, want = make(1), []
        steps(alone, Adam(lr=0.05), want, one + one)
        shared, opt, got = make(1), Adam(lr=0.05), [[], []]
        threaded(lambda g: steps(shared, opt, g, one), [(g,) for g in got])
        same = (np.array_equal(shared.params["w"], alone.params["w"])
                and sorted(map(float, got[0][::2] + got[1][::2])) == sorted(map(float, want[::2])))
    errors = runtime.validation_errors()
    print("same" if same and not errors else f"differ {errors[:1]}")
''')


def run_threads(device, backward, mode):
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, device, backward, mode], capture_output=True, text=True,
                              cwd=ROOT, env=env_with_path(ROOT), timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the threads hung (a step alone takes well under a second)")
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip() == "same", proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("backward", ["graph", "closures"])
@pytest.mark.parametrize("mode", ["two-sessions", "one-session"])
def test_threads_on_vulkan_give_what_one_thread_gives(vk_device, backward, mode):
    """Two sessions stepped from two threads gave other numbers than the same
    steps one after the other (graph), or crashed (closures): the device's
    queue, fence, command pool and buffer pool were shared unguarded."""
    run_threads("vulkan", backward, mode)


@pytest.mark.parametrize("mode", ["two-sessions", "one-session"])
def test_threads_on_numpy_give_what_one_thread_gives(mode):
    run_threads("cpu", "auto", mode)
