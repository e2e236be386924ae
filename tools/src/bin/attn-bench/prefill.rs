//! `--only prefill`: causal prefill from the paged cache (bf16, and FP8 E4M3 on two shapes), and
//! rows from packed K/V (compute-bound rows, against the matmul rate).

use crate::bench::{dev, env_shapes, random_device, random_slots, Bench, Row};
use attn_rs::cache_write::KvScales;
use attn_rs::{BatchMetadata, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, Fp8E5m2, KvCacheSpec, KvLayout, Result, RowsDesc};
use cudarc::driver::CudaSlice;
use half::bf16;

#[derive(Clone, Copy)]
struct PrefillShape {
    batch: usize,
    /// New tokens per request.
    q_len: usize,
    /// Cached tokens before them.
    cached: usize,
    q_heads: usize,
    kv_heads: usize,
    head_size: usize,
    /// V's head size: `head_size` but for QK 192 / V 128 (packed K/V).
    head_size_v: usize,
    /// Keys and values from packed `[tokens, kv heads, head size]` tensors instead of the paged
    /// cache (no cached tokens).
    packed: bool,
    /// An FP8 E4M3 cache (one scale a tensor) under bf16 queries.
    fp8: bool,
}

/// Causal prefill, bf16 queries, from the paged cache of `C` (block size 16, scattered block
/// tables) or packed bf16 K/V. FLOPs = 2 * q_heads * (head size of QK + of V) * attended pairs.
fn prefill_row<C: Element>(b: &Bench, sh: &PrefillShape, status: &mut DeviceStatus) -> Result<Row> {
    use attn_rs::prefill::{prefill, PrefillArgs, PrefillKv, PrefillOptions, PrefillWorkspace};
    use attn_rs::AttnOptions;
    let s = &b.stream;
    let block_size = 16;
    let seq = sh.cached + sh.q_len;
    let blocks_per_req = seq.div_ceil(block_size);
    let num_blocks = sh.batch * blocks_per_req;
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, num_blocks, block_size, sh.kv_heads, sh.head_size)?;
    let cache = random_device::<C>(s, spec.num_elements(), 21)?;
    let fp8 = C::DTYPE.is_fp8();
    let (ks, vs) = (s.clone_htod(&[0.05f32])?, s.clone_htod(&[0.05f32])?);
    let block_table: Vec<i32> = random_slots(num_blocks, num_blocks, 22).into_iter().map(|x| x as i32).collect();
    let seq_lens = vec![seq as i32; sh.batch];
    let qsl: Vec<i32> = (0..=sh.batch).map(|r| (r * sh.q_len) as i32).collect();
    let nt = sh.batch * sh.q_len;
    let q_rows = RowsDesc::contiguous(nt, sh.q_heads, sh.head_size);
    let out_rows = RowsDesc::contiguous(nt, sh.q_heads, sh.head_size_v);
    let q = random_device::<bf16>(s, q_rows.required_len(), 23)?;
    let mut out: CudaSlice<bf16> = s.alloc_zeros(out_rows.required_len())?;
    let bt = s.clone_htod(&block_table)?;
    let (k_rows, v_rows) = (RowsDesc::contiguous(nt, sh.kv_heads, sh.head_size), RowsDesc::contiguous(nt, sh.kv_heads, sh.head_size_v));
    let (k, v) = if sh.packed {
        (random_device::<bf16>(s, k_rows.required_len(), 24)?, random_device::<bf16>(s, v_rows.required_len(), 25)?)
    } else {
        (s.alloc_zeros(1)?, s.alloc_zeros(1)?)
    };
    let mut ws = PrefillWorkspace::new(s, nt, sh.batch, sh.q_heads / sh.kv_heads)?;
    let opts = PrefillOptions { attn: AttnOptions::new(sh.head_size), causal: true };
    let batch =
        if sh.packed { BatchMetadata::with_key_start_loc(s, &seq_lens, &qsl, &qsl)? } else { BatchMetadata::new(s, &seq_lens, &qsl)? };
    let us = b.time(|| {
        prefill(
            dev(),
            s,
            PrefillArgs {
                q: DevIn::new(&q, s),
                q_rows,
                kv: if sh.packed {
                    PrefillKv::Packed { k: DevIn::new(&k, s), k_rows, v: DevIn::new(&v, s), v_rows }
                } else {
                    PrefillKv::Paged {
                        cache: DevIn::new(&cache, s),
                        spec,
                        block_table: DevIn::new(&bt, s),
                        block_table_stride: blocks_per_req,
                    }
                },
                out: DevOut::new(&mut out, s),
                out_rows,
                lse: None,
                alibi_slopes: None,
                sinks: None,
                scales: fp8.then(|| KvScales { k: DevIn::new(&ks, s), v: DevIn::new(&vs, s) }),
            },
            &batch,
            &opts,
            &mut ws,
            status,
        )?;
        Ok(())
    })?;
    status.check(s)?;
    // Query i (0-based among the new tokens) attends cached + i + 1 keys.
    let pairs = sh.batch as f64 * (sh.q_len as f64 * sh.cached as f64 + (sh.q_len * (sh.q_len + 1) / 2) as f64);
    Ok(Row {
        name: match (sh.packed, fp8) {
            (true, _) => "prefill bf16 causal, packed".into(),
            (false, false) => "prefill bf16 causal, paged bs16".into(),
            (false, true) => format!("prefill {} cache causal, paged bs16", crate::bench::dtype_name(C::DTYPE)),
        },
        shape: match sh.head_size_v == sh.head_size {
            true => format!("{}x{} (+{} cached) {}q/{}kv d{}", sh.batch, sh.q_len, sh.cached, sh.q_heads, sh.kv_heads, sh.head_size),
            false => format!(
                "{}x{} (+{} cached) {}q/{}kv dk{} dv{}",
                sh.batch, sh.q_len, sh.cached, sh.q_heads, sh.kv_heads, sh.head_size, sh.head_size_v
            ),
        },
        median_us: us,
        bytes: 0.0,
        flops: 2.0 * (sh.q_heads * (sh.head_size + sh.head_size_v)) as f64 * pairs,
    })
}

pub fn prefill_rows(b: &Bench, rows: &mut Vec<Row>, status: &mut DeviceStatus) -> Result<()> {
    let sh = |batch, q_len, q_heads, kv_heads, head_size| PrefillShape {
        batch,
        q_len,
        cached: 0,
        q_heads,
        kv_heads,
        head_size,
        head_size_v: head_size,
        packed: false,
        fp8: false,
    };
    let row = |shape: &PrefillShape, status: &mut DeviceStatus| {
        if shape.fp8 {
            prefill_row::<Fp8E4m3>(b, shape, status)
        } else {
            prefill_row::<bf16>(b, shape, status)
        }
    };
    // `ATTN_BENCH_PREFILL_SHAPES=8x2048x32x32x64,8x512x32x8x128x8192`: rows of those batch x new
    // tokens x q heads x kv heads x head size [x cached tokens] only, over a bf16 cache and over
    // an FP8 one (experiments).
    if let Some(shapes) = env_shapes("ATTN_BENCH_PREFILL_SHAPES") {
        for v in shapes.iter().filter(|v| v.len() == 5 || v.len() == 6) {
            let shape = PrefillShape { cached: v.get(5).copied().unwrap_or(0), ..sh(v[0], v[1], v[2], v[3], v[4]) };
            rows.push(row(&shape, status)?);
            rows.push(row(&PrefillShape { fp8: true, ..shape }, status)?);
        }
        return Ok(());
    }
    for shape in [
        sh(4, 4096, 32, 8, 128),
        sh(1, 16384, 32, 8, 128),
        sh(8, 2048, 32, 32, 64),
        sh(2, 8192, 64, 8, 128),
        PrefillShape { cached: 8192, ..sh(8, 512, 32, 8, 128) },
        PrefillShape { packed: true, ..sh(4, 4096, 32, 8, 128) },
        PrefillShape { packed: true, ..sh(8, 2048, 32, 32, 64) },
        // DeepSeek-V3's prefill over MLA's decompressed keys and values at tensor parallel 8:
        // 16 heads, QK 192 / V 128, packed.
        PrefillShape { packed: true, head_size_v: 128, ..sh(4, 4096, 16, 16, 192) },
        sh(4, 4096, 32, 8, 256),
        // Head sizes below the kernels' widths: 80 (width 96), 112 (128), and 96 itself.
        sh(4, 4096, 32, 8, 80),
        sh(4, 4096, 32, 8, 96),
        sh(4, 4096, 32, 8, 112),
        // FP8 caches (bf16 queries; on Hopper the producer kernel converting the rows), on the
        // two shapes the FP8 prefill target is set on.
        PrefillShape { fp8: true, ..sh(4, 4096, 32, 8, 128) },
        PrefillShape { fp8: true, ..sh(1, 16384, 32, 8, 128) },
    ] {
        rows.push(row(&shape, status)?);
    }
    // An E5M2 cache: the same FP8 `wgmma` kernel with E5M2 keys and values.
    rows.push(prefill_row::<Fp8E5m2>(b, &PrefillShape { fp8: true, ..sh(4, 4096, 32, 8, 128) }, status)?);
    Ok(())
}
