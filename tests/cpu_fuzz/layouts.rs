//! Rows and cache specs: `RowsDesc`'s sizes, the cache specs and the CPU cache writes.

use crate::{fuzz, named, size, wild_usize};
use attn_rs::decode::merge_attn_states_sizes;
use attn_rs::{KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc};
use rand::Rng;
use std::fmt::Debug;

#[derive(Debug)]
struct RowsCase {
    rows: RowsDesc,
    lse_strides: (usize, usize),
}

#[test]
fn rows_sizes_are_exact_or_refused() {
    fuzz(
        "rows",
        1,
        |rng| {
            let mut rows = RowsDesc::contiguous(size(rng, 0..9), size(rng, 0..5), size(rng, 0..65));
            if rng.random_bool(0.5) {
                rows.token_stride = wild_usize(rng);
            }
            if rng.random_bool(0.5) {
                rows.head_stride = wild_usize(rng);
            }
            RowsCase { rows, lse_strides: (size(rng, 0..9), size(rng, 0..9)) }
        },
        |c| {
            let r = c.rows;
            // Exact in u128 (each product of two usizes fits; the sum of three saturates far
            // past a usize).
            let exact = if r.num_tokens == 0 || r.num_heads == 0 || r.head_size == 0 {
                0
            } else {
                ((r.num_tokens as u128 - 1) * r.token_stride as u128)
                    .saturating_add((r.num_heads as u128 - 1) * r.head_stride as u128)
                    .saturating_add(r.head_size as u128)
            };
            let fits = usize::try_from(exact).ok();
            check!(r.checked_required_len() == fits, "checked_required_len {:?}, exact {exact}", r.checked_required_len());
            check!(r.required_len() == fits.unwrap_or(usize::MAX), "required_len {} wraps (exact {exact})", r.required_len());
            let v = r.validate("rows");
            named(&v)?;
            if v.is_ok() {
                check!(fits.is_some(), "validate took rows of {exact} elements");
                check!((r.num_tokens as u128 * r.num_heads as u128) <= usize::MAX as u128, "validate took tokens x heads past a usize");
                check!(r.num_heads <= 1 || r.head_stride >= r.head_size, "validate took overlapping heads");
                let span = (r.num_heads.max(1) as u128 - 1) * r.head_stride as u128 + r.head_size as u128;
                check!(r.num_tokens <= 1 || r.token_stride as u128 >= span, "validate took overlapping tokens");
            }
            let m = merge_attn_states_sizes(&r, c.lse_strides);
            named(&m)?;
            if let Ok((out, lse)) = m {
                check!(v.is_ok() && out == r.required_len(), "merge sizes {out} for rows {exact}");
                let want = if r.num_tokens == 0 || r.num_heads == 0 {
                    0
                } else {
                    ((r.num_tokens as u128 - 1) * c.lse_strides.0 as u128)
                        .saturating_add((r.num_heads as u128 - 1) * c.lse_strides.1 as u128)
                        .saturating_add(1)
                };
                check!(lse as u128 == want, "merge LSE size {lse}, exact {want}");
                check!(r.num_tokens as u128 * r.num_heads as u128 <= u32::MAX as u128, "merge took more rows than a u32");
            }
            Ok(())
        },
    );
}

#[derive(Debug)]
struct SpecCase {
    kv: KvCacheSpec,
    mla: MlaCacheSpec,
    key_rows: RowsDesc,
    key_len: usize,
    cache_len: usize,
    slots: Vec<i64>,
    latent_stride: usize,
    num_tokens: usize,
}

#[test]
fn cache_specs_and_writes_stay_in_range() {
    fuzz(
        "specs",
        2,
        |rng| {
            let layout = KvLayout::ALL[rng.random_range(0..4)];
            let kv = KvCacheSpec {
                layout,
                num_blocks: size(rng, 1..6),
                block_size: size(rng, 1..5),
                num_kv_heads: size(rng, 1..3),
                head_size: size(rng, 1..9),
            };
            let mla = MlaCacheSpec {
                num_blocks: size(rng, 1..4),
                block_size: size(rng, 1..5),
                latent_dim: size(rng, 1..9),
                rope_dim: size(rng, 0..5),
            };
            let num_tokens = size(rng, 0..6);
            let mut key_rows = RowsDesc::contiguous(num_tokens, kv.num_kv_heads, kv.head_size);
            if rng.random_bool(0.2) {
                key_rows.token_stride = wild_usize(rng);
            }
            // Buffers never larger than 4096 elements: specs and rows past that must be refused.
            let cap = |want: usize| want.min(4096);
            let key_len = if rng.random_bool(0.8) { cap(key_rows.required_len()) } else { rng.random_range(0..64) };
            let cache_len = if rng.random_bool(0.8) { cap(kv.num_elements().max(mla.num_elements())) } else { rng.random_range(0..64) };
            let slots =
                (0..num_tokens.min(8)).map(|_| if rng.random_bool(0.2) { rng.random::<i64>() } else { rng.random_range(-2..24) }).collect();
            let latent_stride = if rng.random_bool(0.2) { wild_usize(rng) } else { mla.latent_dim.saturating_add(rng.random_range(0..3)) };
            SpecCase { kv, mla, key_rows, key_len, cache_len, slots, latent_stride, num_tokens }
        },
        |c| {
            // The standard cache.
            let s = c.kv;
            let product = |xs: &[usize]| xs.iter().fold(1u128, |a, &x| a.saturating_mul(x as u128));
            let exact = product(&[2, s.num_blocks, s.block_size, s.num_kv_heads, s.head_size]);
            let v = s.validate("spec");
            let made = KvCacheSpec::new(s.layout, s.num_blocks, s.block_size, s.num_kv_heads, s.head_size);
            named(&v)?;
            named(&made)?;
            check!(v.is_ok() == made.is_ok(), "validate and new disagree");
            check!(s.checked_num_elements().map(|e| e as u128) == (exact <= usize::MAX as u128).then_some(exact), "checked_num_elements");
            check!(v.is_err() || s.num_elements() as u128 == exact, "num_elements {} of {exact}", s.num_elements());
            check!(s.num_elements() as u128 <= exact || exact > usize::MAX as u128, "num_elements over-counts");
            if v.is_ok() {
                check!(s.num_slots() as u128 == s.num_blocks as u128 * s.block_size as u128, "num_slots");
                // The last element of the V plane is the last of the cache.
                let st = s.strides();
                let (_, v_origin) = s.kv_origins();
                let last = v_origin as u128
                    + (s.num_blocks as u128 - 1) * st.block as u128
                    + (s.block_size as u128 - 1) * st.token as u128
                    + (s.num_kv_heads as u128 - 1) * st.head as u128
                    + s.head_size as u128
                    - 1;
                check!(last + 1 == exact, "the last element is {last}, the cache has {exact}");
            } else {
                check!(s.num_elements() == usize::MAX || exact <= usize::MAX as u128, "an invalid spec's size wraps");
            }
            // A write into it.
            let (key, mut cache) = (vec![1f32; c.key_len], vec![0f32; c.cache_len]);
            let w = attn_rs::cpu::reshape_and_cache(&key, c.key_rows, &key, c.key_rows, &c.slots, &mut cache, &s, None);
            named(&w)?;
            if let Ok(rep) = w {
                check!(v.is_ok(), "an invalid spec took a write");
                check!(c.cache_len as u128 >= exact && c.key_len >= c.key_rows.required_len(), "a write into short buffers");
                check!(rep.written + rep.padding + rep.out_of_range == c.key_rows.num_tokens.min(c.slots.len()), "report {rep:?}");
            }

            // The MLA cache.
            let m = c.mla;
            let width = m.latent_dim as u128 + m.rope_dim as u128;
            let exact = product(&[m.num_blocks, m.block_size]).saturating_mul(width);
            let v = m.validate("spec");
            named(&v)?;
            check!(
                v.is_ok() == MlaCacheSpec::new(m.num_blocks, m.block_size, m.latent_dim, m.rope_dim).is_ok(),
                "validate and new disagree"
            );
            check!(v.is_err() || m.num_elements() as u128 == exact, "MLA num_elements {} of {exact}", m.num_elements());
            check!(v.is_ok() || m.num_elements() == usize::MAX || exact <= usize::MAX as u128, "an invalid MLA spec's size wraps");
            let kv_c = vec![1f32; c.key_len];
            let w =
                attn_rs::cpu::concat_and_cache_mla(&kv_c, c.latent_stride, &kv_c, m.rope_dim, c.num_tokens, &c.slots, &mut cache, &m, None);
            named(&w)?;
            if w.is_ok() {
                check!(v.is_ok() && c.cache_len as u128 >= exact, "an MLA write into a short or invalid cache");
                let need = if c.num_tokens == 0 { 0 } else { (c.num_tokens as u128 - 1) * c.latent_stride as u128 + m.latent_dim as u128 };
                check!(c.key_len as u128 >= need, "an MLA write from a short kv_c ({} of {need})", c.key_len);
            }
            Ok(())
        },
    );
}
