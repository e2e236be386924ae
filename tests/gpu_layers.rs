//! Per-layer settings on the GPU (`tensor-core` through `forward_layer`) against the f64
//! reference of `tests/common/layer_steps.rs` (the one the CPU backend's tests check): Gemma-2-
//! like interleaved sliding-window and full layers with soft-cap 50 at head size 256, KV-shared
//! layers, chunked local attention (local batches where the chunk is a whole number of blocks,
//! else the `prefill_local_*` kernels, decodes included), encoder-only
//! layers with and without a symmetric window (packed K/V), encoder-decoder models (encoder
//! layers writing their caches, cross-attention reading them through a step of its own),
//! per-layer ALiBi, sinks and scales.
//! Outputs start poisoned; padding rows must stay so.

mod common;
#[allow(dead_code)]
#[path = "common/layer_steps.rs"]
mod layer_steps;

use attn_rs::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig};
use attn_rs::forward::{
    Attention, AttentionType, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, GraphBucket, HostElement, KvCacheWrite, KvWriteIo,
    LayerIo, LayerSpec, NewKv, StepGraph,
};
use attn_rs::{AttnError, AttnOptions, DType, DevIn, DevOut, KvLayout, RowsDesc, SharedBuf};
use common::*;
use half::{bf16, f16};
use layer_steps::{enc_dec_layers, enc_dec_schedule, EncDecStep, Engine, Shape};
use libtest_mimic::Trial;
use rand::Rng;

fn limits() -> ForwardLimits {
    ForwardLimits { max_num_tokens: 512, max_num_reqs: 8, max_model_len: 1024 }
}

/// `steps` through every layer on the GPU, each layer's output against the reference.
fn layers_case<T: HostElement>(shape: Shape, layers: Vec<LayerSpec>, steps: Vec<Vec<(usize, usize)>>, salt: u64) -> TestResult {
    let schedule: Vec<EncDecStep> = steps.iter().map(|p| EncDecStep::for_layers(&layers, p)).collect();
    schedule_case::<T>(shape, layers, schedule, RunOpts::new(salt, 1))
}

/// How a schedule runs.
#[derive(Clone, Copy)]
struct RunOpts {
    salt: u64,
    /// The config's (requests of up to that many query tokens are decodes).
    decode_threshold: usize,
    /// The sliding-window layers in a KV-cache group of their own (`Engine::group_step`): its
    /// block ids remapped and each request's blocks before this window nulled.
    window_group: Option<usize>,
    /// Every step metadata a graph step of this bucket, and each layer captured into a graph
    /// of its own at its first step and replayed at every step after.
    graph: Option<GraphBucket>,
}

impl RunOpts {
    fn new(salt: u64, decode_threshold: usize) -> Self {
        RunOpts { salt, decode_threshold, window_group: None, graph: None }
    }
}

/// A layer's buffers as a graph captures them (shared, so that the graph holds them), as many
/// rows as the bucket has, and the graph once captured.
struct GraphLayer<T: HostElement> {
    q: SharedBuf<T>,
    k: SharedBuf<T>,
    v: SharedBuf<T>,
    out: SharedBuf<T>,
    graph: Option<StepGraph>,
}

/// A schedule of encoder and decoder steps (`tests/common/layer_steps.rs`): each step's
/// layers on the GPU, cross-attention through the step's cross-attention metadata, each
/// layer's output against the reference.
fn schedule_case<T: HostElement>(shape: Shape, layers: Vec<LayerSpec>, schedule: Vec<EncDecStep>, run: RunOpts) -> TestResult {
    let RunOpts { salt, decode_threshold, window_group, graph } = run;
    let dtype = T::DTYPE;
    let dev = arc_device();
    let stream = new_stream();
    let model =
        ModelConfig::standard(shape.hq, shape.hkv, shape.d, dtype, shape.block_size, KvLayout::FlashNhd).with_features(Features::ALL);
    let selection = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let config = ForwardConfig { decode_threshold, ..ForwardConfig::new(model, shape.num_blocks, limits()).with_layers(layers.clone()) };
    let mut attn = Attention::new(&selection, config, Some(GpuHandles { dev, stream: stream.clone() }))?;
    let new_step = |a: &Attention| match graph {
        Some(bucket) => a.new_graph_step(bucket),
        None => a.new_step_metadata(),
    };
    let (mut meta, mut cross, mut group) = (new_step(&attn)?, new_step(&attn)?, new_step(&attn)?);
    let has_cross = layers.iter().any(|l| l.attn_type == AttentionType::EncoderDecoder);
    let n = attn.cache_spec().num_elements();
    let caches: Vec<_> = layers.iter().map(|_| SharedBuf::new(upload(&stream, &vec![T::default(); n.max(1)]))).collect();
    let round: fn(f32) -> f32 = |x| T::from_f32(x).to_f32();
    let mut engine = Engine::new(shape.clone(), layers.clone(), rng(salt).random_range(0..u64::MAX), round);
    let slopes = SharedBuf::new(upload(&stream, &engine.slopes));
    let sinks = SharedBuf::new(upload(&stream, &engine.sinks));
    let (hq, hkv, d) = (shape.hq, shape.hkv, shape.d);
    let mut graphs: Vec<Option<GraphLayer<T>>> = layers.iter().map(|_| None).collect();
    for (s, st) in schedule.iter().enumerate() {
        let step = engine.step(st.pairs());
        meta.build(&step.input(&shape))?;
        if let (EncDecStep::Decoder { encoder_of, .. }, true) = (st, has_cross) {
            engine.encoder_of.extend(encoder_of.iter().copied());
            cross.build(&engine.cross_step(&step).input(&shape))?;
        }
        if window_group.is_some() {
            group.build(&engine.group_step(&step, window_group).input(&shape))?;
        }
        // A graph's layer tensors hold the bucket's rows; the step's are the first of them.
        let rows = graph.map_or(step.rows(), |b| b.num_tokens());
        let conv = |v: &[f32]| v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
        let kv_rows = RowsDesc::contiguous(rows, hkv, d);
        for layer in st.writes(&layers) {
            let data = engine.data(&step);
            engine.write(&step, layer, &data);
            // As many rows as the step's tensors (a graph step's are the bucket's).
            let padded = |x: &[f32]| {
                let mut v = conv(x);
                v.resize(rows * hkv * d, T::default());
                v
            };
            let (k, v) = (upload(&stream, &padded(&data.k)), upload(&stream, &padded(&data.v)));
            let new_kv = NewKv::Standard { k: DevIn::new(&k, &stream), k_rows: kv_rows, v: DevIn::new(&v, &stream), v_rows: kv_rows };
            let w = KvCacheWrite { new_kv, cache: DevOut::shared(&caches[layer], &stream), kv_scales: None };
            attn.write_kv(&meta, layer, KvWriteIo::Gpu(w))?;
        }
        for layer in st.layers(&layers) {
            let spec = layers[layer];
            let meta = match spec.attn_type {
                AttentionType::EncoderDecoder => &cross,
                _ if window_group.is_some() && spec.opts.window.is_some() => &group,
                _ => &meta,
            };
            let data = engine.data(&step);
            let want = engine.reference(&step, layer, &data);
            let q_rows = RowsDesc::contiguous(rows, hq, d);
            let owner = spec.kv_sharing_target.unwrap_or(layer);
            // Layers that read a cache written before take no new K/V.
            let reads_only = spec.kv_sharing_target.is_some() || spec.attn_type == AttentionType::EncoderDecoder;
            let g = match graph {
                Some(_) => {
                    let alloc = |len: usize| SharedBuf::new(upload(&stream, &vec![T::default(); len]));
                    let g = graphs[layer].get_or_insert_with(|| GraphLayer {
                        q: alloc(rows * hq * d),
                        k: alloc(rows * hkv * d),
                        v: alloc(rows * hkv * d),
                        out: alloc(rows * hq * d),
                        graph: None,
                    });
                    g.q.write_from_host(&stream, &conv(&data.q))?;
                    g.k.write_from_host(&stream, &conv(&data.k))?;
                    g.v.write_from_host(&stream, &conv(&data.v))?;
                    g.out.write_from_host(&stream, &vec![poison::<T>(); rows * hq * d])?;
                    Some(g)
                }
                None => None,
            };
            let (alibi, sink) = (spec.alibi.then(|| DevIn::shared(&slopes, &stream)), spec.sinks.then(|| DevIn::shared(&sinks, &stream)));
            let got = match g {
                Some(g) => {
                    if g.graph.is_none() {
                        let io = GpuLayer {
                            q: DevIn::shared(&g.q, &stream),
                            q_rows,
                            new_kv: match reads_only {
                                true => NewKv::None,
                                false => NewKv::Standard {
                                    k: DevIn::shared(&g.k, &stream),
                                    k_rows: kv_rows,
                                    v: DevIn::shared(&g.v, &stream),
                                    v_rows: kv_rows,
                                },
                            },
                            cache: DevOut::shared(&caches[owner], &stream),
                            out: DevOut::shared(&g.out, &stream),
                            out_rows: q_rows,
                            alibi_slopes: alibi,
                            sinks: sink,
                            kv_scales: None,
                        };
                        g.graph = Some(attn.capture(meta, |a| a.forward_layer(meta, layer, LayerIo::Gpu(io)))?);
                    }
                    g.graph.as_ref().expect("captured").replay(meta)?;
                    attn.check_status()?;
                    download(&stream, g.out.as_cuda_slice())
                }
                None => {
                    let (q, k, v) = (upload(&stream, &conv(&data.q)), upload(&stream, &conv(&data.k)), upload(&stream, &conv(&data.v)));
                    let mut out = upload(&stream, &vec![poison::<T>(); rows * hq * d]);
                    let new_kv = match reads_only {
                        true => NewKv::None,
                        false => {
                            NewKv::Standard { k: DevIn::new(&k, &stream), k_rows: kv_rows, v: DevIn::new(&v, &stream), v_rows: kv_rows }
                        }
                    };
                    let io = GpuLayer {
                        q: DevIn::new(&q, &stream),
                        q_rows,
                        new_kv,
                        cache: DevOut::shared(&caches[owner], &stream),
                        out: DevOut::new(&mut out, &stream),
                        out_rows: q_rows,
                        alibi_slopes: alibi,
                        sinks: sink,
                        kv_scales: None,
                    };
                    attn.forward_layer(meta, layer, LayerIo::Gpu(io))?;
                    attn.check_status()?;
                    download(&stream, &out)
                }
            };
            let tokens: Vec<f64> = got[..step.nt * hq * d].iter().map(|x| x.to_f32() as f64).collect();
            let err = rel_error(&tokens, &want);
            if !within(err, tolerance(dtype)) {
                return Err(format!("step {s} layer {layer} ({spec:?}): rel error {err:.3e} > {}", tolerance(dtype)).into());
            }
            let p = poison::<T>().to_f32().to_bits();
            if got[step.nt * hq * d..].iter().any(|x| x.to_f32().to_bits() != p) {
                return Err(format!("step {s} layer {layer}: padding rows were written").into());
            }
        }
        engine.finish(&step);
    }
    Ok(())
}

fn shape(hq: usize, hkv: usize, d: usize) -> Shape {
    Shape { hq, hkv, d, block_size: 16, num_blocks: 160 }
}

/// Decodes beside chunked prefills, odd lengths, one-token prompts, an empty request, and a
/// long context (decode split-K on the plain layers).
fn decoder_steps() -> Vec<Vec<(usize, usize)>> {
    vec![
        vec![(0, 300), (1, 1)],
        vec![(1, 20), (0, 1), (2, 0)],
        vec![(0, 1), (1, 1), (2, 145), (3, 5)],
        vec![(3, 1), (2, 1), (0, 1), (1, 33)],
        vec![(3, 129), (0, 1), (2, 1), (1, 1)],
    ]
}

fn encoder_steps() -> Vec<Vec<(usize, usize)>> {
    vec![vec![(0, 13), (1, 1), (2, 140)], vec![(3, 7), (4, 0), (5, 1), (6, 65)], vec![(7, 200)]]
}

fn gemma2(num_layers: usize, window: u32) -> Vec<LayerSpec> {
    gemma_layers(num_layers, 256, window)
}

/// Gemma 2's interleaving at head size `d`: a window on the even layers, soft-cap 50 on all.
fn gemma_layers(num_layers: usize, d: usize, window: u32) -> Vec<LayerSpec> {
    (0..num_layers)
        .map(|i| {
            let o = AttnOptions { softcap: Some(50.0), window: (i % 2 == 0).then_some(window), ..AttnOptions::new(d) };
            LayerSpec::decoder(o)
        })
        .collect()
}

fn cases() -> Vec<(String, Box<dyn FnOnce() -> TestResult + Send>)> {
    let o = AttnOptions::new;
    let mut v: Vec<(String, Box<dyn FnOnce() -> TestResult + Send>)> = Vec::new();
    v.push(("gemma2_d256_window_softcap".into(), Box::new(|| layers_case::<bf16>(shape(8, 4, 256), gemma2(4, 96), decoder_steps(), 1))));
    // Hybrid KV-cache groups: the sliding layers' own tables, blocks past their window nulled.
    for (d, hq, hkv, window) in [(256, 8, 4, 96), (128, 8, 2, 40), (64, 16, 4, 17)] {
        let f: Box<dyn FnOnce() -> TestResult + Send> = Box::new(move || {
            let layers = gemma_layers(4, d, window as u32);
            let steps = decoder_steps().iter().map(|p| EncDecStep::for_layers(&layers, p)).collect();
            let run = RunOpts { window_group: Some(window), ..RunOpts::new(10, 1) };
            schedule_case::<bf16>(shape(hq, hkv, d), layers, steps, run)
        });
        v.push((format!("kv_cache_groups_d{d}_window{window}"), f));
    }
    v.push(("gemma2_d256_window4096".into(), Box::new(|| layers_case::<bf16>(shape(8, 4, 256), gemma2(2, 4096), decoder_steps(), 2))));
    let shared = vec![
        LayerSpec::decoder(o(128)),
        LayerSpec::decoder(AttnOptions { window: Some(40), ..o(128) }),
        LayerSpec::decoder(AttnOptions { softmax_scale: 0.05, ..o(128) }).sharing_kv_of(0),
        LayerSpec::decoder(AttnOptions { window: Some(40), ..o(128) }).sharing_kv_of(1),
    ];
    v.push(("kv_sharing_gqa4_d128".into(), Box::new(move || layers_case::<bf16>(shape(8, 2, 128), shared, decoder_steps(), 3))));
    for (d, chunk, dt) in [(64, 64, DType::BF16), (128, 48, DType::F16), (96, 100, DType::BF16), (256, 32, DType::BF16)] {
        let layers = vec![
            LayerSpec::decoder(AttnOptions { chunk_size: Some(chunk), ..o(d) }),
            LayerSpec::decoder(o(d)),
            LayerSpec::decoder(AttnOptions { chunk_size: Some(chunk), ..o(d) }).sharing_kv_of(0),
        ];
        let name = format!("chunked_local_d{d}_chunk{chunk}_{dt:?}");
        let f: Box<dyn FnOnce() -> TestResult + Send> = match dt {
            DType::F16 => Box::new(move || layers_case::<f16>(shape(8, 2, d), layers, decoder_steps(), 4)),
            _ => Box::new(move || layers_case::<bf16>(shape(8, 2, d), layers, decoder_steps(), 4)),
        };
        v.push((name, f));
    }
    for (d, w) in [(64, None), (64, Some(0)), (128, Some(7)), (256, Some(64)), (96, Some(1000))] {
        let layers = vec![
            LayerSpec::encoder_only(AttnOptions { symmetric_window: w, ..o(d) }),
            LayerSpec { alibi: true, ..LayerSpec::encoder_only(AttnOptions { symmetric_window: w, softcap: Some(20.0), ..o(d) }) },
        ];
        v.push((
            format!("encoder_only_d{d}_window_{}", w.map_or("none".to_string(), |w| w.to_string())),
            Box::new(move || layers_case::<bf16>(shape(8, 2, d), layers, encoder_steps(), 5)),
        ));
    }
    let mixed = vec![
        LayerSpec { alibi: true, ..LayerSpec::decoder(o(64)) },
        LayerSpec { sinks: true, ..LayerSpec::decoder(AttnOptions { softmax_scale: 0.05, ..o(64) }) },
        LayerSpec::decoder(AttnOptions { softcap: Some(5.0), ..o(64) }),
    ];
    v.push(("per_layer_alibi_sinks_scale_d64".into(), Box::new(move || layers_case::<f16>(shape(4, 4, 64), mixed, decoder_steps(), 6))));
    for (d, hq, hkv) in [(64, 8, 2), (128, 4, 4), (256, 16, 2)] {
        v.push((
            format!("encoder_decoder_cross_attention_d{d}_{hq}q{hkv}kv"),
            Box::new(move || schedule_case::<bf16>(shape(hq, hkv, d), enc_dec_layers(d), enc_dec_schedule(), RunOpts::new(7, 1))),
        ));
    }
    v.push((
        "encoder_decoder_cross_attention_d128_f16".into(),
        Box::new(|| schedule_case::<f16>(shape(8, 2, 128), enc_dec_layers(128), enc_dec_schedule(), RunOpts::new(8, 1))),
    ));
    // Decodes of several tokens: cross-attention runs the whole step as one prefill.
    v.push((
        "encoder_decoder_cross_attention_d64_decode_threshold_4".into(),
        Box::new(|| schedule_case::<bf16>(shape(8, 2, 64), enc_dec_layers(64), enc_dec_schedule(), RunOpts::new(9, 4))),
    ));
    // The same layers from CUDA graphs of a mixed bucket, one per layer, replayed each step:
    // chunked local attention and encoders from the whole step's tiles, cross-attention from
    // its own step's decode plan and prefill tiles (or the whole step's, with a decode
    // threshold of 4).
    let graph = |salt, threshold| RunOpts { graph: Some(GraphBucket::mixed(8, 512)), ..RunOpts::new(salt, threshold) };
    let chunked = vec![
        LayerSpec::decoder(AttnOptions { chunk_size: Some(48), ..o(128) }),
        LayerSpec::decoder(o(128)),
        LayerSpec::decoder(AttnOptions { chunk_size: Some(48), ..o(128) }).sharing_kv_of(0),
    ];
    v.push((
        "graph_chunked_local_d128_chunk48".into(),
        Box::new(move || {
            let steps = decoder_steps().iter().map(|p| EncDecStep::for_layers(&chunked, p)).collect();
            schedule_case::<f16>(shape(8, 2, 128), chunked, steps, graph(11, 1))
        }),
    ));
    v.push((
        "graph_encoder_only_d128_window_7".into(),
        Box::new(move || {
            let layers = vec![
                LayerSpec::encoder_only(o(128)),
                LayerSpec {
                    alibi: true,
                    ..LayerSpec::encoder_only(AttnOptions { symmetric_window: Some(7), softcap: Some(20.0), ..o(128) })
                },
            ];
            let steps = encoder_steps().iter().map(|p| EncDecStep::for_layers(&layers, p)).collect();
            schedule_case::<bf16>(shape(8, 2, 128), layers, steps, graph(12, 1))
        }),
    ));
    for threshold in [1, 4] {
        v.push((
            format!("graph_encoder_decoder_cross_attention_d64_decode_threshold_{threshold}"),
            Box::new(move || schedule_case::<bf16>(shape(8, 2, 64), enc_dec_layers(64), enc_dec_schedule(), graph(13, threshold))),
        ));
    }
    v.push(("refusals".into(), Box::new(refusals)));
    v
}

/// What the GPU refuses before any launch: chunked local attention over an FP8 cache with a
/// chunk that is not a whole number of blocks (only the local-mask kernels, which read 16-bit
/// caches, could run it), at `Attention::new`. A chunk of whole blocks runs as a local batch in
/// eager steps and every graph bucket.
fn refusals() -> TestResult {
    let dev = arc_device();
    let stream = new_stream();
    let model = ModelConfig::standard(8, 2, 128, DType::BF16, 16, KvLayout::FlashNhd).with_cache_dtype(DType::Fp8E4m3);
    let selection = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let config = |chunk| {
        let layers = vec![LayerSpec::decoder(AttnOptions { chunk_size: Some(chunk), ..AttnOptions::new(128) })];
        ForwardConfig { decode_threshold: 2, ..ForwardConfig::new(model, 16, limits()).with_layers(layers) }
    };
    let gpu = || Some(GpuHandles { dev: dev.clone(), stream: stream.clone() });
    match Attention::new(&selection, config(40), gpu()) {
        Err(AttnError::InvalidArgument { arg: "layers", .. }) => {}
        other => return Err(format!("chunks of 40 over blocks of 16: expected a refusal of `layers`, got {:?}", other.err()).into()),
    }
    let attention = Attention::new(&selection, config(64), gpu())?;
    attention.new_step_metadata()?;
    attention.new_graph_step(GraphBucket::decode(4))?;
    attention.new_graph_step(GraphBucket::mixed(4, 64))?;
    attention.new_graph_step(GraphBucket::uniform(4, 2))?;
    Ok(())
}

fn main() {
    let all = cases();
    let picked: Vec<_> = if quick() { all.into_iter().step_by(2).collect() } else { all };
    let trials = picked.into_iter().map(|(name, f)| Trial::test(format!("layers::{name}"), f)).collect();
    run_gpu_trials(trials)
}
