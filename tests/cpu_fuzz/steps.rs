//! Step metadata (validation, the decode/prefill split, the plans, packing, cascade) and
//! `forward` on the CPU backend after `build`.

use crate::{fuzz, named, size, valid_tokens, wild_i32, wild_usize};
use attn_rs::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
use attn_rs::decode::MAX_QUERY_LEN;
use attn_rs::forward::{Attention, CacheSpec, CpuLayer, ForwardConfig, ForwardLimits, LayerIo, NewKv};
use attn_rs::metadata::{
    build_tensor_core_metadata, common_prefix, decode_first_order, pack, split_decodes, use_cascade, validate, CascadeMode, CascadeStep,
    MetadataBuilder, PlanConfig, StagingLayout, StagingSizes, StepInput,
};
use attn_rs::{AttnError, DType, KvLayout, RowsDesc};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::fmt::Debug;

#[derive(Debug)]
struct StepCase {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    stride: usize,
    slots: Vec<i64>,
    num_actual_tokens: usize,
    num_blocks: usize,
    block_size: usize,
    config: PlanConfig,
}

impl StepCase {
    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.stride,
            slot_mapping: &self.slots,
            num_actual_tokens: self.num_actual_tokens,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
        }
    }
}

/// How [`step`] draws a step.
struct StepShape {
    threshold: usize,
    /// `None`: 1, 4 or 16.
    block_size: Option<usize>,
    /// Query tokens of a prefill below this, cached keys below `max_ctx`.
    max_q: i32,
    max_ctx: i32,
}

/// A step ordered decodes first (mostly): block tables from a shuffled pool, slots of the new
/// tokens, padding slots; then wild values now and then.
fn step(rng: &mut SmallRng, shape: &StepShape) -> StepCase {
    let threshold = shape.threshold;
    let n = if rng.random_bool(0.1) { 0 } else { rng.random_range(1..7) };
    let block_size = shape.block_size.unwrap_or([1, 4, 16][rng.random_range(0..3)]);
    let mut q: Vec<i32> = (0..n)
        .map(|_| if rng.random_bool(0.6) { rng.random_range(0..=threshold as i32) } else { rng.random_range(0..shape.max_q) })
        .collect();
    if rng.random_bool(0.8) {
        q.sort_by_key(|&x| x > threshold as i32);
    }
    let seq_lens: Vec<i32> = q.iter().map(|&x| x + rng.random_range(0..shape.max_ctx)).collect();
    let used: Vec<usize> = seq_lens.iter().map(|&l| (l as usize).div_ceil(block_size)).collect();
    let stride = used.iter().copied().max().unwrap_or(0) + rng.random_range(0..3);
    let num_blocks = used.iter().sum::<usize>() + rng.random_range(0..4);
    let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
    use rand::seq::SliceRandom;
    pool.shuffle(rng);
    let mut block_table = vec![-1; n * stride];
    let mut next = 0;
    for r in 0..n {
        for b in 0..used[r] {
            block_table[r * stride + b] = pool[next];
            next += 1;
        }
    }
    let mut qsl = vec![0];
    let mut slots = Vec::new();
    for r in 0..n {
        qsl.push(qsl[r] + q[r]);
        for i in 0..q[r] {
            let pos = (seq_lens[r] - q[r] + i) as usize;
            let block = block_table[r * stride + pos / block_size] as i64;
            slots.push(if rng.random_bool(0.05) { -1 } else { block * block_size as i64 + (pos % block_size) as i64 });
        }
    }
    let mut c = StepCase {
        num_actual_tokens: slots.len(),
        qsl,
        seq_lens,
        block_table,
        stride,
        slots,
        num_blocks,
        block_size,
        config: PlanConfig { decode_threshold: threshold, num_q_heads: 8, num_kv_heads: 2, head_size: 128 },
    };
    if rng.random_bool(0.4) {
        match rng.random_range(0..12) {
            0 => {
                let i = rng.random_range(0..c.qsl.len());
                c.qsl[i] = wild_i32(rng);
            }
            1 if n > 0 => c.seq_lens[rng.random_range(0..n)] = wild_i32(rng),
            2 if !c.block_table.is_empty() => {
                let i = rng.random_range(0..c.block_table.len());
                c.block_table[i] = wild_i32(rng);
            }
            3 if !c.slots.is_empty() => {
                let i = rng.random_range(0..c.slots.len());
                c.slots[i] = if rng.random() { rng.random() } else { i64::MIN };
            }
            4 => c.stride = wild_usize(rng),
            5 => c.num_blocks = wild_usize(rng),
            6 => c.block_size = wild_usize(rng),
            7 => c.num_actual_tokens = wild_usize(rng),
            8 => {
                c.config.num_q_heads = wild_usize(rng);
                c.config.num_kv_heads = size(rng, 0..4);
            }
            9 => c.config.head_size = [0, 7, 64, 96, 256, 512][rng.random_range(0..6)],
            10 => c.config.decode_threshold = size(rng, 0..10),
            _ => {
                c.qsl.pop();
            }
        }
    }
    c
}

#[test]
fn step_metadata_is_checked_split_and_planned_in_range() {
    fuzz(
        "metadata",
        5,
        |rng| {
            let threshold = rng.random_range(1..=MAX_QUERY_LEN);
            step(rng, &StepShape { threshold, block_size: None, max_q: 30, max_ctx: 60 })
        },
        |c| {
            let input = c.input();
            let n = c.seq_lens.len();
            let v = validate(&input);
            named(&v)?;
            if v.is_ok() {
                check!(valid_tokens(&c.qsl, n) == Some(c.num_actual_tokens as u64), "validate took start locations {:?}", c.qsl);
                check!(c.block_size > 0 && (n as u128 * c.stride as u128) <= c.block_table.len() as u128, "validate took the table shape");
                for r in 0..n {
                    let (len, q) = (c.seq_lens[r], c.qsl[r + 1] - c.qsl[r]);
                    check!(len >= 0 && (q == 0 || len >= q), "validate took request {r}");
                    let used = (len as usize).div_ceil(c.block_size);
                    check!(used <= c.stride, "validate took request {r} past its row");
                    for (e, &b) in c.block_table[r * c.stride..][..used].iter().enumerate() {
                        check!(
                            b >= 0 && (b as usize) < c.num_blocks,
                            "validate took request {r} entry {e} = {b} of {} blocks",
                            c.num_blocks
                        );
                    }
                }
                let slots = c.num_blocks as u128 * c.block_size as u128;
                for (t, &s) in c.slots[..c.num_actual_tokens].iter().enumerate() {
                    check!(s == -1 || (s >= 0 && (s as u128) < slots), "validate took token {t}'s slot {s}");
                }
            }
            let threshold = c.config.decode_threshold;
            let split = split_decodes(&input, threshold);
            named(&split)?;
            if let Ok(s) = split {
                check!(s.num_decodes + s.num_prefills == n, "split {s:?}");
                check!(s.num_decode_tokens + s.num_prefill_tokens == c.num_actual_tokens, "split {s:?}");
            }
            if c.qsl.len() == n + 1 {
                let mut order = decode_first_order(&input, threshold);
                order.sort_unstable();
                check!(order == (0..n).collect::<Vec<_>>(), "decode_first_order is not a permutation");
            }
            let prefix = common_prefix(&input);
            if v.is_ok() && n > 0 {
                for r in 0..n {
                    let before = c.seq_lens[r] as i64 - (c.qsl[r + 1] - c.qsl[r]) as i64;
                    check!(prefix.tokens as i64 <= before, "prefix {prefix:?} past request {r}'s first query");
                    check!(c.block_table[r * c.stride..][..prefix.blocks] == c.block_table[..prefix.blocks], "prefix not shared by {r}");
                }
            }
            let _ = use_cascade(CascadeMode::Auto, &CascadeStep::new(&input, 4));
            let sizes = StagingSizes {
                num_reqs: n,
                block_table_stride: c.stride,
                num_actual_tokens: c.num_actual_tokens,
                num_decodes: c.config.num_kv_heads,
                num_prefills: c.config.num_q_heads,
                num_work_items: c.num_blocks,
                num_decode_tokens: c.block_size,
            };
            let layout = StagingLayout::new(&sizes);
            check!(layout.regions().iter().all(|(_, r)| r.end() <= layout.total_words), "a region past the layout's end");
            let _ = (layout.prefill_seq_lens(), layout.prefill_block_table(), layout.total_bytes());
            // The builders agree with each other and stay in range.
            let cfg = c.config;
            let meta = build_tensor_core_metadata(&input, threshold, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size);
            named(&meta)?;
            if let Ok(m) = &meta {
                check!(v.is_ok(), "the builder took a step validate refuses");
                let (s, p) = (m.split, &m.decode.plan);
                // The decode part is not planned: a zero split count and partial base a decode.
                check!(p.items.is_empty() && p.token_request.is_empty() && p.partial_rows == 0, "a planned decode part {p:?}");
                check!(p.req_num_splits == vec![0; s.num_decodes] && p.req_partial_base == vec![0; s.num_decodes], "decode part {p:?}");
                check!(m.prefill.query_start_loc.len() == s.num_prefills + 1, "prefill part");
            }
            if let Ok(mut builder) = MetadataBuilder::new(cfg) {
                let built = builder.build(&input);
                named(&built)?;
                match (&meta, built) {
                    (Ok(m), Ok(b)) => {
                        check!(b.metadata == m, "the builder's metadata differs from build_tensor_core_metadata's");
                        let (words, layout) = pack(m, &input);
                        check!(b.layout == &layout && b.words.len() == words.len(), "the builder's words differ from pack's");
                    }
                    (Err(_), Err(_)) => {}
                    (m, b) => return Err(format!("build_tensor_core_metadata {:?}, MetadataBuilder {:?}", m.is_ok(), b.is_ok())),
                }
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// forward on the CPU backend
// ---------------------------------------------------------------------------------------------

const NB: usize = 72;

#[derive(Debug)]
struct ForwardCase {
    mla: bool,
    step: StepCase,
    /// Extra rows in the layer's tensors past the step's tokens (padding).
    pad: usize,
    /// A layer field made wrong (`None`: a correct layer).
    edit: Option<(usize, usize)>,
    seed: u64,
}

/// `forward` after `build`: a step `build` takes runs on every layer (with correct tensors) and
/// its outputs are finite; one it refuses is refused by `forward` too ("step"); wrong tensors
/// are refused with a named error. Nothing panics.
#[test]
fn cpu_forward_agrees_with_build() {
    let limits = ForwardLimits { max_num_tokens: 80, max_num_reqs: 8, max_model_len: 64 };
    // Steps that ran (a suite whose steps are all refused would test little).
    let ran = std::sync::atomic::AtomicUsize::new(0);
    fuzz(
        "forward",
        6,
        |rng| {
            let mla = rng.random_bool(0.15);
            let mut s = step(rng, &StepShape { threshold: 2, block_size: Some(4), max_q: 13, max_ctx: 30 });
            // The caches' block count, unless a wild one was drawn (the pool's ids stay below it).
            if s.num_blocks <= NB {
                s.num_blocks = NB;
            }
            let edit = rng.random_bool(0.2).then(|| (rng.random_range(0..6), wild_usize(rng)));
            ForwardCase { mla, step: s, pad: rng.random_range(0..3), edit, seed: rng.random() }
        },
        |c| {
            let model = if c.mla {
                ModelConfig::mla(2, DType::F32, 4)
            } else {
                ModelConfig::standard(4, 2, 8, DType::F32, 4, KvLayout::ALL[(c.seed % 4) as usize])
            };
            let sel = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None).map_err(|e| e.to_string())?;
            let mut attn = Attention::new(&sel, ForwardConfig { decode_threshold: 2, ..ForwardConfig::new(model, NB, limits) }, None)
                .map_err(|e| e.to_string())?;
            let mut meta = attn.new_step_metadata().map_err(|e| e.to_string())?;
            let built = meta.build(&c.step.input());
            named(&built)?;
            let spec = attn.cache_spec();
            let (hq, dk, dv, hkv) = (4usize.min(model.num_q_heads), spec.qk_head_size(), spec.v_head_size(), spec.num_kv_heads());
            let nt = c.step.num_actual_tokens.min(1 << 10) + c.pad;
            let mut rng = SmallRng::seed_from_u64(c.seed);
            let mut random = |len: usize| (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>();
            let q = random(nt * hq * dk);
            let (k, v) = (random(nt * hkv * dk), random(nt * hkv * dk));
            let mut cache = vec![0f32; spec.num_elements()];
            let mut out = vec![f32::NAN; nt * hq * dv];
            let mut q_rows = RowsDesc::contiguous(nt, hq, dk);
            let mut k_rows = RowsDesc::contiguous(nt, hkv, dk);
            let mut out_rows = RowsDesc::contiguous(nt, hq, dv);
            let mut kv_c_stride = dk;
            if let Some((field, value)) = c.edit {
                match field {
                    0 => q_rows.token_stride = value,
                    1 => q_rows.num_tokens = value,
                    2 => k_rows.head_stride = value,
                    3 => out_rows.token_stride = value,
                    4 => out_rows.num_heads = value,
                    _ => kv_c_stride = value,
                }
            }
            let new_kv = match spec {
                CacheSpec::Paged(_) => NewKv::Standard { k: k.as_slice().into(), k_rows, v: v.as_slice().into(), v_rows: k_rows },
                CacheSpec::Mla(m) => NewKv::Mla {
                    kv_c: k.as_slice().into(),
                    kv_c_token_stride: kv_c_stride,
                    k_pe: v.get(m.latent_dim..).unwrap_or(&[]).into(),
                    k_pe_token_stride: kv_c_stride,
                },
            };
            let layer = CpuLayer {
                q: q.as_slice().into(),
                q_rows,
                new_kv,
                cache: cache.as_mut_slice().into(),
                out: out.as_mut_slice().into(),
                out_rows,
                alibi_slopes: None,
                sinks: None,
                kv_scales: None,
            };
            let r = attn.forward(&meta, LayerIo::Cpu(layer));
            named(&r)?;
            match (&built, &r) {
                (Err(_), Ok(())) => return Err("forward ran a step build refused".into()),
                (Err(_), Err(AttnError::InvalidArgument { arg, .. })) => check!(*arg == "step", "forward on a refused step names {arg}"),
                (Ok(_), Err(e)) if c.edit.is_none() => return Err(format!("build took the step, forward refused it: {e}")),
                _ => {}
            }
            if r.is_ok() && c.edit.is_none() {
                ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let rows = c.step.num_actual_tokens * hq * dv;
                check!(out[..rows].iter().all(|x| x.is_finite()), "a non-finite output row");
                check!(out[rows..].iter().all(|x| x.is_nan()), "a padding row was written");
            }
            Ok(())
        },
    );
    let ran = ran.into_inner();
    eprintln!("forward: {ran} steps ran");
    assert!(ran > 0, "no step ran");
}
