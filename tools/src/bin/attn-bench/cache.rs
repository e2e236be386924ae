//! `--only cache`: the cache writes (`reshape_and_cache`, `concat_and_cache_mla`) against a
//! copy of the same size.

use crate::bench::{copy_row, dev, dtype_name, random_slots, random_values, Bench, Row};
use attn_rs::cache_write::{concat_and_cache_mla, reshape_and_cache, KvScales, KvWrite, MlaWrite};
use attn_rs::{DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, Fp8E5m2, KvCacheSpec, KvLayout, MlaCacheSpec, Result, RowsDesc};
use cudarc::driver::CudaSlice;
use half::bf16;

/// How the benchmark's slot mapping places tokens in the cache.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Slots {
    /// A random permutation: tokens scattered over a cache twice their size (the case).
    Random,
    /// Token i in slot i: the write is a plain copy (a reference point for the random case).
    Sequential,
    /// Random, and an FP8 cache's scales one per kv head.
    RandomPerHeadScales,
}

#[allow(clippy::too_many_arguments)]
fn kv_write_row<C: Element>(
    b: &Bench,
    layout: KvLayout,
    tokens: usize,
    heads: usize,
    head_size: usize,
    block_size: usize,
    slots: Slots,
    status: &mut DeviceStatus,
) -> Result<Row> {
    let s = &b.stream;
    // Twice as many slots as tokens, so the random slots scatter over the whole cache.
    let spec = KvCacheSpec::new(layout, 2 * tokens / block_size, block_size, heads, head_size)?;
    let rows = RowsDesc::contiguous(tokens, heads, head_size);
    let key = s.clone_htod(&random_values::<bf16>(rows.required_len(), 1, 4.0))?;
    let value = s.clone_htod(&random_values::<bf16>(rows.required_len(), 2, 4.0))?;
    let slot_order = slots;
    let slots = match slot_order {
        Slots::Random | Slots::RandomPerHeadScales => s.clone_htod(&random_slots(tokens, spec.num_slots(), 3))?,
        Slots::Sequential => s.clone_htod(&(0..tokens as i64).collect::<Vec<i64>>())?,
    };
    let mut cache: CudaSlice<C> = s.alloc_zeros(spec.num_elements())?;
    let n_scales = if slot_order == Slots::RandomPerHeadScales { heads } else { 1 };
    let (ks, vs) = (s.clone_htod(&vec![0.5f32; n_scales])?, s.clone_htod(&vec![0.5f32; n_scales])?);
    let fp8 = C::DTYPE.is_fp8();
    let us = b.time(|| {
        let w = KvWrite {
            key: DevIn::new(&key, s),
            key_rows: rows,
            value: DevIn::new(&value, s),
            value_rows: rows,
            slot_mapping: DevIn::new(&slots, s),
            cache: DevOut::new(&mut cache, s),
            spec,
            scales: fp8.then(|| KvScales { k: DevIn::new(&ks, s), v: DevIn::new(&vs, s) }),
        };
        reshape_and_cache(dev(), s, w, status)
    })?;
    status.check(s)?;
    let elems = (tokens * heads * head_size) as f64;
    Ok(Row {
        name: format!("reshape_and_cache {layout:?} bf16->{}", dtype_name(C::DTYPE)),
        shape: format!(
            "{tokens} tok x {heads} kvh x {head_size}, bs {block_size}{}",
            match slot_order {
                Slots::Sequential => ", seq slots",
                Slots::RandomPerHeadScales => ", per-head scales",
                Slots::Random => "",
            }
        ),
        median_us: us,
        bytes: 2.0 * elems * (2.0 + std::mem::size_of::<C>() as f64) + 8.0 * tokens as f64,
        flops: 0.0,
    })
}

fn mla_write_row<C: Element>(b: &Bench, tokens: usize, block_size: usize, status: &mut DeviceStatus) -> Result<Row> {
    let s = &b.stream;
    let spec = MlaCacheSpec::deepseek(2 * tokens / block_size, block_size)?;
    let kv_c = s.clone_htod(&random_values::<bf16>(tokens * spec.latent_dim, 4, 4.0))?;
    let k_pe = s.clone_htod(&random_values::<bf16>(tokens * spec.rope_dim, 5, 4.0))?;
    let slots = s.clone_htod(&random_slots(tokens, spec.num_slots(), 6))?;
    let mut cache: CudaSlice<C> = s.alloc_zeros(spec.num_elements())?;
    let scale = s.clone_htod(&[0.5f32])?;
    let fp8 = C::DTYPE.is_fp8();
    let us = b.time(|| {
        let w = MlaWrite {
            kv_c: DevIn::new(&kv_c, s),
            kv_c_token_stride: spec.latent_dim,
            k_pe: DevIn::new(&k_pe, s),
            k_pe_token_stride: spec.rope_dim,
            num_tokens: tokens,
            slot_mapping: DevIn::new(&slots, s),
            cache: DevOut::new(&mut cache, s),
            spec,
            scale: fp8.then(|| DevIn::new(&scale, s)),
        };
        concat_and_cache_mla(dev(), s, w, status)
    })?;
    status.check(s)?;
    let elems = (tokens * spec.row_width()) as f64;
    Ok(Row {
        name: format!("concat_and_cache_mla bf16->{}", dtype_name(C::DTYPE)),
        shape: format!("{tokens} tok x 576, bs {block_size}"),
        median_us: us,
        bytes: elems * (2.0 + std::mem::size_of::<C>() as f64) + 8.0 * tokens as f64,
        flops: 0.0,
    })
}

pub fn cache_write_rows(b: &Bench, rows: &mut Vec<Row>, status: &mut DeviceStatus) -> Result<()> {
    // The same copy at the size of the main cache-write case (64 MiB read + 64 MiB written).
    rows.push(copy_row(b, 64 << 20)?);
    let tokens = 16384;
    for layout in [KvLayout::FlashNhd, KvLayout::FlashHnd, KvLayout::FlashInferNhd] {
        rows.push(kv_write_row::<bf16>(b, layout, tokens, 8, 128, 16, Slots::Random, status)?);
    }
    // Without programmatic dependent launch (on sm_90a the cache writes use it by default).
    std::env::set_var("ATTN_DISABLE_PDL", "1");
    let mut r = kv_write_row::<bf16>(b, KvLayout::FlashNhd, tokens, 8, 128, 16, Slots::Random, status)?;
    std::env::remove_var("ATTN_DISABLE_PDL");
    r.name += " (no PDL)";
    rows.push(r);
    rows.push(kv_write_row::<bf16>(b, KvLayout::FlashNhd, tokens, 8, 128, 16, Slots::Sequential, status)?);
    rows.push(kv_write_row::<bf16>(b, KvLayout::FlashNhd, 4 * tokens, 8, 128, 16, Slots::Random, status)?);
    rows.push(kv_write_row::<Fp8E4m3>(b, KvLayout::FlashNhd, tokens, 8, 128, 16, Slots::Random, status)?);
    rows.push(kv_write_row::<Fp8E4m3>(b, KvLayout::FlashNhd, tokens, 8, 128, 16, Slots::RandomPerHeadScales, status)?);
    rows.push(kv_write_row::<bf16>(b, KvLayout::FlashNhd, 256, 8, 128, 16, Slots::Random, status)?);
    rows.push(mla_write_row::<bf16>(b, tokens, 64, status)?);
    rows.push(mla_write_row::<bf16>(b, 4 * tokens, 64, status)?);
    rows.push(mla_write_row::<Fp8E4m3>(b, tokens, 64, status)?);
    rows.push(kv_write_row::<Fp8E5m2>(b, KvLayout::FlashNhd, tokens, 8, 128, 16, Slots::Random, status)?);

    Ok(())
}
