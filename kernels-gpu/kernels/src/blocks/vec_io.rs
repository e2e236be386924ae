//! 16-, 8- and 4-byte global loads and stores, and the small scalar loads the kernels need.
//! Loads of inputs that the kernel never writes use the non-coherent (read-only) path.

use core::arch::asm;

/// 16 bytes from global memory through the read-only path. `addr` must be 16-byte aligned.
#[inline(always)]
pub unsafe fn load16_nc(addr: u64) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.global.nc.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) addr,
             options(pure, readonly, nostack));
    }
    [a, b, c, d]
}

/// 16 bytes from global memory written by an earlier kernel (coherent path).
#[inline(always)]
pub unsafe fn load16(addr: u64) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.global.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) addr,
             options(readonly, nostack));
    }
    [a, b, c, d]
}

#[inline(always)]
pub unsafe fn store16(addr: u64, v: [u32; 4]) {
    unsafe {
        asm!("st.global.v4.u32 [{0}], {{{1}, {2}, {3}, {4}}};",
             in(reg64) addr, in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3],
             options(nostack));
    }
}

#[inline(always)]
pub unsafe fn store8(addr: u64, v: [u32; 2]) {
    unsafe {
        asm!("st.global.v2.u32 [{0}], {{{1}, {2}}};", in(reg64) addr, in(reg32) v[0], in(reg32) v[1],
             options(nostack));
    }
}

#[inline(always)]
pub unsafe fn store4(addr: u64, v: u32) {
    unsafe { asm!("st.global.u32 [{0}], {1};", in(reg64) addr, in(reg32) v, options(nostack)) }
}

#[inline(always)]
pub unsafe fn load_i64_nc(addr: u64) -> i64 {
    let r: i64;
    unsafe { asm!("ld.global.nc.s64 {0}, [{1}];", out(reg64) r, in(reg64) addr, options(pure, readonly, nostack)) };
    r
}

#[inline(always)]
pub unsafe fn load_f32_nc(addr: u64) -> f32 {
    let r: f32;
    unsafe { asm!("ld.global.nc.f32 {0}, [{1}];", out(reg32) r, in(reg64) addr, options(pure, readonly, nostack)) };
    r
}

/// The two halves of a packed f16x2 word as f32.
#[inline(always)]
pub fn f16x2_to_f32(w: u32) -> (f32, f32) {
    let (lo, hi): (f32, f32);
    unsafe {
        asm!("{{ .reg .b16 l, h; mov.b32 {{l, h}}, {2}; cvt.f32.f16 {0}, l; cvt.f32.f16 {1}, h; }}",
             out(reg32) lo, out(reg32) hi, in(reg32) w, options(pure, nomem, nostack));
    }
    (lo, hi)
}

/// The two halves of a packed bf16x2 word as f32 (exact: bf16 is the top half of an f32).
#[inline(always)]
pub fn bf16x2_to_f32(w: u32) -> (f32, f32) {
    (f32::from_bits(w << 16), f32::from_bits(w & 0xffff_0000))
}

/// `lo` and `hi` converted to FP8 E4M3 (round to nearest even, saturating), packed as
/// `lo | hi << 8`. sm_89 and newer.
#[cfg(hw_fp8)]
#[inline(always)]
pub fn e4m3x2(lo: f32, hi: f32) -> u32 {
    let packed: u16;
    unsafe {
        asm!("cvt.rn.satfinite.e4m3x2.f32 {0}, {1}, {2};", out(reg16) packed, in(reg32) hi, in(reg32) lo,
             options(pure, nomem, nostack));
    }
    packed as u32
}

/// 8 bytes from global memory through the read-only path (8-byte aligned).
#[inline(always)]
pub unsafe fn load8_nc(addr: u64) -> [u32; 2] {
    let (a, b): (u32, u32);
    unsafe {
        asm!("ld.global.nc.v2.u32 {{{0}, {1}}}, [{2}];", out(reg32) a, out(reg32) b, in(reg64) addr,
             options(pure, readonly, nostack));
    }
    [a, b]
}

#[inline(always)]
pub unsafe fn load_u32_nc(addr: u64) -> u32 {
    let r: u32;
    unsafe { asm!("ld.global.nc.u32 {0}, [{1}];", out(reg32) r, in(reg64) addr, options(pure, readonly, nostack)) };
    r
}

/// A plain (coherent) f32 load, for data an earlier kernel of the same stream wrote.
#[inline(always)]
pub unsafe fn load_f32(addr: u64) -> f32 {
    let r: f32;
    unsafe { asm!("ld.global.f32 {0}, [{1}];", out(reg32) r, in(reg64) addr, options(readonly, nostack)) };
    r
}

#[inline(always)]
pub unsafe fn store_f32(addr: u64, v: f32) {
    unsafe { asm!("st.global.f32 [{0}], {1};", in(reg64) addr, in(reg32) v, options(nostack)) }
}

#[inline(always)]
pub unsafe fn store_u16(addr: u64, v: u16) {
    unsafe { asm!("st.global.u16 [{0}], {1};", in(reg64) addr, in(reg16) v, options(nostack)) }
}

/// f32 -> f16 bits (round to nearest even).
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    let h: u16;
    unsafe { asm!("cvt.rn.f16.f32 {0}, {1};", out(reg16) h, in(reg32) x, options(pure, nomem, nostack)) };
    h
}

/// 16 bytes through L2 only (`.cg`): data another SM wrote during this kernel, after an acquire.
#[inline(always)]
pub unsafe fn load16_cg(addr: u64) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.global.cg.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];",
            out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) addr, options(readonly, nostack));
    }
    [a, b, c, d]
}

/// An f32 through L2 only (`.cg`): data another SM wrote during this kernel, after an acquire.
#[inline(always)]
pub unsafe fn load_f32_cg(addr: u64) -> f32 {
    let r: f32;
    unsafe { asm!("ld.global.cg.f32 {0}, [{1}];", out(reg32) r, in(reg64) addr, options(readonly, nostack)) };
    r
}
