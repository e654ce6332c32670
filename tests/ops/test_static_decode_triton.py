"""A whole static decode step on the GPU's paths, checked on the CPU: with
`triton_kernels.interpret_on_the_cpu()` every Triton kernel of the step (the kept heads'
cache write and split attention, with RoPE inside them; the window's ring-buffer write and
attention; the mamba2 step) runs through Triton's interpreter, in a subprocess (the
interpreter is chosen when a kernel is defined), and the logits must be those of the
ordinary PyTorch decode: for a left-padded batch, on Llama (GQA) and Qwen2 (q/k/v biases)."""

import textwrap
from pathlib import Path

from triton_interpreter import needs_triton, worst_error

CHECK = textwrap.dedent("""
    import os
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from tiny_models import MIXERS, decode_after_prefill, open_gates, spec_for, tiny_model
    from triton.runtime.interpreter import InterpretedFunction
    from recurformer.ops import kernels, triton_kernels
    from recurformer.surgery import convert

    os.environ[kernels.ENV] = "torch"  # the PyTorch paths, which the Triton kernels replace on a GPU
    kernels.reset()
    launched = set()
    launch = InterpretedFunction.run
    def counted(self, *args, **kwargs):
        launched.add(self.__name__)
        return launch(self, *args, **kwargs)
    InterpretedFunction.run = counted

    torch.manual_seed(0)
    cases = []
    for arch in ("llama", "qwen2"):
        model = tiny_model(arch)
        converted = open_gates(convert(model, spec_for(model, 0.5), MIXERS["window+mamba2"], init="random"))
        ids, mask = torch.randint(1, 97, (2, 40)), torch.ones(2, 40, dtype=torch.long)
        mask[1, :15] = 0  # the second prompt is 25 tokens, left-padded
        cases.append((converted, ids, mask, torch.randint(1, 97, (2, 12))))
    expected = [decode_after_prefill(*case, graphed=False)[0] for case in cases]  # PyTorch: no kernel taken yet
    assert not launched
    triton_kernels.interpret_on_the_cpu()
    worst = max(float((decode_after_prefill(*case, graphed=True)[0] - ref).norm() / ref.norm())
                for case, ref in zip(cases, expected))
    assert not triton_kernels._failed, triton_kernels._failed
    kernels_of_the_step = {{"_split_kernel", "_merge_kernel", "_cache_write_kernel", "_write_kernel", "_attend_kernel",
                           "_step_kernel"}}
    assert kernels_of_the_step <= launched, sorted(launched)
    print(worst)
""").format(tests=str(Path(__file__).resolve().parents[1]))


@needs_triton
def test_the_static_step_with_every_triton_kernel_decodes_as_pytorch():
    assert worst_error(CHECK) <= 1e-5
