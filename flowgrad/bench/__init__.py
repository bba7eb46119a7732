"""Benchmarks of `flowgrad bench`: a training step beside its PyTorch twin
(step), GPT-2 124M's step (gpt2), the GEMM kernels (matmul) and
data-parallel steps over ranks (ranks). They time the library from above,
as a user would; nothing in the library imports them."""
