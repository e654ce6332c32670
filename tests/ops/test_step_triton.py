"""The Triton mamba2 decode step (`ops/step/triton.py`) against the PyTorch step, in fp32, on
the CPU through Triton's interpreter where Triton is installed (a subprocess: the interpreter
is chosen when the kernel is defined; it rounds to bf16 by truncation, so bf16 is checked on
a GPU only, tests/test_device.py)."""

import textwrap

from triton_interpreter import needs_triton, worst_error

CHECK = textwrap.dedent("""
    import torch
    from recurformer.ops.step.naive import mamba2_step_naive
    from recurformer.ops.step.triton import mamba2_step_triton
    torch.manual_seed(0)
    worst = 0.0
    # (rows, heads, groups, head dim, state, conv width, conv bias, norm): groups of several
    # heads, one group, sizes that are not powers of two, no bias, no norm
    for rows, H, G, P, N, K, bias, norm in [(2, 4, 2, 8, 6, 4, True, True), (1, 3, 1, 12, 16, 4, False, True),
                                            (3, 2, 2, 16, 4, 3, True, False)]:
        channels = G * P + G * N + H * N
        zxbcdt = torch.randn(rows, H * P + channels + H)
        conv, ssm = torch.randn(rows, channels, K), torch.randn(rows, H, P, N)
        weights = (torch.randn(channels, K), torch.randn(channels) if bias else None, torch.randn(H),
                   torch.randn(H), torch.randn(H), torch.randn(H * P) if norm else None)
        ref_conv, ref_ssm, out_conv, out_ssm = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
        ref = mamba2_step_naive(zxbcdt, ref_conv, ref_ssm, *weights, G, 1e-5)
        out = mamba2_step_triton(zxbcdt, out_conv, out_ssm, *weights, G, 1e-5)
        for a, b in ((out, ref), (out_conv, ref_conv), (out_ssm, ref_ssm)):
            worst = max(worst, float((a - b).norm() / b.norm()))
    print(worst)
""")


@needs_triton
def test_the_triton_step_matches_the_pytorch_step_in_the_interpreter():
    assert worst_error(CHECK) <= 1e-5
