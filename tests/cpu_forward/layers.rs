//! Per-layer settings on the `cpu` backend ([`LayerSpec`] through `forward_layer`): Gemma-2-like
//! interleaved sliding-window and full layers with a soft-cap, KV-shared layers, chunked local
//! attention, encoder-only layers with and without a symmetric window, per-layer ALiBi, sinks
//! and scales; each against the reference of `tests/common/layer_steps.rs`, and the refusals of
//! bad specs and bad layer calls, each naming its argument and value.

use crate::layer_steps::{enc_dec_layers, enc_dec_schedule, EncDecStep, Engine, LayerData, Shape, Step};
use attn_rs::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig};
use attn_rs::forward::{
    Attention, AttentionType, CpuLayer, ForwardConfig, ForwardLimits, KvCacheWrite, KvWriteIo, LayerIo, LayerSpec, NewKv, StepMetadata,
};
use attn_rs::{AttnError, AttnOptions, DType, KvLayout, RowsDesc};

const POISON: f32 = 7.0;

fn model(shape: &Shape) -> ModelConfig {
    ModelConfig::standard(shape.hq, shape.hkv, shape.d, DType::F32, shape.block_size, KvLayout::FlashNhd).with_features(Features::ALL)
}

fn limits() -> ForwardLimits {
    ForwardLimits { max_num_tokens: 256, max_num_reqs: 8, max_model_len: 512 }
}

fn attention(shape: &Shape, layers: Vec<LayerSpec>) -> attn_rs::Result<Attention> {
    let model = model(shape);
    let selection = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None)?;
    Attention::new(&selection, ForwardConfig::new(model, shape.num_blocks, limits()).with_layers(layers), None)
}

/// The layers `which` of one step through `forward_layer` (cross-attention layers with
/// `cross`, the step's cross-attention metadata); the caches of the layers that own one.
fn run_step(
    engine: &mut Engine,
    attn: &mut Attention,
    (meta, cross, group): (&StepMetadata, Option<&StepMetadata>, Option<&StepMetadata>),
    step: &Step,
    caches: &mut [Vec<f32>],
    (label, which): (&str, &[usize]),
) {
    let s = engine.shape.clone();
    let rows = step.rows();
    for &layer in which {
        let spec = engine.layers[layer];
        let meta = match (spec.attn_type, group) {
            (AttentionType::EncoderDecoder, _) => cross.expect("a cross-attention step"),
            (_, Some(group)) if spec.opts.window.is_some() => group,
            _ => meta,
        };
        let data = engine.data(step);
        let want = engine.reference(step, layer, &data);
        let out_rows = RowsDesc::contiguous(rows, s.hq, s.d);
        let kv_rows = RowsDesc::contiguous(rows, s.hkv, s.d);
        let mut out = vec![POISON; out_rows.required_len()];
        // Layers that read a cache written before take no new K/V.
        let reads_only = spec.kv_sharing_target.is_some() || spec.attn_type == AttentionType::EncoderDecoder;
        let new_kv = match reads_only {
            true => NewKv::None,
            false => NewKv::Standard { k: data.k.as_slice().into(), k_rows: kv_rows, v: data.v.as_slice().into(), v_rows: kv_rows },
        };
        let owner = spec.kv_sharing_target.unwrap_or(layer);
        let io = CpuLayer {
            q: data.q.as_slice().into(),
            q_rows: RowsDesc::contiguous(rows, s.hq, s.d),
            new_kv,
            cache: caches[owner].as_mut_slice().into(),
            out: out.as_mut_slice().into(),
            out_rows,
            alibi_slopes: spec.alibi.then(|| engine.slopes.as_slice().into()),
            sinks: spec.sinks.then(|| engine.sinks.as_slice().into()),
            kv_scales: None,
        };
        attn.forward_layer(meta, layer, LayerIo::Cpu(io)).unwrap_or_else(|e| panic!("{label} layer {layer}: {e}"));
        let got: Vec<f64> = out[..step.nt * s.hq * s.d].iter().map(|&x| x as f64).collect();
        let err = crate::compare::rel_error(&got, &want);
        assert!(err < 1e-5, "{label} layer {layer} ({spec:?}): rel error {err:.3e}");
        assert!(out[step.nt * s.hq * s.d..].iter().all(|&x| x == POISON), "{label} layer {layer}: padding rows written");
    }
    engine.finish(step);
}

/// `steps` through every layer, each checked against the reference.
fn run(shape: Shape, layers: Vec<LayerSpec>, steps: &[Vec<(usize, usize)>], label: &str) {
    let schedule: Vec<EncDecStep> = steps.iter().map(|p| EncDecStep::for_layers(&layers, p)).collect();
    run_schedule(shape, layers, &schedule, (label, None))
}

/// A schedule of steps: encoder steps run the encoder layers over whole requests (an
/// encoder's writing its cache); decoder steps run the decoder layers, and the
/// cross-attention layers through the step's cross-attention metadata. `window_group`: the
/// sliding-window layers in a KV-cache group of their own (`Engine::group_step`), its blocks
/// before this window nulled.
fn run_schedule(shape: Shape, layers: Vec<LayerSpec>, schedule: &[EncDecStep], (label, window_group): (&str, Option<usize>)) {
    let mut attn = attention(&shape, layers.clone()).unwrap_or_else(|e| panic!("{label}: {e}"));
    let new = |attn: &Attention| attn.new_step_metadata().unwrap();
    let (mut meta, mut cross, mut group) = (new(&attn), new(&attn), new(&attn));
    let n = attn.cache_spec().num_elements();
    let owns = |l: &LayerSpec| l.kv_sharing_target.is_none() && l.attn_type.uses_cache();
    let mut caches: Vec<Vec<f32>> = layers.iter().map(|l| if owns(l) { vec![0.0; n] } else { Vec::new() }).collect();
    let has_cross = layers.iter().any(|l| l.attn_type == AttentionType::EncoderDecoder);
    let mut engine = Engine::new(shape.clone(), layers.clone(), 0x1a7e5, |x| x);
    for (i, st) in schedule.iter().enumerate() {
        let step = engine.step(st.pairs());
        let label = format!("{label} step {i}");
        meta.build(&step.input(&shape)).unwrap_or_else(|e| panic!("{label}: {e}"));
        if let (EncDecStep::Decoder { encoder_of, .. }, true) = (st, has_cross) {
            engine.encoder_of.extend(encoder_of.iter().copied());
            cross.build(&engine.cross_step(&step).input(&shape)).unwrap_or_else(|e| panic!("{label} (cross): {e}"));
        }
        if window_group.is_some() {
            group.build(&engine.group_step(&step, window_group).input(&shape)).unwrap_or_else(|e| panic!("{label} (group): {e}"));
        }
        for layer in st.writes(&layers) {
            let data = engine.data(&step);
            engine.write(&step, layer, &data);
            let kv_rows = RowsDesc::contiguous(step.rows(), shape.hkv, shape.d);
            let new_kv = NewKv::Standard { k: data.k.as_slice().into(), k_rows: kv_rows, v: data.v.as_slice().into(), v_rows: kv_rows };
            let w = KvCacheWrite { new_kv, cache: caches[layer].as_mut_slice().into(), kv_scales: None };
            attn.write_kv(&meta, layer, KvWriteIo::Cpu(w)).unwrap_or_else(|e| panic!("{label} write_kv {layer}: {e}"));
        }
        let which = st.layers(&layers);
        let group = window_group.map(|_| &group);
        run_step(&mut engine, &mut attn, (&meta, Some(&cross), group), &step, &mut caches, (&label, &which));
    }
}

fn shape(hq: usize, hkv: usize, d: usize) -> Shape {
    Shape { hq, hkv, d, block_size: 16, num_blocks: 96 }
}

/// Decodes beside chunked prefills, odd lengths, one-token prompts and an empty request.
fn decoder_steps() -> Vec<Vec<(usize, usize)>> {
    vec![
        vec![(0, 37), (1, 1)],
        vec![(1, 20), (0, 1), (2, 0)],
        vec![(0, 1), (1, 1), (2, 45), (3, 5)],
        vec![(3, 1), (2, 1), (0, 1), (1, 33)],
        vec![(3, 29), (0, 1), (2, 1), (1, 1)],
    ]
}

fn opts(d: usize) -> AttnOptions {
    AttnOptions::new(d)
}

/// Gemma 2: sliding window on every other layer, soft-cap 50 everywhere, scale 1/sqrt(256)
/// (query_pre_attn_scalar). The model's window is 4096 (expressible, and checked by the
/// validators); a window of 24 keys makes the same interleaving bite on short test sequences.
pub(crate) fn gemma2_layers(num_layers: usize, d: usize, window: u32) -> Vec<LayerSpec> {
    (0..num_layers)
        .map(|i| {
            let o = AttnOptions { softcap: Some(50.0), window: (i % 2 == 0).then_some(window), ..opts(d) };
            LayerSpec::decoder(o)
        })
        .collect()
}

#[test]
fn gemma2_interleaved_windows_and_softcap() {
    run(shape(4, 2, 256), gemma2_layers(4, 256, 24), &decoder_steps(), "gemma2 d256 w24");
    // At the real window the sliding layers see everything in these steps: same as full.
    run(shape(4, 2, 256), gemma2_layers(2, 256, 4096), &decoder_steps()[..2], "gemma2 d256 w4096");
}

#[test]
fn kv_cache_groups_with_null_blocks_past_the_window() {
    // The sliding layers' own block tables and slots, blocks before the window nulled (vLLM's
    // hybrid allocator frees them): the kernels must neither read nor need them.
    for (d, window) in [(64, 24), (32, 7)] {
        let layers = gemma2_layers(4, d, window);
        let schedule: Vec<EncDecStep> = decoder_steps().iter().map(|p| EncDecStep::for_layers(&layers, p)).collect();
        run_schedule(shape(4, 2, d), layers, &schedule, (&format!("groups d{d} w{window}"), Some(window as usize)));
    }
}

#[test]
fn kv_shared_layers_read_their_targets_cache() {
    let w = |w| AttnOptions { window: Some(w), ..opts(64) };
    let layers = vec![
        LayerSpec::decoder(opts(64)),
        LayerSpec::decoder(w(19)),
        LayerSpec::decoder(AttnOptions { softmax_scale: 0.3, ..opts(64) }).sharing_kv_of(0),
        LayerSpec::decoder(w(19)).sharing_kv_of(1),
        LayerSpec::decoder(w(7)).sharing_kv_of(1),
    ];
    run(shape(8, 2, 64), layers, &decoder_steps(), "kv sharing gqa4");
}

#[test]
fn chunked_local_attention() {
    for (chunk, bs) in [(16, 16), (12, 16), (32, 16), (5, 8)] {
        let layers = vec![
            LayerSpec::decoder(AttnOptions { chunk_size: Some(chunk), ..opts(64) }),
            LayerSpec::decoder(opts(64)),
            LayerSpec::decoder(AttnOptions { chunk_size: Some(chunk), ..opts(64) }).sharing_kv_of(0),
        ];
        let s = Shape { block_size: bs, ..shape(6, 3, 64) };
        run(s, layers, &decoder_steps(), &format!("chunk {chunk} block {bs}"));
    }
}

#[test]
fn per_layer_alibi_sinks_and_scale() {
    let layers = vec![
        LayerSpec { alibi: true, ..LayerSpec::decoder(opts(32)) },
        LayerSpec { sinks: true, ..LayerSpec::decoder(AttnOptions { softmax_scale: 0.05, ..opts(32) }) },
        LayerSpec::decoder(AttnOptions { softcap: Some(5.0), ..opts(32) }),
    ];
    run(shape(4, 4, 32), layers, &decoder_steps(), "alibi sinks scale");
}

/// Encoder steps: whole prompts only (fresh requests), odd lengths, one token, an empty one.
fn encoder_steps() -> Vec<Vec<(usize, usize)>> {
    vec![vec![(0, 13), (1, 1), (2, 40)], vec![(3, 7), (4, 0), (5, 1), (6, 22)], vec![(7, 64)]]
}

#[test]
fn encoder_only_layers_are_bidirectional() {
    for w in [None, Some(0), Some(3), Some(100)] {
        let o = AttnOptions { symmetric_window: w, ..opts(64) };
        let layers = vec![LayerSpec::encoder_only(o), LayerSpec::encoder_only(AttnOptions { softcap: Some(20.0), ..o })];
        run(shape(8, 2, 64), layers, &encoder_steps(), &format!("encoder window {w:?}"));
    }
}

#[test]
fn encoder_decoder_cross_attention() {
    run_schedule(shape(8, 2, 64), enc_dec_layers(64), &enc_dec_schedule(), ("enc-dec gqa4", None));
    run_schedule(shape(4, 4, 32), enc_dec_layers(32), &enc_dec_schedule(), ("enc-dec mha d32", None));
}

fn arg_of<T>(r: attn_rs::Result<T>) -> (String, String) {
    match r {
        Err(AttnError::InvalidArgument { arg, reason }) => (arg.to_string(), reason),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("accepted"),
    }
}

#[test]
fn bad_layer_specs_are_refused_naming_the_layer_and_value() {
    let s = shape(4, 2, 64);
    let d = opts(64);
    let cases: Vec<(Vec<LayerSpec>, &str)> = vec![
        (vec![LayerSpec::decoder(d), LayerSpec::decoder(d).sharing_kv_of(1)], "layer 1: kv_sharing_target 1"),
        (vec![LayerSpec::decoder(d).sharing_kv_of(3)], "layer 0: kv_sharing_target 3"),
        (vec![LayerSpec::decoder(d), LayerSpec::decoder(d).sharing_kv_of(0), LayerSpec::decoder(d).sharing_kv_of(1)], "name layer 0"),
        (vec![LayerSpec::encoder_only(d), LayerSpec::decoder(d).sharing_kv_of(0)], "encoder-only layer, which keeps no cache"),
        (vec![LayerSpec::decoder(d), LayerSpec::encoder_only(d).sharing_kv_of(0)], "layer 1: kv_sharing_target 0 on an encoder-only"),
        (vec![LayerSpec::decoder(AttnOptions { chunk_size: Some(0), ..d })], "chunk_size 0"),
        (vec![LayerSpec::decoder(AttnOptions { window: Some(0), ..d })], "window of 0"),
        (vec![LayerSpec::decoder(AttnOptions { symmetric_window: Some(4), ..d })], "symmetric_window 4 with causal"),
        (vec![LayerSpec::encoder_only(AttnOptions { window: Some(4), ..d })], "window Some(4) on an encoder-only"),
        (vec![LayerSpec::encoder_only(AttnOptions { chunk_size: Some(8), ..d })], "chunk_size Some(8) on an encoder-only"),
        (vec![LayerSpec::decoder(AttnOptions { softmax_scale: f32::NAN, ..d })], "softmax_scale NaN"),
        (vec![LayerSpec::decoder(AttnOptions { softcap: Some(-1.0), ..d })], "softcap -1"),
        // Encoder-decoder models.
        (vec![LayerSpec::encoder(AttnOptions { window: Some(4), ..d })], "window Some(4) on an encoder layer"),
        (vec![LayerSpec::decoder(d), LayerSpec::cross_attention(d, 0)], "of kind decoder, but layers of kind encoder-decoder"),
        (vec![LayerSpec::encoder(d), LayerSpec::decoder(d).sharing_kv_of(0)], "of kind encoder, but layers of kind decoder"),
        (vec![LayerSpec::encoder_only(d), LayerSpec::cross_attention(d, 0)], "encoder-only layer, which keeps no cache"),
        (vec![LayerSpec::encoder(d), LayerSpec::encoder(d).sharing_kv_of(0)], "on an encoder layer, which reads no cache"),
        (vec![LayerSpec::encoder(d), LayerSpec::cross_attention(AttnOptions { window: Some(8), ..d }, 0)], "no position"),
        (vec![LayerSpec::encoder(d), LayerSpec { alibi: true, ..LayerSpec::cross_attention(d, 0) }], "ALiBi true"),
        (vec![LayerSpec::cross_attention(d, 0)], "kv_sharing_target 0 is not an earlier layer"),
    ];
    for (layers, needle) in cases {
        let (arg, reason) = arg_of(attention(&s, layers.clone()));
        assert_eq!(arg, "layers", "{layers:?}");
        assert!(reason.contains(needle), "{reason:?} should say {needle:?}");
    }
    // Features the model does not declare.
    let model = ModelConfig::standard(4, 2, 64, DType::F32, 16, KvLayout::FlashNhd);
    let sel = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None).unwrap();
    for (spec, needle) in [
        (LayerSpec::decoder(AttnOptions { window: Some(4096), ..d }), "window Some(4096)"),
        (LayerSpec::decoder(AttnOptions { softcap: Some(50.0), ..d }), "softcap Some(50.0)"),
        (LayerSpec { alibi: true, ..LayerSpec::decoder(d) }, "ALiBi"),
        (LayerSpec { sinks: true, ..LayerSpec::decoder(d) }, "sinks"),
    ] {
        let config = ForwardConfig::new(model, 8, limits()).with_layers(vec![LayerSpec::decoder(d), spec]);
        let (arg, reason) = arg_of(Attention::new(&sel, config, None));
        assert_eq!(arg, "layers");
        assert!(reason.starts_with("layer 1: ") && reason.contains(needle), "{reason}");
    }
    // MLA layers: decoders with their own cache, a scale only.
    let mla = ModelConfig::mla(4, DType::F32, 16);
    let sel = select_backend_no_env(&mla, &DeviceInfo::no_gpu(), None).unwrap();
    for spec in [
        LayerSpec::encoder_only(opts(576)),
        LayerSpec::encoder(opts(576)),
        LayerSpec::cross_attention(opts(576), 0),
        LayerSpec::decoder(AttnOptions { chunk_size: Some(64), ..opts(576) }),
        LayerSpec::decoder(opts(576)).sharing_kv_of(0),
    ] {
        let config = ForwardConfig::new(mla, 8, limits()).with_layers(vec![LayerSpec::decoder(opts(576)), spec]);
        assert_eq!(arg_of(Attention::new(&sel, config, None)).0, "layers");
    }
    // The Gemma-2 setting itself is accepted.
    attention(&shape(8, 4, 256), gemma2_layers(26, 256, 4096)).expect("gemma 2");
}

#[test]
fn bad_layer_calls_are_refused_before_anything_is_written() {
    let s = shape(4, 2, 64);
    let d = opts(64);
    let layers = vec![LayerSpec::decoder(d), LayerSpec::decoder(d).sharing_kv_of(0), LayerSpec::encoder_only(d)];
    let mut attn = attention(&s, layers.clone()).unwrap();
    let mut meta = attn.new_step_metadata().unwrap();
    let mut engine = Engine::new(s.clone(), layers, 3, |x| x);
    let step = engine.step(&[(0, 1), (1, 9)]);
    meta.build(&step.input(&s)).unwrap();
    let n = attn.cache_spec().num_elements();
    let (mut cache, mut other) = (vec![0f32; n], vec![0f32; n]);
    let data = engine.data(&step);
    let rows = step.rows();
    let (q_rows, kv_rows) = (RowsDesc::contiguous(rows, 4, 64), RowsDesc::contiguous(rows, 2, 64));
    let mut out = vec![POISON; rows * 4 * 64];
    let call = |attn: &mut Attention, meta: &StepMetadata, layer: Option<usize>, kv: bool, cache: &mut Vec<f32>, out: &mut Vec<f32>| {
        let io = LayerIo::Cpu(plain_layer(&data, (q_rows, kv_rows), kv, cache, out));
        match layer {
            Some(l) => attn.forward_layer(meta, l, io),
            None => attn.forward(meta, io),
        }
    };
    // The config lists its layers: `forward` must be told which.
    assert_eq!(arg_of(call(&mut attn, &meta, None, true, &mut cache, &mut out)).0, "layer");
    let (arg, reason) = arg_of(call(&mut attn, &meta, Some(3), true, &mut cache, &mut out));
    assert!(arg == "layer" && reason.contains("3") && reason.contains("3 layers"), "{reason}");
    // Layer 1 before layer 0 ran: its target's cache is unknown.
    let (arg, reason) = arg_of(call(&mut attn, &meta, Some(1), false, &mut cache, &mut out));
    assert!(arg == "cache" && reason.contains("has not run"), "{reason}");
    // An owner without new K/V; a sharing layer with them.
    assert_eq!(arg_of(call(&mut attn, &meta, Some(0), false, &mut cache, &mut out)).0, "new_kv");
    call(&mut attn, &meta, Some(0), true, &mut cache, &mut out).unwrap();
    assert_eq!(arg_of(call(&mut attn, &meta, Some(1), true, &mut cache, &mut out)).0, "new_kv");
    // A sharing layer given another buffer than its target's.
    out.fill(POISON);
    let (arg, reason) = arg_of(call(&mut attn, &meta, Some(1), false, &mut other, &mut out));
    assert!(arg == "cache" && reason.contains("layer 0's cache"), "{reason}");
    assert!(out.iter().all(|&x| x == POISON) && other.iter().all(|&x| x == 0.0), "a refused call wrote");
    call(&mut attn, &meta, Some(1), false, &mut cache, &mut out).unwrap();
    // Encoder-only: the first step's requests are whole (fresh); the next step's have context.
    call(&mut attn, &meta, Some(2), true, &mut Vec::new(), &mut out).unwrap();
    engine.finish(&step);
    let step = engine.step(&[(0, 1), (1, 4)]);
    meta.build(&step.input(&s)).unwrap();
    let (arg, reason) = arg_of(call(&mut attn, &meta, Some(2), true, &mut Vec::new(), &mut out));
    assert!(arg == "step" && reason.contains("request 0 has seq_len 2 but 1 query tokens"), "{reason}");
}

/// A layer call with `data`'s rows, no ALiBi, sinks or scales; new K/V when `kv`.
fn plain_layer<'a>(
    data: &'a LayerData,
    (q_rows, kv_rows): (RowsDesc, RowsDesc),
    kv: bool,
    cache: &'a mut [f32],
    out: &'a mut [f32],
) -> CpuLayer<'a> {
    let new_kv = match kv {
        true => NewKv::Standard { k: data.k.as_slice().into(), k_rows: kv_rows, v: data.v.as_slice().into(), v_rows: kv_rows },
        false => NewKv::None,
    };
    CpuLayer {
        q: data.q.as_slice().into(),
        q_rows,
        new_kv,
        cache: cache.into(),
        out: out.into(),
        out_rows: q_rows,
        alibi_slopes: None,
        sinks: None,
        kv_scales: None,
    }
}

#[test]
fn bad_cross_attention_calls_are_refused() {
    let s = shape(4, 2, 64);
    let d = opts(64);
    let layers = vec![LayerSpec::encoder(d), LayerSpec::cross_attention_own(d), LayerSpec::cross_attention(d, 0)];
    let mut attn = attention(&s, layers.clone()).unwrap();
    let mut meta = attn.new_step_metadata().unwrap();
    let mut engine = Engine::new(s.clone(), layers, 5, |x| x);
    let step = engine.step(&[(0, 5), (1, 9)]);
    meta.build(&step.input(&s)).unwrap();
    let n = attn.cache_spec().num_elements();
    let mut cache = vec![0f32; n];
    let data = engine.data(&step);
    let rows = step.rows();
    let (q_rows, kv_rows) = (RowsDesc::contiguous(rows, 4, 64), RowsDesc::contiguous(rows, 2, 64));
    let write = |attn: &mut Attention, layer: usize, kv: bool, cache: &mut Vec<f32>| {
        let new_kv = match kv {
            true => NewKv::Standard { k: data.k.as_slice().into(), k_rows: kv_rows, v: data.v.as_slice().into(), v_rows: kv_rows },
            false => NewKv::None,
        };
        attn.write_kv(&meta, layer, KvWriteIo::Cpu(KvCacheWrite { new_kv, cache: cache.as_mut_slice().into(), kv_scales: None }))
    };
    // Only a cross-attention layer with a cache of its own takes write_kv.
    for (layer, needle) in [(0, "an encoder layer"), (2, "reading layer 0's cache"), (3, "3 layers")] {
        let (arg, reason) = arg_of(write(&mut attn, layer, true, &mut cache));
        assert!(arg == "layer" && reason.contains(needle), "{arg}: {reason}");
    }
    assert_eq!(arg_of(write(&mut attn, 1, false, &mut cache)).0, "new_kv");
    let (arg, reason) = arg_of(write(&mut attn, 1, true, &mut Vec::new()));
    assert!(arg == "cache" && reason.contains("smaller than the layout"), "{reason}");
    assert!(cache.iter().all(|&x| x == 0.0), "a refused write wrote");
    // Reading its own cache before anything was written there.
    let mut out = vec![POISON; rows * 4 * 64];
    let mut read = |attn: &mut Attention, cache: &mut Vec<f32>, kv: bool| {
        attn.forward_layer(&meta, 1, LayerIo::Cpu(plain_layer(&data, (q_rows, kv_rows), kv, cache, &mut out)))
    };
    let (arg, reason) = arg_of(read(&mut attn, &mut cache, false));
    assert!(arg == "cache" && reason.contains("write_kv has not filled"), "{reason}");
    write(&mut attn, 1, true, &mut cache).unwrap();
    let (arg, reason) = arg_of(read(&mut attn, &mut vec![0f32; n], false));
    assert!(arg == "cache" && reason.contains("was written at"), "{reason}");
    assert_eq!(arg_of(read(&mut attn, &mut cache, true)).0, "new_kv");
    read(&mut attn, &mut cache, false).unwrap();
}

#[test]
fn uniform_configs_keep_working_with_forward_and_any_layer_index() {
    let s = shape(4, 2, 64);
    let model = model(&s);
    let sel = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None).unwrap();
    let config = ForwardConfig::new(model, s.num_blocks, limits());
    assert_eq!(config.layer(17).unwrap(), LayerSpec::uniform(&model, config.opts));
    let attn = Attention::new(&sel, config, None).unwrap();
    assert!(attn.config().layers.is_empty());
}
