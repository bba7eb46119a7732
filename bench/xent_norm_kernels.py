"""GPU time of cross_entropy and layernorm, forward and backward, at GPT-2
124M's shapes (logits [8192, 50304], activations [8192, 768]) in mixed
precision (f16 activations, f32 arithmetic), on the graph path: each node's
sections of the step's GPU-timestamp profile (GraphSession.profile), and the
kernels each section ran. `--torch`: F.cross_entropy and F.layer_norm under
bf16 autocast, eager and torch.compile'd, timed by CUDA events.

    python bench/xent_norm_kernels.py [--rows 8192] [--vocab 50304] [--torch] [--shared-sums] [--vectors] [--json OUT]

`--vectors`: the step timed four times in turn, layernorm's forward and
backward by norm_sg and by norm_vec (rows in 16-byte vectors) alternately, in
one process.
`--shared-sums`: layernorm's row sums through shared memory (norm.comp) even
where the device has subgroup shuffles (norm_sg.comp), to time the two.

The model: two layernorms (the first's dx stored, the second's added to the
residual its input also feeds, as a pre-norm block's are) and the loss.
A benchmark, not a test: nothing asserts the numbers."""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

MODEL = """
model xent_norm
config {
  n = 8192
  d = 768
  vocab = 50304
}
input t: i32[n]
param x: f32[n, d] = normal(std=1.0)
param g1: f32[d] = ones()
param b1: f32[d] = zeros()
param g2: f32[d] = ones()
param b2: f32[d] = zeros()
param w: f32[d, vocab] = normal(std=0.02)
h = layernorm(x, g1, b1)
h = h + layernorm(h, g2, b2)
loss = cross_entropy(h @ w, t)
minimize loss
"""


def flowgrad_times(rows: int, d: int, vocab: int, steps: int) -> dict:
    import flowgrad as fg

    model = fg.loads(MODEL, {"n": rows, "d": d, "vocab": vocab})
    sess = model.compile(device="vulkan", dtype="mixed", backward="graph")
    feeds = {"t": np.random.default_rng(0).integers(0, vocab, rows).astype(np.int32)}
    sess.step(feeds)
    assert sess.last_path == "graph", sess.last_path
    runner = sess.runner
    profile = runner.profile(sess.runner_feeds(feeds, True), steps, grads=True, nodes=True)
    nodes = runner.graph.nodes
    kernels = {}   # each section's dispatches: shader (groups)
    for c in runner._program(True, False, None).rec.commands:
        if c.label is not None and len(c.label) > 2 and c.label[2] is not None:
            kernels.setdefault((c.label[2], c.label[1]), []).append(
                f"{getattr(c, 'shader', type(c).__name__)}{list(getattr(c, 'groups', ()))[:1]}")
    out = {}
    for label, direction, seconds, nid in profile:
        if nid is None:
            continue
        node = nodes[nid]
        op = node.attrs["steps"][0][0] if node.op == "fused" else node.op
        if op in ("layernorm", "cross_entropy"):
            key = f"{op} #{nid} {direction}"
            out[key] = out.get(key, 0.0) + seconds * 1e3
            print(key, " ".join(kernels.get((nid, direction), [])))
    sess.close()
    return out


def cuda_ms(fn, steps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def torch_times(rows: int, d: int, vocab: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    z = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    x = torch.randn(rows, d, device="cuda").to(torch.bfloat16).requires_grad_()
    gy = torch.randn(rows, d, device="cuda")
    ln = torch.nn.LayerNorm(d).cuda()

    def xent(z, t):
        with torch.autocast("cuda", torch.bfloat16):
            return F.cross_entropy(z, t)

    def norm(x):
        with torch.autocast("cuda", torch.bfloat16):
            return ln(x)

    out = {}
    for name, xf, nf in (("eager", xent, norm), ("compile", torch.compile(xent), torch.compile(norm))):
        out[f"torch {name} cross_entropy forward"] = cuda_ms(lambda: xf(z, t), steps)
        out[f"torch {name} cross_entropy forward+backward"] = cuda_ms(lambda: xf(z, t).backward(), steps)
        out[f"torch {name} layernorm forward"] = cuda_ms(lambda: nf(x), steps)
        out[f"torch {name} layernorm forward+backward"] = cuda_ms(lambda: nf(x).backward(gy), steps)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--shared-sums", action="store_true")
    ap.add_argument("--vectors", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    from flowgrad.exec_vulkan.lower import norm
    if a.shared_sums:
        norm.SUBGROUP_SUMS = False
    if a.torch:
        times = torch_times(a.rows, a.d, a.vocab, a.steps)
    elif a.vectors:
        times = {}
        for turn, vectors in enumerate((False, True, False, True)):
            norm.VECTOR_ROWS = vectors
            label = f"[{'norm_vec' if vectors else 'norm_sg'} {turn // 2 + 1}] "
            times.update({label + k: v for k, v in flowgrad_times(a.rows, a.d, a.vocab, a.steps).items()})
    else:
        times = flowgrad_times(a.rows, a.d, a.vocab, a.steps)
    for k, v in times.items():
        print(f"{k:<55}{v:9.3f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(times, f, indent=1)


if __name__ == "__main__":
    main()
