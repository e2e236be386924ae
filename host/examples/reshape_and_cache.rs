//! `reshape_and_cache`: one step's new keys and values written into a paged KV cache on the GPU,
//! checked byte for byte against the CPU implementation.
//!
//!     cargo run -p attn-rs --example reshape_and_cache
//!
//! Without a GPU it says so and exits 0.

use attn_rs::cache_write::{reshape_and_cache, KvWrite};
use attn_rs::{cpu, DevIn, DevOut, DeviceStatus, KvCacheSpec, KvLayout, RowsDesc};
use half::bf16;

mod common;
use common::{open_gpu, values};

fn main() -> attn_rs::Result<()> {
    let Some(dev) = open_gpu()? else { return Ok(()) };
    let stream = dev.context().new_stream()?;

    // A cache of 8 blocks of 16 tokens, 2 kv heads of 64, in vLLM's FlashAttention layout.
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, 8, 16, 2, 64)?;
    // 4 new tokens: K and V as the two halves of one fused row per token (strided rows).
    let num_tokens = 4;
    let kv_width = spec.num_kv_heads * spec.head_size;
    let rows = RowsDesc { token_stride: 2 * kv_width, ..RowsDesc::contiguous(num_tokens, spec.num_kv_heads, spec.head_size) };
    let kv: Vec<bf16> = values(num_tokens * 2 * kv_width, 1);
    // Slot = block * block_size + offset; -1 is padding (written nowhere).
    let slots: Vec<i64> = vec![16 + 3, 5 * 16, -1, 7 * 16 + 15];

    let kv_d = stream.clone_htod(&kv)?;
    let v_d = kv_d.slice(kv_width..);
    let slots_d = stream.clone_htod(&slots)?;
    let mut cache_d = stream.alloc_zeros::<bf16>(spec.num_elements())?;
    let mut status = DeviceStatus::new(&stream)?;
    let write = KvWrite {
        key: DevIn::new(&kv_d, &stream),
        key_rows: rows,
        value: DevIn::new(&v_d, &stream),
        value_rows: rows,
        slot_mapping: DevIn::new(&slots_d, &stream),
        cache: DevOut::new(&mut cache_d, &stream),
        spec,
        scales: None,
    };
    reshape_and_cache(&dev, &stream, write, &mut status)?;
    // Nothing synchronises until asked: this waits and reports slots past the cache, if any.
    status.check(&stream)?;

    let mut want = vec![bf16::ZERO; spec.num_elements()];
    let report = cpu::reshape_and_cache(&kv, rows, &kv[kv_width..], rows, &slots, &mut want, &spec, None)?;
    let got = stream.clone_dtoh(&cache_d)?;
    let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
    println!(
        "reshape_and_cache: {} tokens written, {} padding; the GPU cache {} the CPU reference",
        report.written,
        report.padding,
        if same { "matches" } else { "DIFFERS FROM" }
    );
    if !same {
        std::process::exit(1);
    }
    Ok(())
}
