//! Tensor-core and asynchronous-copy primitives (sm_80+): `mma.sync` m16n8k16 with f32
//! accumulators, `ldmatrix` from shared memory, and `cp.async` from global to shared memory.
//!
//! Fragment layouts of m16n8k16 (lane = 4 * g + t): A (16x16, row-major) a0 = (row g, cols
//! 2t, 2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..); B (16x8) b0 =
//! (k 2t, 2t+1; n g), b1 = (k 2t + 8..; n g); C (16x8) c0, c1 = (row g; cols 2t, 2t+1), c2, c3 =
//! (row g + 8; same cols). Each register holds two 16-bit values, the lower column in the low half.

use crate::blocks::device::static_for;
use crate::blocks::elem::{Bf16, Fp8Format, HalfFloat, F16};
use crate::blocks::vec_io::f16x2_to_f32;
use core::arch::asm;

/// A 16-bit float type the tensor cores take.
pub trait MmaHalf: HalfFloat {
    /// `c + a * b` (m16n8k16, f32 accumulate).
    fn mma(a: [u32; 4], b0: u32, b1: u32, c: [f32; 4]) -> [f32; 4];
    /// Two f32 rounded into one register: `lo` in the low half.
    fn pack2(lo: f32, hi: f32) -> u32;
    const IS_BF16: bool;
    /// Two bytes of FP8 format `F` (low byte first) as two values of this type (exact, divided
    /// by `F::UNPACK_SCALE`).
    fn from_fp8x2<F: Fp8Format>(pair: u32) -> u32;
    /// [`from_fp8x2`](Self::from_fp8x2) of bytes 0-1 and 2-3 of `quad`.
    fn from_fp8x4<F: Fp8Format>(quad: u32) -> [u32; 2];
    /// `S = A B^T` for a warpgroup (Hopper `wgmma`, m64n64k16, f32 accumulate): A 64 x 576 and B
    /// 64 x 576 (a whole 64-row tile), both in shared memory in the 128-byte-swizzled K-major
    /// layout (`attn_math::mla::swizzled`), given by the descriptors of their first k-step.
    /// Committed, not waited for (`crate::blocks::wgmma::wait_scores64` retires it). This
    /// thread's part of S in the `mma.sync` C layout of its warp's 16 rows: `[n-block][4]`.
    #[cfg(wgmma)]
    unsafe fn wgmma_64x64_k576_async(desc_a: u64, desc_b: u64) -> [[f32; 4]; 8];
    /// [`wgmma_64x64_k576_async`](Self::wgmma_64x64_k576_async) over a tile that is still
    /// landing: the executing threads' last nine `cp.async` groups are its nine 64-column atoms in
    /// order, and each three atoms' k-steps wait for them (this thread's copies, then barrier
    /// `BAR` of the warpgroup's 128 threads).
    #[cfg(wgmma)]
    unsafe fn wgmma_64x64_k576_landing_async<const BAR: u32>(desc_a: u64, desc_b: u64) -> [[f32; 4]; 8];
    /// `O += P V` for a warpgroup (Hopper `wgmma`): P 64 x 64 keys (`desc_a`, K-major, in one
    /// 128-byte-swizzled atom a row) times V 64 keys x 256
    /// columns, keys 0-31 and 32-63 in two slots (the 128-byte-swizzled rows read N-major,
    /// `desc_b0`, `desc_b1`). `o`: this thread's accumulators, column block `n` (8 columns) of its
    /// warp's 16 rows in the `mma.sync` C layout. Committed, not waited for
    /// (`crate::blocks::wgmma::wait_acc256` retires it).
    #[cfg(wgmma)]
    unsafe fn wgmma_pv_64x256_k64_async(o: &mut [[f32; 4]; 32], desc_a: u64, desc_b0: u64, desc_b1: u64);
}

/// The whole 576-wide `wgmma` chain of [`MmaHalf::wgmma_64x64_k576_async`] for PTX type `$t`: the
/// first k-step overwrites the accumulators (scale-d false), the rest add. Descriptors advance 32
/// bytes a k-step inside a 128-byte swizzle atom (4 k-steps) and 1024 - 96 bytes to the next atom
/// (units of 16 bytes: 2 and 58). They are rebuilt from 32-bit halves each k-step, so that
/// stepping them is a 32-bit add (the address field is in the low word and never carries out of
/// it); a 64-bit add cost an add with carry and two `R2UR`s a k-step.
#[cfg(wgmma)]
macro_rules! wgmma_k576_asm {
    // `$n` keys (the N of the instruction), `$acc` the accumulator operands, `$da` / `$db` the
    // descriptors'.
    ($t:literal, $n:literal, $acc:literal, $da:literal, $db:literal) => {
        concat!(
            "{{\n.reg .pred pz, po;\n.reg .b32 zz, al, ah, bl, bh;\n.reg .b64 da, db;\n",
            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 {{al, ah}}, ", $da, ";\nmov.b64 {{bl, bh}}, ", $db, ";\n",
            "wgmma.fence.sync.aligned;\n",
            wgmma_k576_asm!(@mma $t, $n, $acc, "pz"),
            wgmma_k576_asm!(@atom_rest $t, $n, $acc),
            times8!(concat!("add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n", wgmma_k576_asm!(@mma $t, $n, $acc, "po"), wgmma_k576_asm!(@atom_rest $t, $n, $acc))),
            "wgmma.commit_group.sync.aligned;\n}}"
        )
    };
    // The same chain over a tile still landing, one `cp.async` group an atom (the executing
    // threads' last nine, in atom order): before the k-steps of atoms 3c to 3c + 2, wait until
    // they have landed in this thread (`cp.async.wait_group 6 - 3c`), make them visible to
    // `wgmma`, and meet the warpgroup's other threads at barrier `{bar}` (128 threads), so that
    // the MMAs on the first atoms run while the later ones land. Three meetings a tile measured
    // 1.005-1.012x nine (one before each atom) at 128 heads (docs/mla.md).
    (landing $t:literal, $n:literal, $acc:literal, $da:literal, $db:literal) => {
        concat!(
            "{{\n.reg .pred pz, po;\n.reg .b32 zz, al, ah, bl, bh;\n.reg .b64 da, db;\n",
            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 {{al, ah}}, ", $da, ";\nmov.b64 {{bl, bh}}, ", $db, ";\n",
            wgmma_k576_asm!(@landed "6"),
            "wgmma.fence.sync.aligned;\n",
            wgmma_k576_asm!(@mma $t, $n, $acc, "pz"),
            wgmma_k576_asm!(@atom_rest $t, $n, $acc),
            wgmma_k576_asm!(@next_atom_landed $t, $n, $acc),
            wgmma_k576_asm!(@next_atom_landed $t, $n, $acc),
            wgmma_k576_asm!(@next_atom $t, $n, $acc, "3"),
            wgmma_k576_asm!(@next_atom_landed $t, $n, $acc),
            wgmma_k576_asm!(@next_atom_landed $t, $n, $acc),
            wgmma_k576_asm!(@next_atom $t, $n, $acc, "0"),
            wgmma_k576_asm!(@next_atom_landed $t, $n, $acc),
            wgmma_k576_asm!(@next_atom_landed $t, $n, $acc),
            "wgmma.commit_group.sync.aligned;\n}}"
        )
    };
    (@landed $pending:literal) => {
        concat!("cp.async.wait_group ", $pending, ";\nfence.proxy.async.shared::cta;\nbar.sync {bar}, 128;\n")
    };
    (@next_atom $t:literal, $n:literal, $acc:literal, $pending:literal) => {
        concat!(
            "add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n",
            wgmma_k576_asm!(@landed $pending),
            wgmma_k576_asm!(@mma $t, $n, $acc, "po"),
            wgmma_k576_asm!(@atom_rest $t, $n, $acc)
        )
    };
    // The next atom, landed with the one before.
    (@next_atom_landed $t:literal, $n:literal, $acc:literal) => {
        concat!("add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n", wgmma_k576_asm!(@mma $t, $n, $acc, "po"), wgmma_k576_asm!(@atom_rest $t, $n, $acc))
    };
    (@mma $t:literal, $n:literal, $acc:literal, $scale:literal) => {
        concat!(
            "mov.b64 da, {{al, ah}};\nmov.b64 db, {{bl, bh}};\n",
            "wgmma.mma_async.sync.aligned.m64n", $n, "k16.f32.", $t, ".", $t, " {{", $acc, "}}, da, db, ", $scale, ", 1, 1, 0, 0;\n"
        )
    };
    (@atom_rest $t:literal, $n:literal, $acc:literal) => {
        concat!(
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n", wgmma_k576_asm!(@mma $t, $n, $acc, "po"),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n", wgmma_k576_asm!(@mma $t, $n, $acc, "po"),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n", wgmma_k576_asm!(@mma $t, $n, $acc, "po")
        )
    };
}

/// The P V `wgmma` chain of [`MmaHalf::wgmma_pv_64x256_k64_async`] for PTX type `$t`: four k-steps of
/// 16 keys over all the warpgroup's 256 columns (m64n256k16: B's four 64-column atoms are
/// `leading` = 1024 bytes apart, so one instruction reads P's k-step once, where four m64n64k16
/// read it four times). A steps 2 units of 16 bytes a k-step (32 bytes inside P's 128-byte-swizzled
/// atom); B +1152 units (two 8-key row groups) within a slot, the second slot for keys 32-63.
/// B is V, N-major (`imm-trans-b` 1); the accumulators add (scale-d true). Descriptors step as
/// in [`wgmma_k576_asm`], by 32-bit adds.
#[cfg(wgmma)]
macro_rules! wgmma_pv_asm {
    ($t:literal) => {
        concat!(
            "{{\n.reg .pred po;\n.reg .b32 zz, al, ah, bl, bh, cl, ch;\n.reg .b64 da, db;\n",
            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 {{al, ah}}, {128};\nmov.b64 {{bl, bh}}, {129};\nmov.b64 {{cl, ch}}, {130};\n",
            "wgmma.fence.sync.aligned;\n",
            "mov.b64 da, {{al, ah}};\nmov.b64 db, {{bl, bh}};\n", wgmma_pv_asm!(@mma $t),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 1152;\n",
            "mov.b64 da, {{al, ah}};\nmov.b64 db, {{bl, bh}};\n", wgmma_pv_asm!(@mma $t),
            "add.s32 al, al, 2;\n",
            "mov.b64 da, {{al, ah}};\nmov.b64 db, {{cl, ch}};\n", wgmma_pv_asm!(@mma $t),
            "add.s32 al, al, 2;\nadd.s32 cl, cl, 1152;\n",
            "mov.b64 da, {{al, ah}};\nmov.b64 db, {{cl, ch}};\n", wgmma_pv_asm!(@mma $t),
            "wgmma.commit_group.sync.aligned;\n}}"
        )
    };
    (@mma $t:literal) => {
        concat!(
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.", $t, ".", $t,
            " {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}, {96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}, {112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}}}, da, db, po, 1, 1, 0, 1;\n"
        )
    };
}

/// `asm!` of a 64-key S chain (`$tmpl`: [`wgmma_k576_asm`] over 64 keys) into the
/// accumulators `$d` (`[[f32; 4]; 8]`), from the descriptors `$a` and `$b`, with the operands
/// `$extra` (each followed by a comma) after them.
#[cfg(wgmma)]
macro_rules! scores64_asm {
    ($tmpl:expr, $d:ident, $a:ident, $b:ident; $($extra:tt)*) => {
        asm!($tmpl,
                         out(reg32) $d[0][0], out(reg32) $d[0][1], out(reg32) $d[0][2], out(reg32) $d[0][3],
                         out(reg32) $d[1][0], out(reg32) $d[1][1], out(reg32) $d[1][2], out(reg32) $d[1][3],
                         out(reg32) $d[2][0], out(reg32) $d[2][1], out(reg32) $d[2][2], out(reg32) $d[2][3],
                         out(reg32) $d[3][0], out(reg32) $d[3][1], out(reg32) $d[3][2], out(reg32) $d[3][3],
                         out(reg32) $d[4][0], out(reg32) $d[4][1], out(reg32) $d[4][2], out(reg32) $d[4][3],
                         out(reg32) $d[5][0], out(reg32) $d[5][1], out(reg32) $d[5][2], out(reg32) $d[5][3],
                         out(reg32) $d[6][0], out(reg32) $d[6][1], out(reg32) $d[6][2], out(reg32) $d[6][3],
                         out(reg32) $d[7][0], out(reg32) $d[7][1], out(reg32) $d[7][2], out(reg32) $d[7][3],
                         in(reg64) $a, in(reg64) $b, $($extra)* options(nostack))
    };
}

/// `$body` 8 times, as one string.
#[cfg(wgmma)]
macro_rules! times8 {
    ($body:expr) => {
        concat!($body, $body, $body, $body, $body, $body, $body, $body)
    };
}

/// A `wgmma` shared-memory descriptor: start address, leading and stride byte offsets, and
/// 128-byte swizzling or none. K-major without swizzle: leading = between core matrices along K,
/// stride = between 8-row groups along M/N. K-major, 128-byte swizzle: leading unused (16),
/// stride = between 8-row groups (atoms 1024-byte aligned; the start may point inside one, at a
/// k-step). N-major, 128-byte swizzle: leading = between 64-element blocks along N, stride =
/// between 8-row groups along K.
#[cfg(wgmma)]
#[inline(always)]
pub const fn wgmma_desc(addr: u32, leading: u32, stride: u32, swizzle_128: bool) -> u64 {
    ((addr as u64 & 0x3ffff) >> 4) | (((leading >> 4) as u64) << 16) | (((stride >> 4) as u64) << 32) | ((swizzle_128 as u64) << 62)
}

/// Makes this thread's completed generic-proxy writes to shared memory (`cp.async`, stores)
/// visible to the async proxy (`wgmma` operand reads); a barrier must follow for other threads.
#[cfg(wgmma)]
#[inline(always)]
pub fn fence_proxy_async_shared() {
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) }
}

macro_rules! mma_impl {
    ($ty:ty, $name:literal) => {
        impl MmaHalf for $ty {
            const IS_BF16: bool = matches!($name.as_bytes(), b"bf16");
            #[inline(always)]
            fn mma(a: [u32; 4], b0: u32, b1: u32, c: [f32; 4]) -> [f32; 4] {
                let d: [f32; 4];
                let (d0, d1, d2, d3): (f32, f32, f32, f32);
                unsafe {
                    asm!(concat!("mma.sync.aligned.m16n8k16.row.col.f32.", $name, ".", $name, ".f32 ",
                                 "{{{0}, {1}, {2}, {3}}}, {{{4}, {5}, {6}, {7}}}, {{{8}, {9}}}, {{{10}, {11}, {12}, {13}}};"),
                         out(reg32) d0, out(reg32) d1, out(reg32) d2, out(reg32) d3,
                         in(reg32) a[0], in(reg32) a[1], in(reg32) a[2], in(reg32) a[3], in(reg32) b0, in(reg32) b1,
                         in(reg32) c[0], in(reg32) c[1], in(reg32) c[2], in(reg32) c[3],
                         options(pure, nomem, nostack));
                }
                d = [d0, d1, d2, d3];
                d
            }
            #[inline(always)]
            fn from_fp8x2<F: Fp8Format>(pair: u32) -> u32 {
                <$ty as FromFp8>::convert::<F>(pair)
            }
            #[inline(always)]
            fn from_fp8x4<F: Fp8Format>(quad: u32) -> [u32; 2] {
                <$ty as FromFp8>::convert4::<F>(quad)
            }
            #[cfg(wgmma)]
            #[inline(always)]
            unsafe fn wgmma_pv_64x256_k64_async(o: &mut [[f32; 4]; 32], desc_a: u64, desc_b0: u64, desc_b1: u64) {
                unsafe {
                    asm!(wgmma_pv_asm!($name),
                         inout(reg32) o[0][0], inout(reg32) o[0][1], inout(reg32) o[0][2], inout(reg32) o[0][3],
                         inout(reg32) o[1][0], inout(reg32) o[1][1], inout(reg32) o[1][2], inout(reg32) o[1][3],
                         inout(reg32) o[2][0], inout(reg32) o[2][1], inout(reg32) o[2][2], inout(reg32) o[2][3],
                         inout(reg32) o[3][0], inout(reg32) o[3][1], inout(reg32) o[3][2], inout(reg32) o[3][3],
                         inout(reg32) o[4][0], inout(reg32) o[4][1], inout(reg32) o[4][2], inout(reg32) o[4][3],
                         inout(reg32) o[5][0], inout(reg32) o[5][1], inout(reg32) o[5][2], inout(reg32) o[5][3],
                         inout(reg32) o[6][0], inout(reg32) o[6][1], inout(reg32) o[6][2], inout(reg32) o[6][3],
                         inout(reg32) o[7][0], inout(reg32) o[7][1], inout(reg32) o[7][2], inout(reg32) o[7][3],
                         inout(reg32) o[8][0], inout(reg32) o[8][1], inout(reg32) o[8][2], inout(reg32) o[8][3],
                         inout(reg32) o[9][0], inout(reg32) o[9][1], inout(reg32) o[9][2], inout(reg32) o[9][3],
                         inout(reg32) o[10][0], inout(reg32) o[10][1], inout(reg32) o[10][2], inout(reg32) o[10][3],
                         inout(reg32) o[11][0], inout(reg32) o[11][1], inout(reg32) o[11][2], inout(reg32) o[11][3],
                         inout(reg32) o[12][0], inout(reg32) o[12][1], inout(reg32) o[12][2], inout(reg32) o[12][3],
                         inout(reg32) o[13][0], inout(reg32) o[13][1], inout(reg32) o[13][2], inout(reg32) o[13][3],
                         inout(reg32) o[14][0], inout(reg32) o[14][1], inout(reg32) o[14][2], inout(reg32) o[14][3],
                         inout(reg32) o[15][0], inout(reg32) o[15][1], inout(reg32) o[15][2], inout(reg32) o[15][3],
                         inout(reg32) o[16][0], inout(reg32) o[16][1], inout(reg32) o[16][2], inout(reg32) o[16][3],
                         inout(reg32) o[17][0], inout(reg32) o[17][1], inout(reg32) o[17][2], inout(reg32) o[17][3],
                         inout(reg32) o[18][0], inout(reg32) o[18][1], inout(reg32) o[18][2], inout(reg32) o[18][3],
                         inout(reg32) o[19][0], inout(reg32) o[19][1], inout(reg32) o[19][2], inout(reg32) o[19][3],
                         inout(reg32) o[20][0], inout(reg32) o[20][1], inout(reg32) o[20][2], inout(reg32) o[20][3],
                         inout(reg32) o[21][0], inout(reg32) o[21][1], inout(reg32) o[21][2], inout(reg32) o[21][3],
                         inout(reg32) o[22][0], inout(reg32) o[22][1], inout(reg32) o[22][2], inout(reg32) o[22][3],
                         inout(reg32) o[23][0], inout(reg32) o[23][1], inout(reg32) o[23][2], inout(reg32) o[23][3],
                         inout(reg32) o[24][0], inout(reg32) o[24][1], inout(reg32) o[24][2], inout(reg32) o[24][3],
                         inout(reg32) o[25][0], inout(reg32) o[25][1], inout(reg32) o[25][2], inout(reg32) o[25][3],
                         inout(reg32) o[26][0], inout(reg32) o[26][1], inout(reg32) o[26][2], inout(reg32) o[26][3],
                         inout(reg32) o[27][0], inout(reg32) o[27][1], inout(reg32) o[27][2], inout(reg32) o[27][3],
                         inout(reg32) o[28][0], inout(reg32) o[28][1], inout(reg32) o[28][2], inout(reg32) o[28][3],
                         inout(reg32) o[29][0], inout(reg32) o[29][1], inout(reg32) o[29][2], inout(reg32) o[29][3],
                         inout(reg32) o[30][0], inout(reg32) o[30][1], inout(reg32) o[30][2], inout(reg32) o[30][3],
                         inout(reg32) o[31][0], inout(reg32) o[31][1], inout(reg32) o[31][2], inout(reg32) o[31][3],
                         in(reg64) desc_a, in(reg64) desc_b0, in(reg64) desc_b1, options(nostack));
                }
            }
            #[cfg(wgmma)]
            #[inline(always)]
            unsafe fn wgmma_64x64_k576_async(desc_a: u64, desc_b: u64) -> [[f32; 4]; 8] {
                let mut d = [[0.0f32; 4]; 8];
                unsafe { scores64_asm!(wgmma_k576_asm!($name, "64", "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}", "{32}", "{33}"), d, desc_a, desc_b;) };
                d
            }
            #[cfg(wgmma)]
            #[inline(always)]
            unsafe fn wgmma_64x64_k576_landing_async<const BAR: u32>(desc_a: u64, desc_b: u64) -> [[f32; 4]; 8] {
                let mut d = [[0.0f32; 4]; 8];
                unsafe { scores64_asm!(wgmma_k576_asm!(landing $name, "64", "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}", "{32}", "{33}"), d, desc_a, desc_b; bar = const BAR,) };
                d
            }
            #[inline(always)]
            fn pack2(lo: f32, hi: f32) -> u32 {
                let r: u32;
                // cvt.rn.<t>x2.f32 d, a, b puts a in the upper half.
                unsafe { asm!(concat!("cvt.rn.", $name, "x2.f32 {0}, {1}, {2};"), out(reg32) r, in(reg32) hi, in(reg32) lo, options(pure, nomem, nostack)) };
                r
            }
        }
    };
}

mma_impl!(F16, "f16");
mma_impl!(Bf16, "bf16");

/// FP8 pairs to a 16-bit type, per type.
pub trait FromFp8 {
    fn convert<F: Fp8Format>(pair: u32) -> u32;
    #[inline(always)]
    fn convert4<F: Fp8Format>(quad: u32) -> [u32; 2] {
        [Self::convert::<F>(quad & 0xffff), Self::convert::<F>(quad >> 16)]
    }
}

impl FromFp8 for F16 {
    #[inline(always)]
    fn convert<F: Fp8Format>(pair: u32) -> u32 {
        F::to_f16x2(pair)
    }
    #[inline(always)]
    fn convert4<F: Fp8Format>(quad: u32) -> [u32; 2] {
        F::to_f16x4(quad)
    }
}

/// An f16 pair as a bf16 pair, through f32: every E4M3 and E5M2 value (over the unpack scale) is
/// exact in all three.
#[inline(always)]
fn bf16x2_of_f16x2(h: u32) -> u32 {
    let (lo, hi) = f16x2_to_f32(h);
    Bf16::pack2(lo, hi)
}

impl FromFp8 for Bf16 {
    #[inline(always)]
    fn convert<F: Fp8Format>(pair: u32) -> u32 {
        bf16x2_of_f16x2(F::to_f16x2(pair))
    }
    #[inline(always)]
    fn convert4<F: Fp8Format>(quad: u32) -> [u32; 2] {
        F::to_f16x4(quad).map(bf16x2_of_f16x2)
    }
}

/// The shared-memory (state space) address of a generic pointer into shared memory.
#[inline(always)]
pub fn shared_addr<T>(p: *const T) -> u32 {
    let a: u64;
    unsafe { asm!("cvta.to.shared.u64 {0}, {1};", out(reg64) a, in(reg64) p as u64, options(pure, nomem, nostack)) };
    a as u32
}

/// Four 8x8 matrices of 16-bit values; lanes 8i..8i+7 give the row addresses of matrix i, and
/// lane 4g + t receives (row g, cols 2t, 2t+1) of each.
#[inline(always)]
pub unsafe fn ldmatrix_x4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg32) addr, options(readonly, nostack));
    }
    [a, b, c, d]
}

/// [`ldmatrix_x4`] as an operation with side effects: the compiler keeps it where it is (a
/// `readonly` load before a loop may be sunk into the loop, re-reading what registers were meant
/// to hold).
#[inline(always)]
pub unsafe fn ldmatrix_x4_pinned(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg32) addr, options(nostack));
    }
    [a, b, c, d]
}

/// [`ldmatrix_x4`] transposed: lane 4g + t receives (rows 2t, 2t+1; col g) of each matrix.
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg32) addr, options(readonly, nostack));
    }
    [a, b, c, d]
}

/// `movmatrix.trans`: the 8x8 matrix of 16-bit values whose fragment (lane 4g + t: row g, cols
/// 2t, 2t+1) is `x`, transposed: lane 4g + t receives (row 2t and 2t + 1, col g) of `x`'s matrix.
/// One instruction where the PTX ISA has it (8.0 on the sm_90 targets, which are the ones built
/// with `pdl`); two shuffles and a byte permute on sm_80's ISA 7.0.
#[inline(always)]
pub fn movmatrix_trans(x: u32) -> u32 {
    #[cfg(pdl)]
    {
        let y: u32;
        unsafe { asm!("movmatrix.sync.aligned.m8n8.trans.b16 {0}, {1};", out(reg32) y, in(reg32) x, options(nomem, nostack)) };
        y
    }
    #[cfg(not(pdl))]
    {
        // (row 2t, col g) sits in lane 4 * 2t + g / 2, half g % 2; row 2t + 1 four lanes on.
        let lane = crate::blocks::device::thread_idx_x() % 32;
        let (g, t) = (lane / 4, lane % 4);
        let a = crate::blocks::device::shfl_idx(x, 8 * t + g / 2);
        let b = crate::blocks::device::shfl_idx(x, 8 * t + 4 + g / 2);
        byte_perm(a, b, if g % 2 == 0 { 0x5410 } else { 0x7632 })
    }
}

/// Copies 16 bytes from global `src` (16-byte aligned) to shared `dst` asynchronously; only the
/// first `src_bytes` (0 or 16; 8 from [`cp_async_halves_or_whole`]) are read, the rest is
/// zero-filled. Bypasses L1 (`.cg`).
///
/// Where the PTX has it, the copy asks L2 to fetch the whole 128-byte line from DRAM
/// (`.L2::128B`): the rows a CTA streams are 128-512 contiguous bytes, and decode measured
/// +1.5-2% of the copy ceiling on the H100 with it (64 x 4096: 92.3 -> 94.0%; `.L2::256B` the same).
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: u64, src_bytes: u32) {
    #[cfg(l2_prefetch)]
    unsafe {
        asm!("cp.async.cg.shared.global.L2::128B [{0}], [{1}], 16, {2};", in(reg32) dst, in(reg64) src, in(reg32) src_bytes, options(nostack))
    }
    #[cfg(not(l2_prefetch))]
    unsafe {
        asm!("cp.async.cg.shared.global [{0}], [{1}], 16, {2};", in(reg32) dst, in(reg64) src, in(reg32) src_bytes, options(nostack))
    }
}

/// Copies 8 bytes from global `src` (8-byte aligned) to shared `dst` asynchronously; only the
/// first `src_bytes` (0 or 8) are read, the rest is zero-filled. Through L1 (`.ca`: the 8-byte
/// form has no `.cg`), asking L2 for the whole line as [`cp_async_16`] does.
#[inline(always)]
pub unsafe fn cp_async_8(dst: u32, src: u64, src_bytes: u32) {
    #[cfg(l2_prefetch)]
    unsafe {
        asm!("cp.async.ca.shared.global.L2::128B [{0}], [{1}], 8, {2};", in(reg32) dst, in(reg64) src, in(reg32) src_bytes, options(nostack))
    }
    #[cfg(not(l2_prefetch))]
    unsafe {
        asm!("cp.async.ca.shared.global [{0}], [{1}], 8, {2};", in(reg32) dst, in(reg64) src, in(reg32) src_bytes, options(nostack))
    }
}

/// Chunk `c` (16 bytes at `row + 16 c`) of a row that may start only 8-byte aligned, as two
/// 8-byte copies to shared `dst`: of the row's first `live_halves` 8-byte halves each is read,
/// the rest zero-filled (`row` 0: the whole chunk, naming `fallback`, which is not read).
#[inline(always)]
pub unsafe fn cp_async_halves(dst: u32, row: u64, c: u32, live_halves: u32, fallback: u64) {
    static_for::<2>(|h| {
        let read = row != 0 && 2 * c + (h as u32) < live_halves;
        let src = if read { row + 16 * c as u64 + 8 * h as u64 } else { fallback };
        unsafe { cp_async_8(dst + 8 * h as u32, src, if read { 8 } else { 0 }) };
    });
}

/// [`cp_async_halves`], but a row that starts 16-byte aligned after all (in NHD every other kv
/// head's) takes one 16-byte copy (`fallback` 16-byte aligned). Chosen row by row, it made the
/// Hopper e4m3 prefill's producer 1.3x faster and the keys-as-rows decode 9% slower
/// (docs/head-sizes.md), so only the former takes it.
#[inline(always)]
pub unsafe fn cp_async_halves_or_whole(dst: u32, row: u64, c: u32, live_halves: u32, fallback: u64) {
    if row.is_multiple_of(16) {
        let halves = live_halves.saturating_sub(2 * c).min(2);
        let read = row != 0 && halves > 0;
        unsafe { cp_async_16(dst, if read { row + 16 * c as u64 } else { fallback }, if read { 8 * halves } else { 0 }) };
    } else {
        unsafe { cp_async_halves(dst, row, c, live_halves, fallback) };
    }
}

/// Closes the group of `cp.async`s issued since the last commit.
#[inline(always)]
pub fn cp_async_commit() {
    unsafe { asm!("cp.async.commit_group;", options(nostack)) }
}

/// Waits until at most `N` committed groups are still in flight (this thread's copies only: a
/// barrier must follow before other threads read them).
#[inline(always)]
pub fn cp_async_wait<const N: u32>() {
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack)) }
}

/// `prmt.b32`: byte `i` of the result is byte `sel` nibble `i` of `b:a` (0-3: `a`, 4-7: `b`).
#[inline(always)]
pub fn byte_perm(a: u32, b: u32, sel: u32) -> u32 {
    let r: u32;
    unsafe { asm!("prmt.b32 {0}, {1}, {2}, {3};", out(reg32) r, in(reg32) a, in(reg32) b, in(reg32) sel, options(pure, nomem, nostack)) };
    r
}

/// The low byte of `v` to shared memory.
#[inline(always)]
pub unsafe fn st_shared_u8(addr: u32, v: u32) {
    unsafe { asm!("st.shared.u8 [{0}], {1};", in(reg32) addr, in(reg32) v, options(nostack)) }
}

/// The low 16 bits of `v` to shared memory.
#[inline(always)]
pub unsafe fn st_shared_u16(addr: u32, v: u32) {
    unsafe { asm!("st.shared.u16 [{0}], {1};", in(reg32) addr, in(reg16) v as u16, options(nostack)) }
}

/// Two 16-bit values to shared memory.
#[inline(always)]
pub unsafe fn st_shared_u32(addr: u32, v: u32) {
    unsafe { asm!("st.shared.u32 [{0}], {1};", in(reg32) addr, in(reg32) v, options(nostack)) }
}

#[inline(always)]
pub unsafe fn ld_shared_v4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.shared.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg32) addr,
             options(readonly, nostack));
    }
    [a, b, c, d]
}

#[inline(always)]
pub unsafe fn st_shared_v4(addr: u32, v: [u32; 4]) {
    unsafe {
        asm!("st.shared.v4.u32 [{0}], {{{1}, {2}, {3}, {4}}};", in(reg32) addr, in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3],
             options(nostack));
    }
}

/// Two u64 (a key's K and V row addresses) to shared memory.
#[inline(always)]
pub unsafe fn st_shared_u64x2(addr: u32, a: u64, b: u64) {
    unsafe { asm!("st.shared.v2.u64 [{0}], {{{1}, {2}}};", in(reg32) addr, in(reg64) a, in(reg64) b, options(nostack)) }
}

#[inline(always)]
pub unsafe fn st_shared_u64(addr: u32, v: u64) {
    unsafe { asm!("st.shared.u64 [{0}], {1};", in(reg32) addr, in(reg64) v, options(nostack)) }
}

#[inline(always)]
pub unsafe fn ld_shared_u64x2(addr: u32) -> (u64, u64) {
    let (a, b): (u64, u64);
    unsafe { asm!("ld.shared.v2.u64 {{{0}, {1}}}, [{2}];", out(reg64) a, out(reg64) b, in(reg32) addr, options(readonly, nostack)) };
    (a, b)
}

#[inline(always)]
pub unsafe fn ld_shared_u64(addr: u32) -> u64 {
    let r: u64;
    unsafe { asm!("ld.shared.u64 {0}, [{1}];", out(reg64) r, in(reg32) addr, options(readonly, nostack)) };
    r
}

#[inline(always)]
pub unsafe fn st_shared_f32x2(addr: u32, a: f32, b: f32) {
    unsafe { asm!("st.shared.v2.f32 [{0}], {{{1}, {2}}};", in(reg32) addr, in(reg32) a, in(reg32) b, options(nostack)) }
}

#[inline(always)]
pub unsafe fn ld_shared_f32x2(addr: u32) -> (f32, f32) {
    let (a, b): (f32, f32);
    unsafe { asm!("ld.shared.v2.f32 {{{0}, {1}}}, [{2}];", out(reg32) a, out(reg32) b, in(reg32) addr, options(readonly, nostack)) };
    (a, b)
}

#[inline(always)]
pub unsafe fn st_shared_f32(addr: u32, v: f32) {
    unsafe { asm!("st.shared.f32 [{0}], {1};", in(reg32) addr, in(reg32) v, options(nostack)) }
}

#[inline(always)]
pub unsafe fn ld_shared_f32(addr: u32) -> f32 {
    let r: f32;
    unsafe { asm!("ld.shared.f32 {0}, [{1}];", out(reg32) r, in(reg32) addr, options(readonly, nostack)) };
    r
}

#[inline(always)]
pub unsafe fn ld_shared_u32(addr: u32) -> u32 {
    let r: u32;
    unsafe { asm!("ld.shared.u32 {0}, [{1}];", out(reg32) r, in(reg32) addr, options(readonly, nostack)) };
    r
}

/// Four 8x8 matrices of 16-bit values to shared memory (sm_90): lanes 8i..8i+7 give the row
/// addresses of matrix i, and lane 4g + t holds (row g, cols 2t, 2t+1) of matrix i in `v[i]`
/// ([`ldmatrix_x4`]'s fragment).
#[inline(always)]
pub unsafe fn stmatrix_x4(addr: u32, v: [u32; 4]) {
    unsafe {
        asm!("stmatrix.sync.aligned.m8n8.x4.shared.b16 [{0}], {{{1}, {2}, {3}, {4}}};",
             in(reg32) addr, in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3], options(nostack));
    }
}
