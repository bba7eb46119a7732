"""`flowgrad bench gpt2 --families`: kernel names and profiled nodes mapped
to families, a step's times grouped and their medians, the table, and the
option at a tiny size where PyTorch has no CUDA GPU (no timing asserts)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from conftest import needs_module

from flowgrad.bench import families
from flowgrad.cli import main as cli_main


@pytest.mark.parametrize("name, family", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "products"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "products"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "products"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false>, true>", "attention"),
    ("fmha_cutlassB_f32_aligned_64x64_k64_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "layernorm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>", "layernorm"),
    (("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>"), "cross_entropy"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>",
     "cross_entropy"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>",
     "embedding"),
    ("void at::native::embedding_backward_feature_kernel<float, float, long>", "embedding"),
    (("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>"), "optimizer"),
    (("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda("
     "at::TensorIteratorBase&)::{lambda()#1}, at::detail::Array<char*, 2>>"), "casts"),
    (("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl, "
     "at::detail::Array<char*, 2>>"), "elementwise"),
    (("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>>, unsigned int, float, 4>>"), "elementwise"),
    ("triton_poi_fused_add_gelu_0", "elementwise"),
    ("Memcpy HtoD (Pageable -> Device)", "transfers"),
    ("void cub::DeviceRadixSortOnesweepKernel<cub::DeviceRadixSortPolicy<long, long, int>::Policy800>", "other"),
])
def test_kernel_names_map_to_families(name, family):
    assert families.kernel_family(name) == family


def node(op, *steps):
    return SimpleNamespace(op=op, attrs={"steps": tuple((s, (), {}) for s in steps)} if steps else {})


def test_a_profile_groups_by_op_and_direction():
    """GraphSession.profile(nodes=True)'s sections: a fused chain that starts with a product is a
    product; a section of no node goes by its direction; the rest is listed under other."""
    nodes = [node("matmul"), node("fused", "matmul", "add", "gelu"), node("fused", "mul", "add"),
             node("attention"), node("layernorm"), node("cross_entropy"), node("embedding"), node("cast"),
             node("matmul_parts"), node("add"), node("sum"), node("scan")]
    profile = [("h", "forward", 1.0, 0), ("h", "backward", 2.0, 0), ("a", "forward", 4.0, 1),
               ("b", "backward", 0.5, 2), ("att", "forward", 3.0, 3), ("n", "backward", 0.25, 4),
               ("loss", "forward", 0.125, 5), ("e", "backward", 0.0625, 6), ("c", "forward", 8.0, 7),
               ("p", "forward", 16.0, 8), ("r", "forward", 32.0, 9), ("s", "backward", 64.0, 10),
               ("loop", "forward", 128.0, 11), ("optimizer", "optimizer", 256.0, None),
               ("feeds", "transfer", 512.0, None), ("read-back", "transfer", 1024.0, None),
               ("loss scale", "backward", 2048.0, None)]
    got = families.group(families.flowgrad_sections(profile, nodes))
    assert got["seconds"] == {"products": 23.0, "attention": 3.0, "elementwise": 96.5, "layernorm": 0.25,
                              "cross_entropy": 0.125, "embedding": 0.0625, "casts": 8.0, "optimizer": 256.0,
                              "transfers": 1536.0, "other": 2176.0}
    assert got["other"] == {"scan": 128.0, "loss scale": 2048.0}


def test_kernel_events_and_the_median_of_steps():
    """torch.profiler's events: only those that ran on the GPU count; each family's median over steps."""
    needs_module("torch")
    from torch.autograd import DeviceType

    def event(name, us, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    steps = [families.group(families.kernel_times([event("sm90_xmma_gemm", us), event("cudaLaunchKernel", 99.0,
                                                                                       DeviceType.CPU),
                                                   event("cub::RadixSort", 2.0)]))
             for us in (10.0, 30.0, 20.0)]
    got = families.medians(steps)
    assert got["seconds"]["products"] == pytest.approx(20e-6)
    assert got["seconds"]["other"] == pytest.approx(2e-6) and set(got["other"]) == {"cub::RadixSort"}
    assert sum(got["seconds"].values()) == pytest.approx(22e-6)


def test_the_table_gives_ms_and_ratios():
    def row(name, products, other=None):
        seconds = dict.fromkeys(families.FAMILIES, 0.0) | {"products": products}
        return {"name": name, "families": {"seconds": seconds, "other": other or {}, "timer": "t", "steps": 5}}

    lines = families.report([row("flowgrad mixed", 3e-3), {"name": "torch eager f32"},
                             row("torch eager bf16 autocast", 2e-3, {"k": 0.0})], ["missing line"])
    at = next(i for i, line in enumerate(lines) if line.startswith("family"))
    assert lines[at].split() == ["family", "flowgrad", "mixed", "torch", "eager", "bf16", "autocast", "ratio"]
    assert lines[at + 1].split() == ["products", "3.000", "2.000", "1.50x"]
    assert lines[at + 2].split() == ["attention", "0.000", "0.000", "-"]
    assert lines[at + len(families.FAMILIES) + 1].split() == ["total", "3.000", "2.000", "1.50x"]
    assert "other in torch eager bf16 autocast: k 0.000 ms" in lines
    assert lines[-1] == "missing line"


def test_bench_gpt2_families_at_a_tiny_size(vk_device, capsys):
    tiny = ["--set", "d=64", "heads=2", "layers=1", "seq=32", "vocab=128", "--batch", "2", "--steps", "2",
            "--warmup", "1"]
    assert cli_main(["bench", "gpt2", *tiny, "--device", "vulkan", "--families"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("family"))
    rows = {line.split()[0]: line.split()[1:] for line in lines[at + 1:at + len(families.FAMILIES) + 2]}
    assert list(rows) == [*families.FAMILIES, "total"]
    ms = {f: float(cells[0]) for f, cells in rows.items()}
    assert all(math.isfinite(t) and t >= 0 for t in ms.values())
    assert ms["products"] > 0 and ms["attention"] > 0 and ms["optimizer"] > 0
    assert ms["total"] == pytest.approx(sum(t for f, t in ms.items() if f != "total"), abs=0.01)
    if "torch eager bf16 autocast" not in lines[at]:   # no CUDA here: the last line says so
        assert lines[-1].startswith("kernel families: PyTorch's columns need a CUDA GPU; torch ")


def test_bench_gpt2_families_json(vk_device, capsys):
    import json

    tiny = ["--set", "d=32", "heads=2", "layers=1", "seq=16", "vocab=64", "--batch", "2", "--steps", "1",
            "--warmup", "1", "--dtype", "mixed", "--mixed", "f16"]
    assert cli_main(["bench", "gpt2", *tiny, "--device", "vulkan", "--families", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    fam = r["rows"][0]["families"]
    assert r["rows"][0]["name"] == "flowgrad mixed (f16)" and set(fam["seconds"]) == set(families.FAMILIES)
    assert r["families"]["families"] == list(families.FAMILIES)


def test_families_needs_the_mixed_step():
    from flowgrad.bench import gpt2
    from flowgrad.errors import FlowError

    with pytest.raises(FlowError, match="--families profiles the mixed-precision step"):
        gpt2.run(dtypes=("f32",), families=True)


def test_families_is_an_option_of_bench_gpt2(capsys):
    assert cli_main(["bench", "--families"]) != 0
    assert "--families: options of `bench gpt2`" in capsys.readouterr().err
