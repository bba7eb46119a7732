"""Every built-in op is in every table: its grad rule (the VJP written as
ops), a Vulkan lowering, an ONNX converter or a refusal with its reason, and
a PyTorch twin. An op built from others (decompose) is only ever its parts."""
from __future__ import annotations

import pytest

from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.export_onnx import CONVERTERS, REFUSED
from flowgrad.ops import BUILTIN, OPS
from flowgrad.torch_twin import rule_for

NODES = [name for name in BUILTIN if OPS[name].decompose is None]


def test_the_tables_cover_a_real_set_of_ops():
    assert len(NODES) > 80 and {"matmul", "attention", "attention_grad", "embedding_grad", "softsign"} <= set(NODES)


@pytest.mark.parametrize("name", BUILTIN)
def test_every_op_has_its_vjp_written_as_ops(name):
    assert OPS[name].grad is not None, f"{name}: no grad rule"


@pytest.mark.parametrize("name", NODES)
def test_every_op_is_in_the_lowering_onnx_and_twin_tables(name):
    assert lowering_for(name) is not None, f"{name}: no Vulkan lowering"
    assert (name in CONVERTERS) != (name in REFUSED), f"{name}: neither an ONNX converter nor a refusal, or both"
    assert REFUSED.get(name, "a reason") != "", f"{name}: refused without a reason"
    assert rule_for(name) is not None, f"{name}: no PyTorch twin"
