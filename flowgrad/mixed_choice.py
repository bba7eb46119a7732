"""What dtype="mixed" computes in, and why.

bf16 keeps f32's exponent range, so gradients do not underflow and the loss
needs no scaling: no scaler, no skipped steps, as PyTorch's bf16 autocast.
f16 has three more bits of mantissa but underflows below 6e-8, so it takes
dynamic loss scaling (flowgrad/loss_scale.py). "auto" takes bf16 where the
device multiplies bf16 on cooperative matrices (VK_KHR_shader_bfloat16): there
bf16 runs the bf16 builds of f16's kernels (matmul_cm2's tiles, the
cooperative-matrix attention kernels), a GPT-2 124M step 2% slower than f16's
(53.7 ms against 52.6 on an H100, 2026-12-06) for a step with no loss scale to
tend; elsewhere f16, whose products have tensor cores on more devices. "bf16"
forces it anywhere: storage is the top 16 bits of an f32 on every Vulkan
device (products on bf16 cooperative matrices where offered, else on the
f32-arithmetic tiled kernels), and numpy emulates it (flowgrad.dtypes.round_bf16)."""
from __future__ import annotations

import attrs

from flowgrad.dtypes import MIXED_HALVES
from flowgrad.errors import FlowError


@attrs.frozen
class MixedChoice:
    half: str     # "bf16" or "f16"
    reason: str   # one line: why, and where its products run

    @property
    def loss_scaled(self) -> bool:
        return self.half == "f16"

    @property
    def summary(self) -> str:
        return f"{self.half}{' with loss scaling' if self.loss_scaled else ''}: {self.reason}"


def check_mixed(mixed, dtype: str, loss_scale) -> None:
    """A FlowError for a `mixed` choice that is no choice, or that contradicts dtype or loss_scale."""
    if not isinstance(mixed, str) or mixed not in MIXED_HALVES:
        raise FlowError(f"mixed must be one of {', '.join(repr(m) for m in MIXED_HALVES)}, got {mixed!r}")
    if mixed != "auto" and dtype != "mixed":
        raise FlowError(f"mixed={mixed!r} chooses what dtype='mixed' computes in, but dtype is {dtype!r}",
                        hint="add dtype='mixed' (--dtype mixed), or leave mixed out")
    if mixed == "bf16" and loss_scale is not None:
        raise FlowError("loss_scale was given with mixed='bf16': bf16 has f32's range and trains without loss "
                        "scaling", hint="leave loss_scale out, or use mixed='f16'")


def choose(mixed: str, info, loss_scale=None) -> MixedChoice:
    """What dtype="mixed" computes in on the device `info` describes (a
    DeviceInfo, or None for numpy)."""
    offered = info is not None and not info.bf16_lacks
    if mixed == "bf16":
        return MixedChoice("bf16", "asked for (mixed='bf16'); " + bf16_products(info))
    if mixed == "f16":
        return MixedChoice("f16", "asked for (mixed='f16')")
    if loss_scale is not None:
        return MixedChoice("f16", "a loss_scale was given")
    if info is None:
        return MixedChoice("f16", "the session runs on numpy, which has no bf16 cooperative matrices "
                                  "(mixed='bf16' emulates bf16 there)")
    if offered:
        return MixedChoice("bf16", "the device multiplies bf16 on cooperative matrices; " + bf16_products(info)
                           + " (mixed='f16' takes f16 with loss scaling)")
    return MixedChoice("f16", f"{info.bf16_lacks} (mixed='bf16' stores bf16 all the same, with f32 products)")


def bf16_products(info) -> str:
    """Where bf16's products run on the device `info` describes."""
    if info is None:
        return "emulated on numpy: each op computes in f32 and rounds its result once to bf16"
    if not info.bf16_lacks:
        return "products on bf16 cooperative matrices"
    return f"bf16 storage, products on the f32-arithmetic tiled kernels ({info.bf16_lacks})"
