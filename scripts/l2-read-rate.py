#!/usr/bin/env python3
"""The read rate of a buffer that stays in L2, beside one that does not: an instrument for the
memory-bound and copy-bound kernels (the 128-head MLA rows copy every latent row into two CTAs,
so L2 serves it twice).

    python3 scripts/l2-read-rate.py      # on the GPU machine (torch with Triton)

A Triton kernel in which every program XORs its share of an int32 buffer `reps` times with
L2-only loads (`.cg`), the shares rotated each pass so that no SM re-reads its own lines from
L1; the best of five launches. Buffers of 8 to 48 MiB stay in an H100's or H200's L2 (50-60 MB);
1024 MiB is read from DRAM. This instrument reads about 12% below attn-bench's read ceiling at
1024 MiB (its own PTX kernel), so its L2 figures are a lower bound.
"""
import torch, triton, triton.language as tl

@triton.jit
def read_rot(x_ptr, out_ptr, n_blocks, reps, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for r in range(reps):
        b = pid + r * 7
        while b < n_blocks + r * 7:
            blk = b % n_blocks
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(x_ptr + offs, cache_modifier=".cg")
            b += nprog
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)

def run(mb, reps, ctas_per_sm=4, BLOCK=2048, warps=8):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = mb * 2**20 // 4
    x = torch.randint(0, 2**30, (n,), device='cuda', dtype=torch.int32)
    grid = sms * ctas_per_sm
    out = torch.empty(grid * BLOCK, device='cuda', dtype=torch.int32)
    nb = n // BLOCK
    read_rot[(grid,)](x, out, nb, reps, BLOCK=BLOCK, num_warps=warps)
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    best = 1e30
    for _ in range(5):
        s.record(); read_rot[(grid,)](x, out, nb, reps, BLOCK=BLOCK, num_warps=warps); e.record(); torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3)
    return reps * n * 4 / best / 1e6  # TB/s

print(torch.cuda.get_device_name(0))
for mb, reps in [(8, 64), (16, 32), (24, 24), (32, 16), (48, 12), (1024, 1)]:
    for c in (2, 4):
        print(f"{mb:5d} MiB x {reps:3d} passes, {c} CTAs/SM: {run(mb, reps, c):6.2f} TB/s", flush=True)
