"""Weight-stream microbenchmark (developer tool, device): the small-tile W4A16 GEMM1's weight reads at T=1024 on
the reference shape (E=288, 2I=2048 rows, K=4096: 2048 B per row). Programs (16 column blocks x ~351 route tiles of
32 rows, an expert with more rows taking a second tile that reads its weights again) each read 64 K steps of two
2-KB pieces (the gate and up 64-row blocks). Layouts: 'blocks' = the prepared one (each 64-row block's 128 KB
contiguous, a step's 2 KB after the previous); 'interleaved' = per expert and K step, all 32 row blocks' pieces
adjacent. Plain Triton loads (pipelined), no conversion, no MMA; prints time and TB/s (requested, unique bytes) and
a device copy's.

    python3 scripts/weight_stream.py
"""
import torch, triton, triton.language as tl
from mxmoe.bench import cuda_event_sampler, median

@triton.jit
def rd(src, tile_expert, out, NB: tl.constexpr, STEPS: tl.constexpr, INTER: tl.constexpr, NS: tl.constexpr):
    cb = tl.program_id(0)
    t = tl.program_id(1)
    e = tl.load(tile_expert + t).to(tl.int64)
    w = tl.arange(0, 512)  # 2 KB as int32 words
    acc = tl.zeros((512,), tl.int32)
    exp_words = 2 * NB * STEPS * 512  # 32 row blocks x 64 steps x 2 KB
    for s in tl.range(0, STEPS, num_stages=NS):
        for h in tl.static_range(2):
            blk = h * NB + cb
            if INTER:
                off = e * exp_words + (s * 2 * NB + blk) * 512 + w
            else:
                off = e * exp_words + (blk * STEPS + s) * 512 + w
            acc ^= tl.load(src + off, cache_modifier=".cg")
    tl.store(out + (t * NB + cb) * 512 + w, acc)

E, NB, STEPS = 288, 16, 64
torch.manual_seed(0)
counts = torch.distributions.Binomial(8192, torch.full((E,), 1 / E)).sample().long()
tiles = []
for e in range(E):
    tiles += [e] * max(1, -(-int(counts[e]) // 32))
tile_expert = torch.tensor(tiles, dtype=torch.int32, device="cuda")
nt = len(tiles)
src = torch.randint(0, 1 << 30, (E * 2 * NB * STEPS * 512,), dtype=torch.int32, device="cuda")
out = torch.empty(nt * NB * 512, dtype=torch.int32, device="cuda")
req = nt * NB * STEPS * 2 * 2048
uniq = E * 2 * NB * STEPS * 2048
print(f"tiles {nt}, requested {req/1e9:.2f} GB, unique {uniq/1e9:.2f} GB")
cp_src = torch.empty(uniq // 2, dtype=torch.int32, device="cuda"); cp_dst = torch.empty_like(cp_src)
for ns in (3, 4, 6):
    for inter in (False, True):
        f = lambda: rd[(NB, nt)](src, tile_expert, out, NB=NB, STEPS=STEPS, INTER=inter, NS=ns, num_warps=4)
        ts = []
        for _ in range(3):
            ts += cuda_event_sampler(f, 20)
        t = median(ts)
        name = "interleaved" if inter else "blocks     "
        print(f"stages {ns} {name}: {t:.3f} ms  requested {req / t / 1e9:.2f} TB/s  unique {uniq / t / 1e9:.2f} TB/s",
              flush=True)
f = lambda: cp_dst.copy_(cp_src)
t = median(cuda_event_sampler(f, 30))
print(f"copy {2*cp_src.numel()*4/t/1e9:.2f} TB/s")
