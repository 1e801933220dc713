"""`mxval backends` names the real reason a compiled vLLM backend is unavailable."""
import torch


def test_vllm_compiled_backends_without_a_gpu_point_to_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")        # as after an interpreted backend loaded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from optimized.vllm_triton_backend import make_cuda_backend, make_rocm_backend
    for make, name in ((make_cuda_backend, "vllm-cuda"), (make_rocm_backend, "vllm-rocm")):
        why = make().available()
        assert why and "no CUDA or ROCm GPU" in why and f"use {name}-interpret" in why, why
        assert "TRITON_INTERPRET" not in why
