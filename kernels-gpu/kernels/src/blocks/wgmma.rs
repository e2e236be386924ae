//! Hopper `wgmma` chains of the prefill kernel (`prefill_hopper`), per 16-bit type: a
//! warpgroup's S = Q K^T over a 128-key tile, and its O += P V with P from registers.
//!
//! Each chain is one `asm!` block (fence, the k-steps, commit, wait): the accumulators stay in
//! the same registers from the first k-step to the last, so `ptxas` never has to serialise the
//! chain around moves. Accumulator layout (m64nN, f32): warp w of the warpgroup holds rows
//! 16w..16w+15, and `[n][e]` of a thread is `mma.sync`'s C layout of its warp's column block n
//! (8 columns); the A registers of P V take `mma.sync`'s A layout, so P is packed from S exactly
//! as on the `mma.sync` path.

use crate::blocks::elem::{Bf16, F16};
use crate::blocks::mma::MmaHalf;
use core::arch::asm;

/// The warpgroup matrix products of the Hopper prefill kernel.
pub trait WgmmaTiles: MmaHalf {
    /// S = Q K^T for the warpgroup's 64 rows and 128 keys over head size `D` (64 or 128: 4 or 8
    /// k-steps of 16 columns); Q and K K-major in the 128-byte-swizzled layout,
    /// given by the descriptors of their first k-step. Waits for the result.
    unsafe fn scores_64x128<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 16];
    /// O += P V for the warpgroup's 64 rows, `D` columns (64 or 128: `o[..D / 8]`) and 128 keys:
    /// P in registers (`p[kk]`: the A fragment of keys 16kk..16kk+15), V N-major in the
    /// 128-byte-swizzled layout (`desc_v`: keys 0.., leading 1024, stride one 8-key group).
    /// Waits for the result.
    unsafe fn pv_64xd_k128<const D: usize>(o: &mut [[f32; 4]; 16], p: &[[u32; 4]; 8], desc_v: u64);
    /// S = Q K^T over 64 keys (half a tile: `desc_k` names its first key), not waited for;
    /// [`wait_scores64`] retires it.
    unsafe fn scores_64x64_async<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 8];
    /// O += P V over 64 keys (`p[kk]`: keys 16kk..16kk+15 of the half tile at `desc_v`), not
    /// waited for; [`wait_pv64`] retires it.
    unsafe fn pv_64xd_k64_async<const D: usize>(o: &mut [[f32; 4]; 16], p: &[[u32; 4]; 4], desc_v: u64);
}

macro_rules! acc64 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}"
    };
}

macro_rules! acc32 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}"
    };
}

/// One k-step of S (m64n128k16, both operands from shared memory, K-major); `$scale`: the
/// predicate that says whether to add to the accumulators (false on the first k-step).
macro_rules! qk_step {
    ($t:literal, $scale:literal) => {
        concat!("wgmma.mma_async.sync.aligned.m64n128k16.f32.", $t, ".", $t, " {{", acc64!(), "}}, da, db, ", $scale, ", 1, 1, 0, 0;\n")
    };
}

/// The 4 k-steps of one 128-byte swizzle atom (64 columns): descriptors +32 bytes a k-step.
macro_rules! qk_atom {
    ($t:literal, $first:literal) => {
        concat!(
            qk_step!($t, $first),
            "add.s64 da, da, 2;\nadd.s64 db, db, 2;\n",
            qk_step!($t, "po"),
            "add.s64 da, da, 2;\nadd.s64 db, db, 2;\n",
            qk_step!($t, "po"),
            "add.s64 da, da, 2;\nadd.s64 db, db, 2;\n",
            qk_step!($t, "po")
        )
    };
}

/// The S chain: one atom (head size 64) or two (128; the next atom is 1024 bytes on from the
/// first, 1024 - 96 from the last k-step: 58 units of 16 bytes).
macro_rules! qk_chain {
    ($t:literal, $wait:literal, $($more:tt)*) => {
        concat!(
            "{{\n.reg .pred pz, po;\n.reg .b32 zz;\n.reg .b64 da, db;\n",
            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 da, {64};\nmov.b64 db, {65};\nwgmma.fence.sync.aligned;\n",
            qk_atom!($t, "pz"),
            $($more)*
            "wgmma.commit_group.sync.aligned;\n", $wait, "}}"
        )
    };
}

/// One k-step of S over 64 keys (m64n64k16). The descriptors are rebuilt from 32-bit halves
/// each k-step, so that stepping them is a 32-bit add (their address field is in the low word
/// and never carries out of it).
macro_rules! qk64_step {
    ($t:literal, $scale:literal) => {
        concat!(
            "mov.b64 da, {{al, ah}};\nmov.b64 db, {{bl, bh}};\n",
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.",
            $t,
            ".",
            $t,
            " {{",
            acc32!(),
            "}}, da, db, ",
            $scale,
            ", 1, 1, 0, 0;\n"
        )
    };
}

/// [`qk_atom`] over 64 keys.
macro_rules! qk64_atom {
    ($t:literal, $first:literal) => {
        concat!(
            qk64_step!($t, $first),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n",
            qk64_step!($t, "po"),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n",
            qk64_step!($t, "po"),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n",
            qk64_step!($t, "po")
        )
    };
}

/// [`qk_chain`] over 64 keys (32 accumulators; the descriptors are operands 32 and 33).
macro_rules! qk64_chain {
    ($t:literal, $wait:literal, $($more:tt)*) => {
        concat!(
            "{{\n.reg .pred pz, po;\n.reg .b32 zz, al, ah, bl, bh;\n.reg .b64 da, db;\n",
            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 {{al, ah}}, {32};\nmov.b64 {{bl, bh}}, {33};\nwgmma.fence.sync.aligned;\n",
            qk64_atom!($t, "pz"),
            $($more)*
            "wgmma.commit_group.sync.aligned;\n", $wait, "}}"
        )
    };
}

/// [`pv_chain`] over 4 k-steps (64 keys), stepping V's descriptor by 32-bit adds as
/// [`qk64_step`] does.
macro_rules! pv64_chain {
    ($t:literal, $wait:literal, $n:literal, $acc:expr, $desc:literal, $inc:literal, [$($a:literal),*]) => {
        concat!(
            "{{\n.reg .pred po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 {{bl, bh}}, ", $desc, ";\nwgmma.fence.sync.aligned;\n",
            $("mov.b64 db, {{bl, bh}};\n", pv_step!($t, $n, $acc, $a), "add.s32 bl, bl, ", $inc, ";\n",)*
            "wgmma.commit_group.sync.aligned;\n", $wait, "}}"
        )
    };
}

/// One k-step of P V (m64nDk16, A from registers, B N-major: `imm-trans-b` 1), adding.
macro_rules! pv_step {
    ($t:literal, $n:literal, $acc:expr, $a:literal) => {
        concat!("wgmma.mma_async.sync.aligned.m64n", $n, "k16.f32.", $t, ".", $t, " {{", $acc, "}}, {{", $a, "}}, db, po, 1, 1, 1;\n")
    };
}

/// The P V chain over 8 k-steps of 16 keys (V's descriptor + two 8-key groups each: `$inc`
/// units of 16 bytes); `$desc`: the descriptor's operand; `$a`: each k-step's A registers.
macro_rules! pv_chain {
    ($t:literal, $wait:literal, $n:literal, $acc:expr, $desc:literal, $inc:literal, [$($a:literal),*]) => {
        concat!(
            "{{\n.reg .pred po;\n.reg .b32 zz;\n.reg .b64 db;\n",
            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 db, ", $desc, ";\nwgmma.fence.sync.aligned;\n",
            $(pv_step!($t, $n, $acc, $a), "add.s64 db, db, ", $inc, ";\n",)*
            "wgmma.commit_group.sync.aligned;\n", $wait, "}}"
        )
    };
}

/// `asm!` with the accumulator blocks `[$n]` of `$d` as `$dir` (out / inout) operands first,
/// then (`frags`) the A fragments `[$k]` of `$p` as inputs.
macro_rules! with_acc {
    ($tmpl:expr, $dir:ident $d:ident [$($n:literal)*], frags $p:ident [$($k:literal)*], $($rest:tt)*) => {
        with_acc!($tmpl, $dir $d [$($n)*], $(in(reg32) $p[$k][0], in(reg32) $p[$k][1], in(reg32) $p[$k][2], in(reg32) $p[$k][3],)* $($rest)*)
    };
    ($tmpl:expr, $dir:ident $d:ident [$($n:literal)*], $($rest:tt)*) => {
        asm!($tmpl, $($dir(reg32) $d[$n][0], $dir(reg32) $d[$n][1], $dir(reg32) $d[$n][2], $dir(reg32) $d[$n][3],)* $($rest)*)
    };
}

/// The body of S = Q K^T (`$wait`: the wait after the commit, or none).
macro_rules! scores_body {
    ($t:literal, $wait:literal, $desc_q:ident, $desc_k:ident) => {{
        const { assert!(D == 64 || D == 128) };
        let mut s = [[0.0f32; 4]; 16];
        if D == 64 {
            unsafe {
                with_acc!(qk_chain!($t, $wait,), out s [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15],
                          in(reg64) $desc_q, in(reg64) $desc_k, options(nostack))
            };
        } else {
            unsafe {
                with_acc!(qk_chain!($t, $wait, "add.s64 da, da, 58;\nadd.s64 db, db, 58;\n", qk_atom!($t, "po"),),
                          out s [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15],
                          in(reg64) $desc_q, in(reg64) $desc_k, options(nostack))
            };
        }
        s
    }};
}

/// The body of O += P V (`$wait`: the wait after the commit, or none).
macro_rules! pv_body {
    ($t:literal, $wait:literal, $o:ident, $p:ident, $desc_v:ident) => {{
        const { assert!(D == 64 || D == 128) };
        if D == 64 {
            // 8-key groups of 1024 bytes: +2048 bytes a k-step.
            unsafe {
                with_acc!(pv_chain!($t, $wait, "64", acc32!(), "{64}", "128",
                                    ["{32}, {33}, {34}, {35}", "{36}, {37}, {38}, {39}", "{40}, {41}, {42}, {43}", "{44}, {45}, {46}, {47}",
                                     "{48}, {49}, {50}, {51}", "{52}, {53}, {54}, {55}", "{56}, {57}, {58}, {59}", "{60}, {61}, {62}, {63}"]),
                          inout $o [0 1 2 3 4 5 6 7],
                          frags $p [0 1 2 3 4 5 6 7],
                          in(reg64) $desc_v, options(nostack))
            };
        } else {
            // 8-key groups of 2048 bytes: +4096 bytes a k-step.
            unsafe {
                with_acc!(pv_chain!($t, $wait, "128", acc64!(), "{96}", "256",
                                    ["{64}, {65}, {66}, {67}", "{68}, {69}, {70}, {71}", "{72}, {73}, {74}, {75}", "{76}, {77}, {78}, {79}",
                                     "{80}, {81}, {82}, {83}", "{84}, {85}, {86}, {87}", "{88}, {89}, {90}, {91}", "{92}, {93}, {94}, {95}"]),
                          inout $o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15],
                          frags $p [0 1 2 3 4 5 6 7],
                          in(reg64) $desc_v, options(nostack))
            };
        }
    }};
}

macro_rules! wgmma_tiles_impl {
    ($ty:ty, $t:literal) => {
        impl WgmmaTiles for $ty {
            #[inline(always)]
            unsafe fn scores_64x128<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 16] {
                scores_body!($t, "wgmma.wait_group.sync.aligned 0;\n", desc_q, desc_k)
            }

            #[inline(always)]
            unsafe fn pv_64xd_k128<const D: usize>(o: &mut [[f32; 4]; 16], p: &[[u32; 4]; 8], desc_v: u64) {
                pv_body!($t, "wgmma.wait_group.sync.aligned 0;\n", o, p, desc_v)
            }

            #[inline(always)]
            unsafe fn scores_64x64_async<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 8] {
                const { assert!(D == 64 || D == 128) };
                let mut s = [[0.0f32; 4]; 8];
                if D == 64 {
                    unsafe { with_acc!(qk64_chain!($t, "",), out s [0 1 2 3 4 5 6 7], in(reg64) desc_q, in(reg64) desc_k, options(nostack)) };
                } else {
                    unsafe {
                        with_acc!(qk64_chain!($t, "", "add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n", qk64_atom!($t, "po"),),
                                  out s [0 1 2 3 4 5 6 7], in(reg64) desc_q, in(reg64) desc_k, options(nostack))
                    };
                }
                s
            }

            #[inline(always)]
            unsafe fn pv_64xd_k64_async<const D: usize>(o: &mut [[f32; 4]; 16], p: &[[u32; 4]; 4], desc_v: u64) {
                const { assert!(D == 64 || D == 128) };
                if D == 64 {
                    unsafe {
                        with_acc!(pv64_chain!($t, "", "64", acc32!(), "{48}", "128",
                                            ["{32}, {33}, {34}, {35}", "{36}, {37}, {38}, {39}", "{40}, {41}, {42}, {43}", "{44}, {45}, {46}, {47}"]),
                                  inout o [0 1 2 3 4 5 6 7], frags p [0 1 2 3], in(reg64) desc_v, options(nostack))
                    };
                } else {
                    unsafe {
                        with_acc!(pv64_chain!($t, "", "128", acc64!(), "{80}", "256",
                                            ["{64}, {65}, {66}, {67}", "{68}, {69}, {70}, {71}", "{72}, {73}, {74}, {75}", "{76}, {77}, {78}, {79}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], frags p [0 1 2 3], in(reg64) desc_v, options(nostack))
                    };
                }
            }
        }
    };
}

wgmma_tiles_impl!(F16, "f16");
wgmma_tiles_impl!(Bf16, "bf16");

/// Waits until at most `N` committed chains are pending, and returns `s`, the accumulators of
/// the S chain over 64 keys this retires, as new values copied after the wait. (With `s` as
/// in-out operands LLVM copied them into the loop's registers before the wait, and `ptxas` then
/// serialised every chain: C7514.)
#[inline(always)]
pub unsafe fn wait_scores64<const N: u32>(s: [[f32; 4]; 8]) -> [[f32; 4]; 8] {
    let mut r = [[0.0f32; 4]; 8];
    unsafe {
        with_acc!(concat!("wgmma.wait_group.sync.aligned {n};\n", "mov.b32 {32}, {0};\nmov.b32 {33}, {1};\nmov.b32 {34}, {2};\nmov.b32 {35}, {3};\nmov.b32 {36}, {4};\nmov.b32 {37}, {5};\nmov.b32 {38}, {6};\nmov.b32 {39}, {7};\nmov.b32 {40}, {8};\nmov.b32 {41}, {9};\nmov.b32 {42}, {10};\nmov.b32 {43}, {11};\nmov.b32 {44}, {12};\nmov.b32 {45}, {13};\nmov.b32 {46}, {14};\nmov.b32 {47}, {15};\nmov.b32 {48}, {16};\nmov.b32 {49}, {17};\nmov.b32 {50}, {18};\nmov.b32 {51}, {19};\nmov.b32 {52}, {20};\nmov.b32 {53}, {21};\nmov.b32 {54}, {22};\nmov.b32 {55}, {23};\nmov.b32 {56}, {24};\nmov.b32 {57}, {25};\nmov.b32 {58}, {26};\nmov.b32 {59}, {27};\nmov.b32 {60}, {28};\nmov.b32 {61}, {29};\nmov.b32 {62}, {30};\nmov.b32 {63}, {31};\n"),
                  in s [0 1 2 3 4 5 6 7],
                  out(reg32) r[0][0], out(reg32) r[0][1], out(reg32) r[0][2], out(reg32) r[0][3],
                  out(reg32) r[1][0], out(reg32) r[1][1], out(reg32) r[1][2], out(reg32) r[1][3],
                  out(reg32) r[2][0], out(reg32) r[2][1], out(reg32) r[2][2], out(reg32) r[2][3],
                  out(reg32) r[3][0], out(reg32) r[3][1], out(reg32) r[3][2], out(reg32) r[3][3],
                  out(reg32) r[4][0], out(reg32) r[4][1], out(reg32) r[4][2], out(reg32) r[4][3],
                  out(reg32) r[5][0], out(reg32) r[5][1], out(reg32) r[5][2], out(reg32) r[5][3],
                  out(reg32) r[6][0], out(reg32) r[6][1], out(reg32) r[6][2], out(reg32) r[6][3],
                  out(reg32) r[7][0], out(reg32) r[7][1], out(reg32) r[7][2], out(reg32) r[7][3],
                  n = const N, options(nostack))
    };
    r
}

/// The same for a P V chain over 64 keys: its accumulators `o` (the first `D / 8` blocks) and
/// its A fragments `p`, which the chain reads until it completes, are operands so that nothing
/// touches them before.
#[inline(always)]
pub unsafe fn wait_pv64<const N: u32, const D: usize>(o: &mut [[f32; 4]; 16], p: &[[u32; 4]; 4]) {
    const { assert!(D == 64 || D == 128) };
    if D == 64 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc32!(), ", {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}"), inout o [0 1 2 3 4 5 6 7], frags p [0 1 2 3], n = const N, options(nostack))
        };
    } else {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc64!(), ", {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}"),
                      inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], frags p [0 1 2 3], n = const N, options(nostack))
        };
    }
}
