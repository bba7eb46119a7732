"""A step's feeds on their way in: each one copied straight into its region
of the upload staging buffer's mapped memory, through a typed view made once
per step program (no intermediate array, nothing allocated per step)."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import DEVICE_NUMPY, device_array
from flowgrad.errors import FlowError

HYPER = "@hyper"   # the optimizer's hyper(step) words; every other upload is a feed


class FeedWriter:
    def __init__(self, staging, uploads):
        """staging: the mapped upload Buffer (None when nothing is uploaded);
        uploads: [(name, staging view, device view)]."""
        self.targets = []
        for name, view, _dev in uploads:
            region = staging.array[view.offset:view.offset + view.nbytes]
            self.targets.append((name, region.view(DEVICE_NUMPY[view.dtype]).reshape(view.shape), view.dtype))

    def write(self, feeds: dict, hyper) -> None:
        """Each upload's value, converted to its dtype as it is copied in
        (feeds already checked by the session; "@scale" is one of them)."""
        for name, target, dtype in self.targets:
            data = hyper if name == HYPER else feeds[name]
            shape = data.shape if type(data) is np.ndarray else np.shape(data)
            if shape != target.shape:
                what = "the optimizer's hyper(step)" if name == HYPER else f"feed {name!r}"
                raise FlowError(f"{what} has shape {list(shape)}; the recorded step expects {list(target.shape)}")
            np.copyto(target, device_array(data, dtype) if dtype == "bf16" else data, casting="unsafe")
