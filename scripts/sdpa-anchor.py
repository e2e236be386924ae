#!/usr/bin/env python3
"""Same-run anchors for the compute-bound rows of `attn-bench`: torch's
scaled_dot_product_attention with the cuDNN and FLASH backends on each prefill row's shape, and
the dense bf16 matmul rate (torch.matmul, cuBLAS), timed on the same GPU right after the
benchmark, written into the benchmark's JSON beside our rows with the ratios.

    python3 scripts/sdpa-anchor.py bench.json        # adds the anchors to bench.json's rows

A prefill row's shape reads "BxL (+C cached) Hq/Hkv dD" (or "dkDK dvDV" where QK and V head
sizes differ): B requests of L new tokens after C cached ones, causal aligned to the end of each
sequence (our chunked prefill), Hq query heads over Hkv kv heads. torch runs it on dense
[B, L + C, Hkv, D] keys and values (our kernels read a paged cache); FLOPs are counted as ours
are: 2 * Hq * (DK + DV) per attended (query, key) pair.

Each prefill row gains "sdpa_cudnn_tflops" and "sdpa_flash_tflops" (null when the backend
refuses the shape, with the reason under "sdpa_notes") and "ours_over_cudnn" / "ours_over_flash".
The report gains "matmul_tflops_same_run" (the median of REPS products of two MATMUL_N x
MATMUL_N bf16 matrices) and every row with TFLOP/s (prefill, MLA at 128 heads) "ours_over_matmul":
the same-call counterpart of attn-bench's "matmul_tflops" and "pct_of_matmul", which are a fixed
H100 cuBLAS figure.
Exits 0 without touching the file when torch or a GPU is missing (the bundle runs it when it can).
"""

import json
import re
import sys

SHAPE = re.compile(r"^(\d+)x(\d+) \(\+(\d+) cached\) (\d+)q/(\d+)kv (?:d(\d+)|dk(\d+) dv(\d+))$")
WARMUP, REPS = 5, 20
MATMUL_N = 8192


def parse(shape):
    """(B, L, C, Hq, Hkv, D of QK, D of V) of a prefill row's shape."""
    m = SHAPE.match(shape)
    if m is None:
        return None
    b, q_len, cached, hq, hkv, d, dk, dv = m.groups()
    dk, dv = (d, d) if d else (dk, dv)
    return tuple(int(g) for g in (b, q_len, cached, hq, hkv, dk, dv))


def pairs(b, q_len, cached):
    # Query i (0-based among the new tokens) attends cached + i + 1 keys.
    return b * (q_len * cached + q_len * (q_len + 1) // 2)


def time_us(torch, fn):
    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPS):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def sdpa_call(torch, b, q_len, cached, hq, hkv, d, dv):
    """The call for one shape: [B, S, H, D] tensors viewed as [B, H, S, D] (how an engine holds
    them), bf16, causal aligned to the end when there are cached keys."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    kv_len = cached + q_len
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, q_len, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    k = torch.randn(b, kv_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    v = torch.randn(b, kv_len, hkv, dv, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    if cached:
        from torch.nn.attention.bias import causal_lower_right

        mask = {"attn_mask": causal_lower_right(q_len, kv_len)}
    else:
        mask = {"is_causal": True}
    if hq != hkv:
        # Native GQA where the backend takes it; else K/V repeated per query head (the anchor is
        # compute-bound, so the extra reads cost little).
        try:
            sdpa(q[:, :, :1], k[:, :, :1], v[:, :, :1], enable_gqa=True, **({"is_causal": True} if not cached else {}))
            return lambda: sdpa(q, k, v, enable_gqa=True, **mask)
        except Exception:  # noqa: BLE001 - any refusal means "repeat"
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
    return lambda: sdpa(q, k, v, **mask)


def matmul_tflops(torch):
    """The dense bf16 matmul rate: C = A B with A, B MATMUL_N x MATMUL_N (cuBLAS through torch)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16, generator=gen)
    us = time_us(torch, lambda: torch.matmul(a, b))
    del a, b
    torch.cuda.empty_cache()
    return round(2.0 * MATMUL_N**3 / (us * 1e-6) / 1e12, 1)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[0])
        print("usage: sdpa-anchor.py BENCH_JSON")
        return 2
    path = sys.argv[1]
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        print("sdpa-anchor: no torch here; no anchors")
        return 0
    if not torch.cuda.is_available():
        print("sdpa-anchor: torch sees no GPU; no anchors")
        return 0
    with open(path) as f:
        report = json.load(f)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    print(f"\nsdpa-anchor: torch {torch.__version__}, {torch.cuda.get_device_name()}")
    prefill = [r for r in report["rows"] if parse(r.get("shape", "")) and "tflops" in r and r["kernel"].startswith("prefill")]
    if prefill:
        print(f"{'shape':<40} {'ours TF/s':>10} {'cuDNN':>8} {'FLASH':>8} {'ours/cuDNN':>11} {'ours/FLASH':>11}")
    for row in prefill:
        shape = parse(row["shape"])
        b, q_len, cached, hq, hkv, d, dv = shape
        flops = 2.0 * hq * (d + dv) * pairs(b, q_len, cached)
        notes = {}
        for name, backend in backends.items():
            tflops = None
            try:
                fn = sdpa_call(torch, *shape)
                with sdpa_kernel([backend]):
                    us = time_us(torch, fn)
                tflops = round(flops / (us * 1e-6) / 1e12, 1)
            except Exception as e:  # noqa: BLE001 - a refusal is reported, not fatal
                notes[name] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            row[f"sdpa_{name}_tflops"] = tflops
            row[f"ours_over_{name}"] = round(row["tflops"] / tflops, 3) if tflops else None
            torch.cuda.empty_cache()
        if notes:
            row["sdpa_notes"] = notes
        fmt = lambda x: "n/a" if x is None else f"{x}"  # noqa: E731
        print(
            f"{row['shape']:<40} {row['tflops']:>10} {fmt(row['sdpa_cudnn_tflops']):>8} {fmt(row['sdpa_flash_tflops']):>8}"
            f" {fmt(row['ours_over_cudnn']):>11} {fmt(row['ours_over_flash']):>11}"
        )
        for name, note in notes.items():
            print(f"    {name}: {note}")
    matmul = matmul_tflops(torch)
    report["matmul_tflops_same_run"] = matmul
    print(f"\nbf16 matmul {MATMUL_N}^3 (cuBLAS): {matmul} TFLOP/s; ours / matmul:")
    for row in report["rows"]:
        if "tflops" in row:
            row["ours_over_matmul"] = round(row["tflops"] / matmul, 3)
            print(f"{row['kernel'][:24]:<24} {row.get('shape', '')[:56]:<56} {row['tflops']:>7} {row['ours_over_matmul']:>7}")
    report["sdpa_torch"] = torch.__version__
    with open(path, "w") as f:
        # One row a line, as attn-bench writes it.
        rows = ",\n".join(json.dumps(r, separators=(",", ":")) for r in report["rows"])
        head = {k: v for k, v in report.items() if k != "rows"}
        f.write(json.dumps(head, separators=(",", ":"))[:-1] + ',"rows":[\n' + rows + "\n]}\n")
    print(f"anchors written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
