"""Measure the floors of SPEC §8 on this GPU: cuBLAS BF16 and FP8 8192^3 rates, device copy bandwidth."""
import statistics

import torch


def median_ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def floors():
    n = 8192
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    bf16 = 2 * n ** 3 / median_ms(lambda: a @ b) / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8 = 2 * n ** 3 / median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e9
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    tbps = 2 * src.numel() / median_ms(lambda: dst.copy_(src)) / 1e9  # bytes/ms/1e9 = TB/s
    return dict(bf16_tflops=bf16, fp8_tflops=fp8, copy_tbps=tbps, gpu=torch.cuda.get_device_name())


if __name__ == "__main__":
    print(floors())
