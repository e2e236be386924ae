//! The device handle: the GPU's context, the kernel module for its compute capability (loaded
//! once), and kernel launches on the caller's stream.

use crate::error::{AttnError, Result};
use crate::kernels::KernelId;
use crate::ptx::{available_targets, target_for, Family, PtxTarget, ALL_FAMILIES, NUM_FAMILIES};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A kernel's parameter block, passed by value as the kernel's single `.param` aggregate.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct KernelParams<P: Copy>(pub P);
// SAFETY: `P` is one of attn_math's `#[repr(C)]` blocks of plain integers, which the kernels
// declare with the same layout.
unsafe impl<P: Copy> DeviceRepr for KernelParams<P> {}

/// FP8 decode batches with requests of `attn_math::keys_rows::FP8_LONG_KEYS` keys or more run the deep-pipeline
/// kernels only where DRAM is slow for the SMs: below this many bytes a second per SM (the H100
/// SXM has 25e9, where deep measured 201 us against 211-214 at 64 x 4096). With more, the
/// three-CTA kernels, whose third CTA hides more of the conversions' and MMAs' latencies, are
/// faster at every length (the H200, 37e9: 64 x 4096 143.6 against 161.5 us, 8 x 32768 132
/// against 159, 1 x 131072 70.8 against 82.8, 128 x 2048 133.7 against 171.2; docs/decode.md).
/// At width 64 the short batches' kernels run four CTAs an SM and match the deep ones on long
/// requests there (64 x 4096 79.0 against 78.8 us).
const FP8_DEEP_MAX_BANDWIDTH_PER_SM: f64 = 30e9;

/// One GPU as the library uses it: its CUDA context, the embedded kernel module for its compute
/// capability (loaded per kernel family on first use), and the kernels' launch settings.
/// Every op takes it by reference; one serves every stream of the GPU.
pub struct AttnDevice {
    ctx: Arc<CudaContext>,
    target: &'static PtxTarget,
    /// Each kernel family's module, loaded on first use.
    modules: Mutex<[Option<Arc<CudaModule>>; NUM_FAMILIES]>,
    compute_capability: (i32, i32),
    sm_count: u32,
    /// Peak DRAM bandwidth in bytes a second (0 where the driver reports no memory clock).
    memory_bandwidth: f64,
    /// The most dynamic shared memory a CTA may opt in to.
    max_shared_optin: i32,
    functions: Mutex<HashMap<KernelId, CudaFunction>>,
    /// Resident CTAs per SM of (kernel, dynamic shared memory), from the driver.
    occupancy: Mutex<HashMap<(KernelId, u32), u32>>,
    /// `max_active_clusters` by (kernel, shared bytes, cluster size).
    clusters: Mutex<HashMap<(KernelId, u32, u32), u32>>,
}

impl AttnDevice {
    /// Whether a CUDA driver is installed and sees at least one GPU (never panics).
    pub fn driver_available() -> bool {
        driver_library_present() && matches!(CudaContext::device_count(), Ok(n) if n > 0)
    }

    /// Opens GPU `ordinal` (its primary context). Kernel modules load on first use (see
    /// [`preload`](Self::preload)).
    ///
    /// Errors: `NoDevice` without a driver or GPU; `UnsupportedDevice` when no embedded module
    /// runs on the GPU (before sm_80, or a build whose features left its target out); `Driver`
    /// when the driver refuses the context.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !Self::driver_available() {
            return Err(AttnError::NoDevice(format!("asked for GPU {ordinal}")));
        }
        Self::from_context(CudaContext::new(ordinal)?)
    }

    /// Uses an existing context (an engine's, or candle's device context). Kernel modules load
    /// on first use (see [`preload`](Self::preload)).
    ///
    /// Errors: `UnsupportedDevice` when no embedded module runs on the GPU; `Driver` when the
    /// driver's attribute queries fail.
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx.compute_capability()?;
        let target =
            target_for((major * 10 + minor) as u32).ok_or(AttnError::UnsupportedDevice { major, minor, available: available_targets() })?;
        let sm_count = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_shared_optin = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        // Double data rate: two transfers of the bus width a memory clock (kHz).
        let memory_clock_khz = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).unwrap_or(0).max(0);
        let bus_bits = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).unwrap_or(0).max(0);
        let memory_bandwidth = 2.0 * memory_clock_khz as f64 * 1e3 * bus_bits as f64 / 8.0;
        Ok(AttnDevice {
            ctx,
            target,
            modules: Mutex::new([None, None, None]),
            compute_capability: (major, minor),
            sm_count,
            memory_bandwidth,
            max_shared_optin,
            functions: Mutex::new(HashMap::new()),
            occupancy: Mutex::new(HashMap::new()),
            clusters: Mutex::new(HashMap::new()),
        })
    }

    /// The CUDA context the kernels are loaded in (make streams and buffers from it).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The GPU's compute capability as (major, minor), e.g. (9, 0) on an H100.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }
    /// Streaming multiprocessors on the GPU (what the split planners fill).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    /// Peak DRAM bandwidth in bytes a second, from the memory clock and bus width the driver
    /// reports (about 3.35e12 on an H100 SXM, 4.9e12 on an H200), or `None` where it reports
    /// none.
    pub fn memory_bandwidth(&self) -> Option<f64> {
        (self.memory_bandwidth > 0.0).then_some(self.memory_bandwidth)
    }

    /// Whether FP8 decode of long requests runs the deep-pipeline keys-as-rows kernels (two CTAs
    /// an SM, six stages) rather than the three-CTA ones: where the memory is slow for the SMs
    /// ([`FP8_DEEP_MAX_BANDWIDTH_PER_SM`]),
    /// and where the bandwidth is unknown.
    pub(crate) fn fp8_deep_pipeline(&self) -> bool {
        let per_sm = |b: f64| b / self.sm_count.max(1) as f64;
        self.memory_bandwidth().is_none_or(|b| per_sm(b) < FP8_DEEP_MAX_BANDWIDTH_PER_SM)
    }

    /// The embedded module in use ("sm_90a", "sm_80").
    pub fn ptx_target(&self) -> &'static str {
        self.target.name
    }

    /// Loads every kernel family now (otherwise each loads, and is JIT-compiled by the driver,
    /// on its first launch): for engines that want the cost at start-up, not on a first request.
    ///
    /// Errors: `Driver` when a module does not load.
    pub fn preload(&self) -> Result<()> {
        for family in ALL_FAMILIES {
            self.module(family)?;
        }
        Ok(())
    }

    fn module(&self, family: Family) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().expect("module cache poisoned");
        let slot = &mut modules[family as usize];
        if let Some(m) = slot {
            return Ok(m.clone());
        }
        let m = match self.sass_for(family) {
            // A driver that refuses the cubin (too old for the ptxas that made it) still
            // JIT-compiles the PTX.
            Some(cubin) => self.ctx.load_module(Ptx::from_binary(cubin)).or_else(|_| self.load_ptx(family))?,
            None => self.load_ptx(family)?,
        };
        *slot = Some(m.clone());
        Ok(m)
    }

    fn load_ptx(&self, family: Family) -> std::result::Result<Arc<CudaModule>, cudarc::driver::DriverError> {
        self.ctx.load_module(Ptx::from_src(self.target.module(family)))
    }

    /// The family's SASS, when this GPU runs it and `ATTN_FORCE_PTX_JIT` is not `1`.
    fn sass_for(&self, family: Family) -> Option<Vec<u8>> {
        self.loads_sass().then(|| self.target.cubin(family))
    }

    /// Whether the kernels load as SASS built ahead of time (else the driver JIT-compiles PTX).
    pub fn loads_sass(&self) -> bool {
        let (major, minor) = self.compute_capability;
        let forced_jit = std::env::var("ATTN_FORCE_PTX_JIT").is_ok_and(|v| v == "1");
        !forced_jit && self.target.runs_sass((major * 10 + minor) as u32)
    }

    pub(crate) fn function(&self, kernel: KernelId) -> Result<CudaFunction> {
        let mut cache = self.functions.lock().expect("function cache poisoned");
        if let Some(f) = cache.get(&kernel) {
            return Ok(f.clone());
        }
        let f = self.module(kernel.family())?.load_function(&kernel.entry_name())?;
        // Kernels size their shared memory at launch; allow them what the device allows (the
        // default cap is 48 KiB).
        f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.max_shared_optin)?;
        cache.insert(kernel, f.clone());
        Ok(f)
    }

    /// Enqueues `kernel<<<grid, block, smem, stream>>>(params)`. No synchronisation.
    pub(crate) fn launch<P: Copy>(
        &self,
        stream: &CudaStream,
        kernel: KernelId,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: P,
    ) -> Result<()> {
        let f = self.function(kernel)?;
        let params = KernelParams(params);
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem };
        // SAFETY: every pointer in `params` was validated by the calling op against the length of
        // the buffer it came from, and `kernel` takes exactly this block.
        unsafe { stream.launch_builder(&f).arg(&params).launch(cfg)? };
        Ok(())
    }

    /// How many CTAs of `block` threads and `smem` bytes of dynamic shared memory of kernel
    /// `kernel` one SM holds at once (registers and shared memory), as the driver computes it.
    pub(crate) fn resident_ctas(&self, kernel: KernelId, block: u32, smem: u32) -> Result<u32> {
        let key = (kernel, smem);
        if let Some(&n) = self.occupancy.lock().expect("occupancy cache").get(&key) {
            return Ok(n);
        }
        let n = self.function(kernel)?.occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)?.max(1);
        self.occupancy.lock().expect("occupancy cache").insert(key, n);
        Ok(n)
    }

    /// Whether kernels that start with `pdl_prologue` (cache writes, attention tiles, the decode
    /// merge) are built with
    /// programmatic dependent launch here (the sm_90a module). `ATTN_DISABLE_PDL=1` turns it off.
    pub(crate) fn pdl_enabled(&self) -> bool {
        self.target.name == "sm_90a" && !std::env::var("ATTN_DISABLE_PDL").is_ok_and(|v| v == "1")
    }

    /// How many clusters of `cluster` CTAs (of `block` threads, `smem` bytes) of `kernel`
    /// the GPU holds at once, as the driver computes it: clusters must fit within one GPC, so a
    /// GPC whose SM count is not a multiple of the size leaves SMs idle (on the H100, clusters of
    /// 4 one-CTA-per-SM kernels fit fewer CTAs than 128).
    pub(crate) fn max_active_clusters(&self, kernel: KernelId, block: u32, smem: u32, cluster: u32) -> Result<u32> {
        let key = (kernel, smem, cluster);
        if let Some(&n) = self.clusters.lock().expect("cluster cache").get(&key) {
            return Ok(n);
        }
        use cudarc::driver::sys;
        let f = self.function(kernel)?;
        let mut attr = cluster_attribute(cluster);
        let config = sys::CUlaunchConfig {
            gridDimX: cluster,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: std::ptr::null_mut(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        self.ctx.bind_to_thread()?;
        // SAFETY: `config` and `attr` outlive the call, `n` is written by it.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config).result()? };
        let n = n.max(0) as u32;
        self.clusters.lock().expect("cluster cache").insert(key, n);
        Ok(n)
    }

    /// Whether thread-block clusters may be used: the sm_90a module (the sm_80 one runs on any
    /// GPU and has no cluster instructions).
    pub(crate) fn clusters_enabled(&self) -> bool {
        self.target.name == "sm_90a"
    }

    /// [`launch`](Self::launch) with programmatic dependent launch: the kernel may start while
    /// the previous work on the stream finishes; it must wait for it (`griddepcontrol.wait`)
    /// before reading anything, as `pdl_prologue` does.
    pub(crate) fn launch_pdl<P: Copy>(
        &self,
        stream: &CudaStream,
        kernel: KernelId,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: P,
    ) -> Result<()> {
        self.launch_ex(stream, kernel, grid, block, smem, 1, params)
    }

    /// [`launch_pdl`](Self::launch_pdl) in thread-block clusters of `cluster` CTAs along x
    /// (1 = none; the grid's x must be a multiple; only where [`clusters_enabled`](Self::clusters_enabled)).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_ex<P: Copy>(
        &self,
        stream: &CudaStream,
        kernel: KernelId,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        cluster: u32,
        params: P,
    ) -> Result<()> {
        let pdl = self.pdl_enabled();
        if !pdl && cluster <= 1 {
            return self.launch(stream, kernel, grid, block, smem, params);
        }
        debug_assert!(cluster <= 1 || (self.clusters_enabled() && grid.0.is_multiple_of(cluster)));
        use cudarc::driver::sys;
        let f = self.function(kernel)?;
        let mut params = KernelParams(params);
        // SAFETY: a zeroed attribute is a valid plain-data value; we set its id and value.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if pdl {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cluster > 1 {
            attrs[n] = cluster_attribute(cluster);
            n += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        let mut args = [&mut params as *mut KernelParams<P> as *mut std::ffi::c_void];
        self.ctx.bind_to_thread()?;
        // SAFETY: as for `launch`; `config`, `attrs` and `args` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()).result()? };
        Ok(())
    }
}

/// The launch attribute for thread-block clusters of `cluster` CTAs along x.
fn cluster_attribute(cluster: u32) -> cudarc::driver::sys::CUlaunchAttribute {
    use cudarc::driver::sys;
    // SAFETY: a zeroed attribute is a valid plain-data value; we set its id and value.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = cluster;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    attr
}

/// Whether the CUDA driver's shared library can be opened. cudarc's own probe exists only when it
/// loads the library itself (`dynamic-loading`); when another crate in the graph made it link
/// the library (`dynamic-linking`), the process would not have started without it, and opening
/// it again succeeds. Without the library, cudarc's first driver call would panic.
fn driver_library_present() -> bool {
    let names: &[&str] = if cfg!(windows) { &["nvcuda.dll"] } else { &["libcuda.so.1", "libcuda.so"] };
    // SAFETY: loading the driver library runs its initialisers, as cudarc's own loading does.
    names.iter().any(|name| unsafe { libloading::Library::new(*name) }.is_ok())
}
