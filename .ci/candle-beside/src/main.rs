//! attn-rs and candle on one GPU context: candle opens the device and allocates the tensors,
//! attn-rs's `reshape_and_cache` writes candle's key/value tensors into a candle-allocated paged
//! cache on candle's stream, and candle ops read the cache back and check it.
//!
//! Without a GPU (or without a driver) it says so and exits 0.

use attn_rs::cache_write::{reshape_and_cache, KvWrite};
use attn_rs::cudarc::driver::{CudaSlice, CudaStream, CudaView};
use attn_rs::{AttnDevice, DevIn, DevOut, DeviceStatus, KvCacheSpec, KvLayout, RowsDesc};
use candle_core::{CudaStorage, DType, Device, IndexOp, InplaceOp3, Layout, Storage, Tensor};
use half::bf16;
use std::sync::{Arc, Mutex};

const NUM_BLOCKS: usize = 8;
const BLOCK_SIZE: usize = 16;
const KV_HEADS: usize = 2;
const HEAD_SIZE: usize = 128;
const TOKENS: usize = 5;

/// `reshape_and_cache` as a candle in-place op on the cache tensor, with the key and value
/// tensors as its sources (candle holds their storage locks for the call).
struct WriteKv<'a> {
    dev: &'a AttnDevice,
    stream: &'a Arc<CudaStream>,
    slots: CudaView<'a, i64>,
    spec: KvCacheSpec,
    status: Mutex<DeviceStatus>,
}

/// A candle tensor's elements as a cudarc view: its storage's slice, from the layout's offset.
fn contiguous<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    arg: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    let slice: &CudaSlice<T> = s.as_cuda_slice::<T>()?;
    let (start, end) = l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{arg} is not contiguous")))?;
    Ok(slice.slice(start..end))
}

impl InplaceOp3 for WriteKv<'_> {
    fn name(&self) -> &'static str {
        "attn-rs reshape_and_cache"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("the example runs on the GPU only")
    }

    fn cuda_fwd(
        &self,
        cache: &mut CudaStorage,
        cache_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
        v: &CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        let key = contiguous::<bf16>(k, k_l, "key")?;
        let value = contiguous::<bf16>(v, v_l, "value")?;
        if cache_l.start_offset() != 0 || !cache_l.is_contiguous() {
            candle_core::bail!("the cache must be a whole contiguous tensor");
        }
        let cache = cache.as_cuda_slice_mut::<bf16>()?;
        let rows = RowsDesc::contiguous(TOKENS, KV_HEADS, HEAD_SIZE);
        let write = KvWrite {
            key: DevIn::new(&key, self.stream),
            key_rows: rows,
            value: DevIn::new(&value, self.stream),
            value_rows: rows,
            slot_mapping: DevIn::new(&self.slots, self.stream),
            cache: DevOut::new(cache, self.stream),
            spec: self.spec,
            scales: None,
        };
        let mut status = self.status.lock().unwrap();
        reshape_and_cache(self.dev, self.stream, write, &mut status).map_err(candle_core::Error::wrap)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !AttnDevice::driver_available() {
        println!("candle-beside: no CUDA driver or GPU found; nothing to run (built with candle-core's cuda feature and attn-rs)");
        return Ok(());
    }
    // candle opens GPU 0; attn-rs uses its context and its stream.
    let device = Device::new_cuda(0)?;
    let cuda = device.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let dev = AttnDevice::from_context(stream.context().clone())?;
    let (major, minor) = dev.compute_capability();
    println!("candle-beside: candle's CUDA device 0 (sm_{major}{minor}, {} SMs); attn-rs on its context and stream", dev.sm_count());

    // candle allocates everything: the new keys and values, the slots, the cache.
    let key = Tensor::randn(0f32, 1.0, (TOKENS, KV_HEADS, HEAD_SIZE), &device)?.to_dtype(DType::BF16)?;
    let value = Tensor::randn(0f32, 1.0, (TOKENS, KV_HEADS, HEAD_SIZE), &device)?.to_dtype(DType::BF16)?;
    let slot_list: Vec<i64> = vec![3, 17, 18, 64, 127];
    let slots = Tensor::new(slot_list.as_slice(), &device)?;
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)?;
    let cache = Tensor::zeros(spec.shape().to_vec(), DType::BF16, &device)?;

    {
        let (slot_storage, slot_layout) = slots.storage_and_layout();
        let Storage::Cuda(slot_storage) = &*slot_storage else { unreachable!("a CUDA tensor") };
        let op = WriteKv {
            dev: &dev,
            stream: &stream,
            slots: contiguous::<i64>(slot_storage, slot_layout, "slots")?,
            spec,
            status: Mutex::new(DeviceStatus::new(&stream)?),
        };
        cache.inplace_op3(&key, &value, &op)?;
        op.status.into_inner().unwrap().check(&stream)?;
    }
    println!(
        "candle-beside: reshape_and_cache wrote {TOKENS} tokens x {KV_HEADS} kv heads x {HEAD_SIZE} (bf16) into a {:?} FlashNhd cache",
        spec.shape()
    );

    // candle ops read the cache back: rows at the slots must equal the keys and values.
    let rows = |half: usize| -> candle_core::Result<Tensor> {
        let ids = Tensor::new(slot_list.iter().map(|&s| s as u32).collect::<Vec<_>>().as_slice(), &device)?;
        cache.i(half)?.reshape((NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_SIZE))?.index_select(&ids, 0)
    };
    let max_diff = |a: &Tensor, b: &Tensor| -> candle_core::Result<f32> {
        (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    };
    let (dk, dv) = (max_diff(&rows(0)?, &key)?, max_diff(&rows(1)?, &value)?);
    // Nothing else was written: the cache's nonzero elements are the keys' and the values'.
    let nonzero = cache.ne(0f64)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? as usize;
    println!("candle-beside: candle ops over the cache: max |cache - key| = {dk}, max |cache - value| = {dv}, {nonzero} nonzero elements");
    if dk != 0.0 || dv != 0.0 || nonzero != 2 * TOKENS * KV_HEADS * HEAD_SIZE {
        return Err("the cache does not hold exactly the written keys and values".into());
    }
    println!("candle-beside: ok");
    Ok(())
}
