"""The rule the Triton kernels share (`ops/triton_kernels.py`): where they run, and what a
kernel that fails leaves behind."""

import torch

from recurformer.ops import triton_kernels


def test_a_failing_kernel_is_reported_once_and_its_pytorch_path_runs(capsys, monkeypatch):
    monkeypatch.setattr(triton_kernels, "_failed", {})

    def broken(x):
        raise RuntimeError("PassManager::run failed\nmore lines of the compiler")

    assert triton_kernels.run("test step", broken, lambda x: x + 1, 1) == 2
    assert capsys.readouterr().err == ("recurformer: the Triton test step failed (RuntimeError: PassManager::run "
                                       "failed); using PyTorch\n")
    assert triton_kernels._failed == {"test step": "RuntimeError: PassManager::run failed"}
    monkeypatch.setattr(triton_kernels, "triton", object())  # as if Triton were there: still refused by name
    assert not triton_kernels.takes("test step", torch.zeros(1))


def test_kernels_run_only_on_a_gpu_and_without_gradients(monkeypatch):
    monkeypatch.setattr(triton_kernels, "triton", object())
    monkeypatch.setattr(triton_kernels, "_failed", {})
    cpu = torch.zeros(2)
    assert not triton_kernels.takes("a step", cpu)  # the CPU has its own kernels
    if torch.cuda.is_available():
        gpu = torch.zeros(2, device="cuda")
        assert triton_kernels.takes("a step", gpu)
        assert not triton_kernels.takes("a step", gpu, torch.zeros(2, device="cuda", requires_grad=True))
    monkeypatch.setattr(triton_kernels, "triton", None)
    assert not triton_kernels.takes("a step", cpu)
