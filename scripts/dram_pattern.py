"""DRAM read bandwidth of the packed-weight access pattern (developer tool, device).

    python3 scripts/dram_pattern.py

Programs read ``rows`` rows of 2048 bytes ``chunk`` bytes at a time (the GEMMs' per-stage weight
reads) or the same bytes as contiguous tiles; prints GB/s per variant and a device copy's.
"""
import torch, triton, triton.language as tl
from mxmoe.bench import cuda_event_sampler, median

@triton.jit
def rd(src, out, row_words, ROWS: tl.constexpr, CW: tl.constexpr, STEPS: tl.constexpr, TILED: tl.constexpr,
       NS: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, CW)[None, :]
    acc = tl.zeros((ROWS, CW), tl.int32)
    base = pid.to(tl.int64) * ROWS * row_words
    for it in tl.range(0, STEPS, num_stages=NS):
        if TILED:
            off = base + it * (ROWS * CW) + r * CW + c
        else:
            off = base + r * row_words + it * CW + c
        acc ^= tl.load(src + off)
    tl.store(out + pid * ROWS * CW + r * CW + c, acc)

total_words = (770 << 20) // 4
row_words = 512  # 2048-byte rows (K = 4096)
src = torch.randint(0, 1 << 30, (total_words,), dtype=torch.int32, device="cuda")
res = []
for rows, cw, tiled, ns in [(64, 8, 0, 1), (64, 8, 0, 4), (64, 16, 0, 4), (64, 32, 0, 4), (128, 8, 0, 4), (16, 32, 0, 4),
                            (64, 8, 1, 4), (64, 16, 1, 4), (64, 32, 1, 4), (16, 128, 0, 4)]:
    progs = total_words // (rows * row_words)
    out = torch.empty(progs * rows * cw, dtype=torch.int32, device="cuda")
    f = lambda: rd[(progs,)](src, out, row_words, ROWS=rows, CW=cw, STEPS=row_words // cw, TILED=tiled, NS=ns, num_warps=4)
    f(); torch.cuda.synchronize()
    ms = median(cuda_event_sampler(f, 20))
    r = dict(rows=rows, chunk_bytes=cw * 4, tiled=tiled, stages=ns, GBs=total_words * 4 / ms / 1e6)
    print(r, flush=True); res.append(r)
copy = torch.empty_like(src)
ms = median(cuda_event_sampler(lambda: copy.copy_(src), 20))
print("copy GB/s (r+w)", 2 * total_words * 4 / ms / 1e6)
