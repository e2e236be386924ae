//! The read ceiling: how fast the GPU reads bytes it does not write back. Attention reads its
//! cache and writes a few outputs, so its bandwidth belongs beside a pure read, not beside a
//! copy (whose figure counts a read and a write, and which decode outruns: 101-103% of copy).
//!
//! The reading kernel is a measuring instrument like `cuMemcpyDtoD`, not part of the library,
//! so it lives here as a few lines of PTX the driver compiles at load: every thread reads
//! 16-byte words in a grid-stride loop, four loads in flight per iteration, and folds them with
//! XOR; the result is stored only if it equals a constant no input here produces, which keeps
//! the loads alive without a write stream. The ceiling is the best of a few grid sizes.

use crate::bench::{random_device, Bench, Row};
use attn_rs::Result;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

const READ_ALL_PTX: &str = r#"
.version 7.0
.target sm_80
.address_size 64

.visible .entry read_all(
    .param .u64 p_src,
    .param .u64 p_words,
    .param .u64 p_out
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<32>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_src];
    ld.param.u64 %rd2, [p_words];
    ld.param.u64 %rd3, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
    shl.b64 %rd7, %rd6, 2;
    mul.lo.u64 %rd8, %rd6, 3;
    shl.b64 %rd11, %rd6, 4;
    mov.b32 %r10, 0;
FOUR:
    add.u64 %rd9, %rd4, %rd8;
    setp.ge.u64 %p1, %rd9, %rd2;
    @%p1 bra ONE;
    shl.b64 %rd10, %rd4, 4;
    add.u64 %rd10, %rd1, %rd10;
    add.u64 %rd12, %rd10, %rd11;
    add.u64 %rd13, %rd12, %rd11;
    add.u64 %rd14, %rd13, %rd11;
    ld.global.nc.v4.u32 {%r11, %r12, %r13, %r14}, [%rd10];
    ld.global.nc.v4.u32 {%r15, %r16, %r17, %r18}, [%rd12];
    ld.global.nc.v4.u32 {%r19, %r20, %r21, %r22}, [%rd13];
    ld.global.nc.v4.u32 {%r23, %r24, %r25, %r26}, [%rd14];
    xor.b32 %r11, %r11, %r15;
    xor.b32 %r12, %r12, %r16;
    xor.b32 %r13, %r13, %r17;
    xor.b32 %r14, %r14, %r18;
    xor.b32 %r19, %r19, %r23;
    xor.b32 %r20, %r20, %r24;
    xor.b32 %r21, %r21, %r25;
    xor.b32 %r22, %r22, %r26;
    xor.b32 %r11, %r11, %r19;
    xor.b32 %r12, %r12, %r20;
    xor.b32 %r13, %r13, %r21;
    xor.b32 %r14, %r14, %r22;
    xor.b32 %r11, %r11, %r12;
    xor.b32 %r13, %r13, %r14;
    xor.b32 %r10, %r10, %r11;
    xor.b32 %r10, %r10, %r13;
    add.u64 %rd4, %rd4, %rd7;
    bra FOUR;
ONE:
    setp.ge.u64 %p2, %rd4, %rd2;
    @%p2 bra DONE;
    shl.b64 %rd10, %rd4, 4;
    add.u64 %rd10, %rd1, %rd10;
    ld.global.nc.v4.u32 {%r11, %r12, %r13, %r14}, [%rd10];
    xor.b32 %r11, %r11, %r12;
    xor.b32 %r13, %r13, %r14;
    xor.b32 %r10, %r10, %r11;
    xor.b32 %r10, %r10, %r13;
    add.u64 %rd4, %rd4, %rd6;
    bra ONE;
DONE:
    setp.ne.u32 %p3, %r10, 1;
    @%p3 bra END;
    st.global.u32 [%rd3], %r10;
END:
    ret;
}
"#;

/// Threads per CTA of the reading kernel.
const THREADS: u32 = 512;

/// Reads `bytes` (a multiple of 16) of random words with the reading kernel at 1, 2 and 4 CTAs
/// of 512 threads per SM, and gives the fastest as the read ceiling (bytes read only).
pub fn read_row(b: &Bench, sm_count: u32, bytes: usize) -> Result<Row> {
    let ctx = b.stream.context();
    let module = ctx.load_module(Ptx::from_src(READ_ALL_PTX))?;
    let read_all = module.load_function("read_all")?;
    let src: CudaSlice<f32> = random_device(&b.stream, bytes / 4, 11)?;
    let mut out: CudaSlice<u32> = b.stream.alloc_zeros(1)?;
    let words = (bytes / 16) as u64;
    let mut best = f64::INFINITY;
    for ctas_per_sm in [1, 2, 4] {
        let cfg = LaunchConfig { grid_dim: (sm_count * ctas_per_sm, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let us = b.time(|| {
            let mut launch = b.stream.launch_builder(&read_all);
            launch.arg(&src).arg(&words).arg(&mut out);
            // SAFETY: the kernel reads `words` 16-byte words of `src` (`bytes` long)
            // and writes at most `out`'s one word; the arguments match its parameter list.
            unsafe { launch.launch(cfg) }?;
            Ok(())
        })?;
        best = best.min(us);
    }
    Ok(Row {
        name: "read ceiling (XOR of every word)".into(),
        shape: format!("{} MiB", bytes >> 20),
        median_us: best,
        bytes: bytes as f64,
        flops: 0.0,
    })
}
