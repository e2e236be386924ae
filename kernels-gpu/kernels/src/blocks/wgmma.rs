//! Hopper `wgmma` chains of the prefill kernel (`prefill_specialized`), per 16-bit type: a
//! warpgroup's S = Q K^T over a 64-key half tile (or a whole 128-key tile at width 64), and its
//! O += P V with P from registers, all issued without waiting ([`wait_scores64`],
//! [`wait_scores128`], [`wait_pv64`] retire them).
//!
//! Each chain is one `asm!` block (fence, the k-steps, commit): the accumulators stay in
//! the same registers from the first k-step to the last, so `ptxas` never has to serialise the
//! chain around moves. Accumulator layout (m64nN, f32): warp w of the warpgroup holds rows
//! 16w..16w+15, and `[n][e]` of a thread is `mma.sync`'s C layout of its warp's column block n
//! (8 columns); the A registers of P V take `mma.sync`'s A layout, so P is packed from S exactly
//! as on the `mma.sync` path.

use crate::blocks::elem::{Bf16, E4m3, E5m2, Fp8Format, F16};
use crate::blocks::mma::MmaHalf;
use core::arch::asm;

/// Column blocks of 8 of a warpgroup's O accumulators ([`Acc`]): up to width 256.
pub const ACC_BLOCKS: usize = 32;
/// A warpgroup's O (m64 x the width): block n of a thread holds columns 8n..8n+7 in
/// `mma.sync`'s C layout; a kernel of width D uses the first D / 8 blocks.
pub type Acc = [[f32; 4]; ACC_BLOCKS];

/// The warpgroup matrix products of the Hopper prefill kernel.
pub trait WgmmaTiles: MmaHalf {
    /// S = Q K^T over 64 keys (half a tile: `desc_k` names its first key), not waited for;
    /// [`wait_scores64`] retires it.
    unsafe fn scores_64x64_async<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 8];
    /// O += P V over 64 keys (`p[kk]`: keys 16kk..16kk+15 of the half tile at `desc_v`), not
    /// waited for; [`wait_pv64`] retires it.
    unsafe fn pv_64xd_k64_async<const D: usize>(o: &mut Acc, p: &[[u32; 4]; 4], desc_v: u64);
    /// S = Q K^T over a whole tile of 128 keys whose K rows are contiguous (`desc_k` names its
    /// first key; width 64), one chain of m64n128 steps; not waited for: [`wait_scores128`]
    /// retires it.
    unsafe fn scores_64x128_async<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 16];
    /// S = Q K^T over 32 keys (a quarter tile, width 256), not waited for; [`wait_scores32`]
    /// retires it.
    unsafe fn scores_64x32_async<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 4];
    /// O += P V over 32 keys (width 256), not waited for; [`wait_pv32`] retires it.
    unsafe fn pv_64xd_k32_async<const D: usize>(o: &mut Acc, p: &[[u32; 4]; 2], desc_v: u64);
}

macro_rules! acc16 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}"
    };
}

macro_rules! acc128 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}, {96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}, {112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}"
    };
}

macro_rules! acc64 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}"
    };
}

macro_rules! acc68 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}"
    };
}

macro_rules! acc60 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}"
    };
}

macro_rules! acc52 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}"
    };
}

macro_rules! acc44 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}"
    };
}

macro_rules! acc56 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}"
    };
}

macro_rules! acc48 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}"
    };
}

macro_rules! acc40 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}"
    };
}

macro_rules! acc32 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}"
    };
}

/// One k-step of S over `$n` keys (m64n`$n`k16; `$acc`: the accumulator list's macro). The
/// descriptors are rebuilt from 32-bit halves each k-step, so that stepping them is a 32-bit
/// add (their address field is in the low word and never carries out of it).
macro_rules! qk_step {
    ($t:literal, $scale:literal, $n:literal, $acc:ident) => {
        concat!(
            "mov.b64 da, {{al, ah}};\nmov.b64 db, {{bl, bh}};\n",
            "wgmma.mma_async.sync.aligned.m64n",
            $n,
            "k16.f32.",
            $t,
            ".",
            $t,
            " {{",
            $acc!(),
            "}}, da, db, ",
            $scale,
            ", 1, 1, 0, 0;\n"
        )
    };
}

/// The 4 k-steps of one 128-byte swizzle atom (64 columns): descriptors +32 bytes a k-step.
macro_rules! qk_atom {
    ($t:literal, $first:literal, $n:literal, $acc:ident) => {
        concat!(
            qk_step!($t, $first, $n, $acc),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n",
            qk_step!($t, "po", $n, $acc),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n",
            qk_step!($t, "po", $n, $acc),
            "add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n",
            qk_step!($t, "po", $n, $acc)
        )
    };
}

/// The S chain over 64 keys: one atom (head size 64), two (128; the next atom is 1024 bytes on
/// from the first, 1024 - 96 from the last k-step: 58 units of 16 bytes) or three (QK 192), of
/// which head sizes 80, 96 and 112 run the second's first 1, 2 or 3 k-steps; 32 accumulators, the descriptors
/// are operands 32 and 33.
macro_rules! qk64_chain {
    ($t:literal, $wait:literal, $($more:tt)*) => {
        concat!(
            "{{\n.reg .pred pz, po;\n.reg .b32 zz, al, ah, bl, bh;\n.reg .b64 da, db;\n",
            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 {{al, ah}}, {32};\nmov.b64 {{bl, bh}}, {33};\nwgmma.fence.sync.aligned;\n",
            qk_atom!($t, "pz", "64", acc32),
            $($more)*
            "wgmma.commit_group.sync.aligned;\n", $wait, "}}"
        )
    };
}

/// The S chain over 32 keys at width 256: four atoms; 16 accumulators, the descriptors are
/// operands 16 and 17.
macro_rules! qk32_chain_256 {
    ($t:literal) => {
        concat!(
            "{{\n.reg .pred pz, po;\n.reg .b32 zz, al, ah, bl, bh;\n.reg .b64 da, db;\n",
            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 {{al, ah}}, {16};\nmov.b64 {{bl, bh}}, {17};\nwgmma.fence.sync.aligned;\n",
            qk_atom!($t, "pz", "32", acc16),
            "add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n",
            qk_atom!($t, "po", "32", acc16),
            "add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n",
            qk_atom!($t, "po", "32", acc16),
            "add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n",
            qk_atom!($t, "po", "32", acc16),
            "wgmma.commit_group.sync.aligned;\n}}"
        )
    };
}

/// Head sizes 80, 96 and 112 on rows of two atoms: the step to the second atom (as in
/// [`qk64_chain`]) and its first k-step, then `$more` (further k-steps), 32 bytes apart.
macro_rules! qk64_second_atom {
    ($t:literal $(, $more:expr)*) => {
        concat!("add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n", qk_step!($t, "po", "64", acc32), $("add.s32 al, al, 2;\nadd.s32 bl, bl, 2;\n", $more,)*)
    };
}

/// The S chain over 128 keys at head size 64 (m64n128k16, one atom): as [`qk64_chain`], with 64
/// accumulators and the descriptors as operands 64 and 65. One chain instead of two over 64 keys
/// each: half the `wgmma`s and their descriptor set-up, and Q read from shared memory once for
/// 128 keys.
macro_rules! qk128_chain {
    ($t:literal) => {
        concat!(
            "{{\n.reg .pred pz, po;\n.reg .b32 zz, al, ah, bl, bh;\n.reg .b64 da, db;\n",
            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 {{al, ah}}, {64};\nmov.b64 {{bl, bh}}, {65};\nwgmma.fence.sync.aligned;\n",
            qk_atom!($t, "pz", "128", acc64),
            "wgmma.commit_group.sync.aligned;\n}}"
        )
    };
}

/// The P V chain over 4 k-steps of 16 keys (V's descriptor + two 8-key groups each: `$inc`
/// units of 16 bytes), stepping V's descriptor by 32-bit adds as [`qk_step`] does; `$desc`:
/// the descriptor's operand; `$a`: each k-step's A registers.
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

macro_rules! wgmma_tiles_impl {
    ($ty:ty, $t:literal) => {
        impl WgmmaTiles for $ty {
            #[inline(always)]
            unsafe fn scores_64x64_async<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 8] {
                // Widths up to 128 and QK 192 (width 256 steps over 32 keys; its callers here are
                // never reached).
                const { assert!(matches!(D, 64 | 80 | 96 | 112 | 128 | 192 | 256)) };
                let mut s = [[0.0f32; 4]; 8];
                if D == 64 {
                    unsafe { with_acc!(qk64_chain!($t, "",), out s [0 1 2 3 4 5 6 7], in(reg64) desc_q, in(reg64) desc_k, options(nostack)) };
                } else if D == 80 {
                    unsafe { with_acc!(qk64_chain!($t, "", qk64_second_atom!($t),), out s [0 1 2 3 4 5 6 7], in(reg64) desc_q, in(reg64) desc_k, options(nostack)) };
                } else if D == 96 {
                    unsafe {
                        with_acc!(qk64_chain!($t, "", qk64_second_atom!($t, qk_step!($t, "po", "64", acc32)),),
                                  out s [0 1 2 3 4 5 6 7], in(reg64) desc_q, in(reg64) desc_k, options(nostack))
                    };
                } else if D == 112 {
                    unsafe {
                        with_acc!(qk64_chain!($t, "", qk64_second_atom!($t, qk_step!($t, "po", "64", acc32), qk_step!($t, "po", "64", acc32)),),
                                  out s [0 1 2 3 4 5 6 7], in(reg64) desc_q, in(reg64) desc_k, options(nostack))
                    };
                } else if D == 128 {
                    unsafe {
                        with_acc!(qk64_chain!($t, "", "add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n", qk_atom!($t, "po", "64", acc32),),
                                  out s [0 1 2 3 4 5 6 7], in(reg64) desc_q, in(reg64) desc_k, options(nostack))
                    };
                } else if D == 192 {
                    // QK 192 (V 128): three atoms.
                    unsafe {
                        with_acc!(qk64_chain!($t, "", "add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n", qk_atom!($t, "po", "64", acc32),
                                              "add.s32 al, al, 58;\nadd.s32 bl, bl, 58;\n", qk_atom!($t, "po", "64", acc32),),
                                  out s [0 1 2 3 4 5 6 7], in(reg64) desc_q, in(reg64) desc_k, options(nostack))
                    };
                }
                s
            }

            #[inline(always)]
            unsafe fn scores_64x128_async<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 16] {
                // Width 64, whose stages hold whole tiles (the half-tile stages of the wider
                // kernels keep their halves apart; its callers there are never reached).
                const { assert!(matches!(D, 64 | 80 | 96 | 112 | 128 | 192 | 256)) };
                let mut s = [[0.0f32; 4]; 16];
                if D == 64 {
                    unsafe { with_acc!(qk128_chain!($t), out s [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], in(reg64) desc_q, in(reg64) desc_k, options(nostack)) };
                }
                s
            }

            #[inline(always)]
            unsafe fn pv_64xd_k64_async<const D: usize>(o: &mut Acc, p: &[[u32; 4]; 4], desc_v: u64) {
                // Widths up to 128 (width 256 steps over 32 keys; its callers here are never reached).
                const { assert!(matches!(D, 64 | 80 | 96 | 112 | 128 | 256)) };
                // N = D columns of V; past 64 the rows are two atoms wide (V's next 16 keys 256
                // units of 16 bytes on).
                if D == 80 {
                    unsafe {
                        with_acc!(pv64_chain!($t, "", "80", acc40!(), "{56}", "256", ["{40}, {41}, {42}, {43}", "{44}, {45}, {46}, {47}", "{48}, {49}, {50}, {51}", "{52}, {53}, {54}, {55}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9], frags p [0 1 2 3], in(reg64) desc_v, options(nostack))
                    };
                } else if D == 96 {
                    unsafe {
                        with_acc!(pv64_chain!($t, "", "96", acc48!(), "{64}", "256", ["{48}, {49}, {50}, {51}", "{52}, {53}, {54}, {55}", "{56}, {57}, {58}, {59}", "{60}, {61}, {62}, {63}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10 11], frags p [0 1 2 3], in(reg64) desc_v, options(nostack))
                    };
                } else if D == 112 {
                    unsafe {
                        with_acc!(pv64_chain!($t, "", "112", acc56!(), "{72}", "256", ["{56}, {57}, {58}, {59}", "{60}, {61}, {62}, {63}", "{64}, {65}, {66}, {67}", "{68}, {69}, {70}, {71}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13], frags p [0 1 2 3], in(reg64) desc_v, options(nostack))
                    };
                } else if D == 64 {
                    unsafe {
                        with_acc!(pv64_chain!($t, "", "64", acc32!(), "{48}", "128",
                                            ["{32}, {33}, {34}, {35}", "{36}, {37}, {38}, {39}", "{40}, {41}, {42}, {43}", "{44}, {45}, {46}, {47}"]),
                                  inout o [0 1 2 3 4 5 6 7], frags p [0 1 2 3], in(reg64) desc_v, options(nostack))
                    };
                } else if D == 128 {
                    unsafe {
                        with_acc!(pv64_chain!($t, "", "128", acc64!(), "{80}", "256",
                                            ["{64}, {65}, {66}, {67}", "{68}, {69}, {70}, {71}", "{72}, {73}, {74}, {75}", "{76}, {77}, {78}, {79}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], frags p [0 1 2 3], in(reg64) desc_v, options(nostack))
                    };
                }
            }

            #[inline(always)]
            unsafe fn scores_64x32_async<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 4] {
                // Width 256 only (its callers at other widths are compiled but never reached).
                let mut s = [[0.0f32; 4]; 4];
                if D == 256 {
                    unsafe { with_acc!(qk32_chain_256!($t), out s [0 1 2 3], in(reg64) desc_q, in(reg64) desc_k, options(nostack)) };
                }
                s
            }

            #[inline(always)]
            unsafe fn pv_64xd_k32_async<const D: usize>(o: &mut Acc, p: &[[u32; 4]; 2], desc_v: u64) {
                // Width 256 only, as above. Four atoms a row: V's next 16 keys 512 units of 16
                // bytes on.
                if D == 256 {
                    unsafe {
                        with_acc!(pv64_chain!($t, "", "256", acc128!(), "{136}", "512", ["{128}, {129}, {130}, {131}", "{132}, {133}, {134}, {135}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31], frags p [0 1], in(reg64) desc_v, options(nostack))
                    };
                }
            }
        }
    };
}

wgmma_tiles_impl!(F16, "f16");
wgmma_tiles_impl!(Bf16, "bf16");

/// Waits until at most `N` committed chains are pending, and returns `s`, the accumulators of
/// the S chain over 64 keys this retires. They are the wait's inputs, so the chain's registers
/// stay its own until the wait; callers read only the returned values. Nothing orders those
/// reads after the wait but LLVM's placement: were one moved above it, `ptxas` would serialise
/// the chains (C7514), which `cargo xtask ptx-report` fails on. (Copied into new registers
/// after the wait instead, S took 32 moves a warp a 64-key block that `ptxas` kept; as in-out
/// operands, LLVM copied them before the wait, and `ptxas` serialised every chain.)
#[inline(always)]
pub unsafe fn wait_scores64<const N: u32>(s: [[f32; 4]; 8]) -> [[f32; 4]; 8] {
    unsafe {
        with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc32!()), in s [0 1 2 3 4 5 6 7], n = const N, options(nostack))
    };
    s
}

/// Waits until at most `N` chains are pending, naming the A fragments `p` (`K` registers of
/// four) of a P V chain retired by then as operands: they are that chain's until here, and
/// free for other values after (the chain's accumulators, still read by a later chain, are
/// not named).
#[inline(always)]
pub unsafe fn wait_frags<const N: u32, const K: usize>(p: &[[u32; 4]; K]) {
    const { assert!(K == 2 || K == 4) };
    let f = |k: usize| if k < K { p[k] } else { p[0] };
    let (a, b, c, d) = (f(0), f(1), f(2), f(3));
    if K == 4 {
        unsafe {
            asm!("wgmma.wait_group.sync.aligned {n}; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}",
                 in(reg32) a[0], in(reg32) a[1], in(reg32) a[2], in(reg32) a[3], in(reg32) b[0], in(reg32) b[1], in(reg32) b[2], in(reg32) b[3],
                 in(reg32) c[0], in(reg32) c[1], in(reg32) c[2], in(reg32) c[3], in(reg32) d[0], in(reg32) d[1], in(reg32) d[2], in(reg32) d[3],
                 n = const N, options(nostack))
        };
    } else {
        unsafe {
            asm!("wgmma.wait_group.sync.aligned {n}; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}",
                 in(reg32) a[0], in(reg32) a[1], in(reg32) a[2], in(reg32) a[3], in(reg32) b[0], in(reg32) b[1], in(reg32) b[2], in(reg32) b[3],
                 n = const N, options(nostack))
        };
    }
}

/// The same for a P V chain over 64 keys: its accumulators `o` (the first `D / 8` blocks) and
/// its A fragments `p`, which the chain reads until it completes, are operands so that nothing
/// touches them before.
#[inline(always)]
pub unsafe fn wait_pv64<const N: u32, const D: usize>(o: &mut Acc, p: &[[u32; 4]; 4]) {
    // Widths up to 128 (width 256 steps over 32 keys; its callers here are never reached).
    const { assert!(matches!(D, 64 | 80 | 96 | 112 | 128 | 256)) };
    if D == 80 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc40!(), ", {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}"), inout o [0 1 2 3 4 5 6 7 8 9], frags p [0 1 2 3], n = const N, options(nostack))
        };
    } else if D == 96 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc48!(), ", {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}"), inout o [0 1 2 3 4 5 6 7 8 9 10 11], frags p [0 1 2 3], n = const N, options(nostack))
        };
    } else if D == 112 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc56!(), ", {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}"), inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13], frags p [0 1 2 3], n = const N, options(nostack))
        };
    } else if D == 64 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc32!(), ", {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}"), inout o [0 1 2 3 4 5 6 7], frags p [0 1 2 3], n = const N, options(nostack))
        };
    } else if D == 128 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc64!(), ", {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}"),
                      inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], frags p [0 1 2 3], n = const N, options(nostack))
        };
    }
}

/// [`wait_scores64`] for an S chain over a whole tile of 128 keys.
#[inline(always)]
pub unsafe fn wait_scores128<const N: u32>(s: [[f32; 4]; 16]) -> [[f32; 4]; 16] {
    unsafe {
        with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc64!()), in s [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], n = const N, options(nostack))
    };
    s
}

/// [`wait_scores64`] for an S chain over 32 keys.
#[inline(always)]
pub unsafe fn wait_scores32<const N: u32>(s: [[f32; 4]; 4]) -> [[f32; 4]; 4] {
    unsafe { with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc16!()), in s [0 1 2 3], n = const N, options(nostack)) };
    s
}

/// [`wait_pv64`] for a P V chain over 32 keys at width 256.
#[inline(always)]
pub unsafe fn wait_pv32<const N: u32, const D: usize>(o: &mut Acc, p: &[[u32; 4]; 2]) {
    // Width 256 only, as [`WgmmaTiles::pv_64xd_k32_async`].
    if D == 256 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc128!(), ", {128}, {129}, {130}, {131}, {132}, {133}, {134}, {135}"),
                      inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31], frags p [0 1], n = const N, options(nostack))
        };
    }
}

/// [`wait_pv64`] for a chain whose A operand is in shared memory (the MLA kernel's P V over 256
/// columns): only the accumulators, all 32 blocks, are operands.
#[inline(always)]
pub unsafe fn wait_acc256<const N: u32>(o: &mut Acc) {
    unsafe {
        with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc128!()),
                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31], n = const N, options(nostack))
    };
}

/// The FP8 S chain over 64 keys with the queries as A fragments in registers (`{32}` on, four
/// a k-step: the first k-step's, then `$a` for each k-step after it) and K at descriptor operand
/// `$desc`, 32 bytes (one k-step of FP8 columns) on each k-step.
macro_rules! qk64_chain_fp8_rs {
    ($b:literal, $desc:literal, [$($a:literal),*]) => {
        concat!(
            "{{\n.reg .pred pz, po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
            "mov.b64 {{bl, bh}}, ", $desc, ";\nmov.b64 db, {{bl, bh}};\nwgmma.fence.sync.aligned;\n",
            "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.", $b, " {{", acc32!(), "}}, {{{32}, {33}, {34}, {35}}}, db, pz, 1, 1;\n",
            $("add.s32 bl, bl, 2;\nmov.b64 db, {{bl, bh}};\n",
              "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.", $b, " {{", acc32!(), "}}, {{", $a, "}}, db, po, 1, 1;\n",)*
            "wgmma.commit_group.sync.aligned;\n}}"
        )
    };
}

/// The FP8 P V chain over 64 keys: two k-steps of 32 keys (m64n`$n`k32, A (e4m3 P) from
/// registers, V of FP8 type `$b` transposed in shared memory: K-major), V's descriptor 32 bytes
/// on between them.
macro_rules! pv64_chain_fp8 {
    ($b:literal, $n:literal, $acc:expr, $desc:literal, [$($a:literal),*]) => {
        concat!(
            "{{\n.reg .pred po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 {{bl, bh}}, ", $desc, ";\nwgmma.fence.sync.aligned;\n",
            $("mov.b64 db, {{bl, bh}};\n",
              "wgmma.mma_async.sync.aligned.m64n", $n, "k32.f32.e4m3.", $b, " {{", $acc, "}}, {{", $a, "}}, db, po, 1, 1;\n",
              "add.s32 bl, bl, 2;\n",)*
            "wgmma.commit_group.sync.aligned;\n}}"
        )
    };
}

/// [`pv64_chain_fp8`] with each k-step followed by one of N = 8 into the row sums'
/// accumulators `$sums`, B the block of ones at descriptor operand `$ones` (K-major, the same
/// for every k-step: every element is 1).
macro_rules! pv64_chain_fp8_sums {
    ($b:literal, $n:literal, $acc:expr, $sums:literal, $desc:literal, $ones:literal, [$($a:literal),*]) => {
        concat!(
            "{{\n.reg .pred po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 {{bl, bh}}, ", $desc, ";\nwgmma.fence.sync.aligned;\n",
            $("mov.b64 db, {{bl, bh}};\n",
              "wgmma.mma_async.sync.aligned.m64n", $n, "k32.f32.e4m3.", $b, " {{", $acc, "}}, {{", $a, "}}, db, po, 1, 1;\n",
              "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.", $b, " {{", $sums, "}}, {{", $a, "}}, ", $ones, ", po, 1, 1;\n",
              "add.s32 bl, bl, 2;\n",)*
            "wgmma.commit_group.sync.aligned;\n}}"
        )
    };
}

/// Blocks of O an FP8 P V chain over 64 keys at width `d` writes ([`WgmmaFp8::pv_64xd_k64`]):
/// `d / 8` and one more, block `d / 8`, which accumulates each row's sum of P, so that the
/// tensor cores add the weights instead of 16 `FADD`s a row a 64-key block in the softmax (the
/// e4m3 kernels' compute warps set their pace by the instructions they issue). At widths 80,
/// 96 and 112 the chain's N reaches 8 rows of V^T past the width, where the kernel's transposes
/// write ones; at 128, which has no such rows, each k-step has a second `wgmma` of N = 8 against
/// a block of ones (`desc_ones`).
///
/// Not on the 16-bit chains: there the same sums (N + 8 at widths 80 to 112, a second `wgmma`
/// at 64 and 128) took 1-3% longer at every width (docs/prefill.md).
pub const fn pv_blocks_fp8(d: usize) -> usize {
    d / 8 + 1
}

/// An FP8 format `wgmma` takes for K and V (its B operands) beside e4m3 queries and weights (A).
pub trait WgmmaFp8: Fp8Format {
    /// S = Q K^T over 64 keys, Q e4m3 as A fragments in registers (`q[ks]`: columns
    /// 32ks..32ks+31, read once an item by `e4m3_stages::query_frags`) and K rows of this format
    /// at `desc_k` (128 bytes a row, 128-byte swizzle, K-major), not waited for
    /// ([`wait_scores64`] retires it). Widths 80 to 128: the k-steps that reach past `D` (zeros)
    /// are left out.
    unsafe fn scores_64x64<const D: usize>(q: &[[u32; 4]; 4], desc_k: u64) -> [[f32; 4]; 8];
    /// O += P V over 64 keys, P as e4m3 A fragments ([`e4m3x4`]: `p[kc]`, keys 32kc..32kc+31 of
    /// the half in the order [`crate::attention::hopper`]'s transposed V follows) and V^T rows of
    /// this format at `desc_v` (a row a V column, K-major), not waited for ([`wait_pv64_e4m3`]
    /// retires it). Blocks `0..pv_blocks_fp8(D)` of O, the last the rows' sums of P
    /// ([`pv_blocks_fp8`]: V^T's rows D..D+7 are ones at widths 80 to 112; at 128, `desc_ones`:
    /// 1 KB of ones in 128-byte swizzled rows).
    unsafe fn pv_64xd_k64<const D: usize>(o: &mut Acc, p: &[[u32; 4]; 2], desc_v: u64, desc_ones: u64);
}

macro_rules! wgmma_fp8_impl {
    ($t:ty, $b:literal) => {
        impl WgmmaFp8 for $t {
            #[inline(always)]
            unsafe fn scores_64x64<const D: usize>(q: &[[u32; 4]; 4], desc_k: u64) -> [[f32; 4]; 8] {
                const { assert!(matches!(D, 80 | 96 | 112 | 128)) };
                let mut s = [[0.0f32; 4]; 8];
                if D <= 96 {
                    unsafe {
                        with_acc!(qk64_chain_fp8_rs!($b, "{44}", ["{36}, {37}, {38}, {39}", "{40}, {41}, {42}, {43}"]),
                                  out s [0 1 2 3 4 5 6 7], frags q [0 1 2], in(reg64) desc_k, options(nostack))
                    };
                } else {
                    unsafe {
                        with_acc!(qk64_chain_fp8_rs!($b, "{48}", ["{36}, {37}, {38}, {39}", "{40}, {41}, {42}, {43}", "{44}, {45}, {46}, {47}"]),
                                  out s [0 1 2 3 4 5 6 7], frags q [0 1 2 3], in(reg64) desc_k, options(nostack))
                    };
                }
                s
            }

            #[inline(always)]
            unsafe fn pv_64xd_k64<const D: usize>(o: &mut Acc, p: &[[u32; 4]; 2], desc_v: u64, desc_ones: u64) {
                const { assert!(matches!(D, 80 | 96 | 112 | 128)) };
                if D == 80 {
                    unsafe {
                        with_acc!(pv64_chain_fp8!($b, "88", acc44!(), "{52}", ["{44}, {45}, {46}, {47}", "{48}, {49}, {50}, {51}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10], frags p [0 1], in(reg64) desc_v, options(nostack))
                    };
                } else if D == 96 {
                    unsafe {
                        with_acc!(pv64_chain_fp8!($b, "104", acc52!(), "{60}", ["{52}, {53}, {54}, {55}", "{56}, {57}, {58}, {59}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12], frags p [0 1], in(reg64) desc_v, options(nostack))
                    };
                } else if D == 112 {
                    unsafe {
                        with_acc!(pv64_chain_fp8!($b, "120", acc60!(), "{68}", ["{60}, {61}, {62}, {63}", "{64}, {65}, {66}, {67}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14], frags p [0 1], in(reg64) desc_v, options(nostack))
                    };
                } else {
                    unsafe {
                        with_acc!(pv64_chain_fp8_sums!($b, "128", acc64!(), "{64}, {65}, {66}, {67}", "{76}", "{77}", ["{68}, {69}, {70}, {71}", "{72}, {73}, {74}, {75}"]),
                                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16], frags p [0 1], in(reg64) desc_v, in(reg64) desc_ones, options(nostack))
                    };
                }
            }
        }
    };
}

wgmma_fp8_impl!(E4m3, "e4m3");
wgmma_fp8_impl!(E5m2, "e5m2");

/// [`wait_pv64`] for an FP8 P V chain ([`WgmmaFp8::pv_64xd_k64`]).
#[inline(always)]
pub unsafe fn wait_pv64_e4m3<const N: u32, const D: usize>(o: &mut Acc, p: &[[u32; 4]; 2]) {
    const { assert!(matches!(D, 80 | 96 | 112 | 128)) };
    if D == 80 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc44!(), ", {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}"), inout o [0 1 2 3 4 5 6 7 8 9 10], frags p [0 1], n = const N, options(nostack))
        };
    } else if D == 96 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc52!(), ", {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}"), inout o [0 1 2 3 4 5 6 7 8 9 10 11 12], frags p [0 1], n = const N, options(nostack))
        };
    } else if D == 112 {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc60!(), ", {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}"), inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14], frags p [0 1], n = const N, options(nostack))
        };
    } else {
        unsafe {
            with_acc!(concat!("wgmma.wait_group.sync.aligned {n}; // ", acc68!(), ", {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}"),
                      inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16], frags p [0 1], n = const N, options(nostack))
        };
    }
}

/// Four f32 rounded to e4m3 (round to nearest, saturating at +-448) in one register, `a` in
/// the low byte.
#[inline(always)]
pub fn e4m3x4(a: f32, b: f32, c: f32, d: f32) -> u32 {
    let r: u32;
    unsafe {
        asm!("{{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, {b}, {a};\ncvt.rn.satfinite.e4m3x2.f32 hi, {d}, {c};\nmov.b32 {r}, {{lo, hi}};\n}}",
             r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, c = in(reg32) c, d = in(reg32) d, options(pure, nomem, nostack))
    };
    r
}

/// The MLA narrow shape's chains over an FP8 cache on e4m3 `wgmma`, operands swapped (keys on
/// M, the 16 query rows on N; `attn_math::mla::narrow_e4m3_layout`). Accumulators (m64n16, f32)
/// `[j][e]`: M row `16w + g + 8 (e >> 1)` of warp w, N column `8j + 2t4 + (e & 1)`.
pub trait NarrowFp8Chains: Fp8Format {
    /// S^T = K Q^T over a 64-key tile and the 576 columns: K rows of this format at `desc_k`
    /// (A, K-major, 128-byte swizzle: atoms of 64 rows, 8 KB apart), the quantised queries at
    /// `desc_q` (B, e4m3, atoms of 16 rows, 2 KB apart). Not waited for.
    unsafe fn scores_t(desc_k: u64, desc_q: u64) -> [[f32; 4]; 2];
    /// O^T += V^T P^T over 64 keys: `o[2b..2b + 2]` the 64 columns of M block b, `v[8s + b]` its
    /// A fragments of this format for keys 32s..32s + 31, P^T e4m3 at `desc_p` (B, K-major).
    /// Not waited for.
    unsafe fn pv_t(o: &mut [[f32; 4]; 16], v: &[[u32; 4]; 16], desc_p: u64);
}

macro_rules! narrow_fp8_chains_impl {
    ($t:ty, $k:literal) => {
        impl NarrowFp8Chains for $t {
            #[inline(always)]
            unsafe fn scores_t(desc_k: u64, desc_q: u64) -> [[f32; 4]; 2] {
                let mut s = [[0.0f32; 4]; 2];
                unsafe {
                    with_acc!(concat!(
                "{{\n.reg .pred pz, po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                "mov.b64 {{a0, ah}}, {8};\nmov.b64 {{b0, bh}}, {9};\nwgmma.fence.sync.aligned;\n",
                "add.s32 al, a0, 0;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 0;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, pz, 1, 1;\n",
                "add.s32 al, a0, 2;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 2;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 4;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 4;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 6;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 6;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 512;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 128;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 514;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 130;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 516;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 132;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 518;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 134;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1024;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 256;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1026;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 258;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1028;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 260;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1030;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 262;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1536;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 384;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1538;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 386;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1540;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 388;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1542;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 390;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 2048;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 512;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 2050;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 514;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, da, db, po, 1, 1;\n",
                "wgmma.commit_group.sync.aligned;\n}}"),
                              out s [0 1], in(reg64) desc_k, in(reg64) desc_q, options(nostack))
                };
                s
            }

            #[inline(always)]
            unsafe fn pv_t(o: &mut [[f32; 4]; 16], v: &[[u32; 4]; 16], desc_p: u64) {
                unsafe {
                    with_acc!(concat!(
                "{{\n.reg .pred po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
                "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 {{bl, bh}}, {128};\nwgmma.fence.sync.aligned;\n",
                "mov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, {{{64}, {65}, {66}, {67}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, {{{68}, {69}, {70}, {71}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}}}, {{{72}, {73}, {74}, {75}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}}}, {{{76}, {77}, {78}, {79}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}}}, {{{80}, {81}, {82}, {83}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}}}, {{{84}, {85}, {86}, {87}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}}}, {{{88}, {89}, {90}, {91}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}}}, {{{92}, {93}, {94}, {95}}}, db, po, 1, 1;\n",
                "add.s32 bl, bl, 2;\n",
                "mov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}, {{{96}, {97}, {98}, {99}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, {{{100}, {101}, {102}, {103}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}}}, {{{104}, {105}, {106}, {107}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}}}, {{{108}, {109}, {110}, {111}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}}}, {{{112}, {113}, {114}, {115}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}}}, {{{116}, {117}, {118}, {119}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}}}, {{{120}, {121}, {122}, {123}}}, db, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n16k32.f32.", $k, ".e4m3 {{{56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}}}, {{{124}, {125}, {126}, {127}}}, db, po, 1, 1;\n",
                "add.s32 bl, bl, 2;\n",
                "wgmma.commit_group.sync.aligned;\n}}"),
                              inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], frags v [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15],
                              in(reg64) desc_p, options(nostack))
                };
            }
        }
    };
}

narrow_fp8_chains_impl!(E4m3, "e4m3");
narrow_fp8_chains_impl!(E5m2, "e5m2");

/// Waits for the S^T chain of [`NarrowFp8Chains`] (the only one in flight) and returns its
/// accumulators for the reads after the wait.
#[inline(always)]
pub unsafe fn wait_scores_t(s: [[f32; 4]; 2]) -> [[f32; 4]; 2] {
    unsafe { with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}", in s [0 1], options(nostack)) };
    s
}

/// Waits for the P V chain of [`NarrowFp8Chains`]: O^T `o` and its A fragments `v`.
#[inline(always)]
pub unsafe fn wait_pv_t(o: &mut [[f32; 4]; 16], v: &[[u32; 4]; 16]) {
    unsafe {
        with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}, {96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}, {112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}",
                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], frags v [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15], options(nostack))
    };
}

/// The `wgmma` chains of the wide shape (up to 64 query rows) over an FP8 cache on sm_90a (keys
/// on M, as [`NarrowFp8Chains`]; `crate::attention::mla::wide_e4m3`): each warpgroup takes 32 of
/// the query rows (N = 32) through every tile. Accumulators (f32): S^T `[j][e]`, O^T block b's
/// `[4b + j][e]`: M row (key, or column of V) `16w + g + 8 (e >> 1)` of warp w, N column (query
/// row) `8j + 2t4 + (e & 1)`.
pub trait WideFp8Chains: Fp8Format {
    /// S^T = K Q^T over a 64-key tile and the 576 columns: K rows of this format at `desc_k`
    /// (A, K-major, 128-byte swizzle: atoms of 64 rows, 8 KB apart), 32 quantised query rows
    /// at `desc_q` (B, e4m3, in atoms of 64 rows, 8 KB apart). Not waited for.
    unsafe fn scores_t32(desc_k: u64, desc_q: u64) -> [[f32; 4]; 4];
    /// O^T += V^T P^T over 32 keys: `o[4b..4b + 4]` the 64 columns of M block b, `v[b]` its A
    /// fragments of this format, P^T's 32 rows e4m3 at `desc_p` (B, K-major). Not waited for.
    unsafe fn pv_t32(o: &mut [[f32; 4]; 32], v: &[[u32; 4]; 8], desc_p: u64);
}

macro_rules! wide_fp8_chains_impl {
    ($t:ty, $k:literal) => {
        impl WideFp8Chains for $t {
            #[inline(always)]
            unsafe fn scores_t32(desc_k: u64, desc_q: u64) -> [[f32; 4]; 4] {
                let mut s = [[0.0f32; 4]; 4];
                unsafe {
                    with_acc!(concat!(
                "{{\n.reg .pred pz, po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                "mov.b64 {{a0, ah}}, {16};\nmov.b64 {{b0, bh}}, {17};\nwgmma.fence.sync.aligned;\n",
                "add.s32 al, a0, 0;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 0;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, pz, 1, 1;\n",
                "add.s32 al, a0, 2;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 2;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 4;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 4;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 6;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 6;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 512;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 512;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 514;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 514;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 516;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 516;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 518;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 518;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1024;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 1024;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1026;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 1026;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1028;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 1028;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1030;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 1030;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1536;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 1536;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1538;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 1538;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1540;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 1540;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 1542;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 1542;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 2048;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 2048;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "add.s32 al, a0, 2050;\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, 2050;\nmov.b64 db, {{bl, bh}};\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, da, db, po, 1, 1;\n",
                "wgmma.commit_group.sync.aligned;\n}}"),
                              out s [0 1 2 3], in(reg64) desc_k, in(reg64) desc_q, options(nostack))
                };
                s
            }

            #[inline(always)]
            unsafe fn pv_t32(o: &mut [[f32; 4]; 32], v: &[[u32; 4]; 8], desc_p: u64) {
                unsafe {
                    with_acc!(concat!(
                "{{\n.reg .pred po;\n.reg .b32 zz;\n",
                "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nwgmma.fence.sync.aligned;\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, {{{128}, {129}, {130}, {131}}}, {160}, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}}}, {{{132}, {133}, {134}, {135}}}, {160}, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}}}, {{{136}, {137}, {138}, {139}}}, {160}, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}}}, {{{140}, {141}, {142}, {143}}}, {160}, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}}}, {{{144}, {145}, {146}, {147}}}, {160}, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}}}, {{{148}, {149}, {150}, {151}}}, {160}, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}}}, {{{152}, {153}, {154}, {155}}}, {160}, po, 1, 1;\n",
                "wgmma.mma_async.sync.aligned.m64n32k32.f32.", $k, ".e4m3 {{{112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}}}, {{{156}, {157}, {158}, {159}}}, {160}, po, 1, 1;\n",
                "wgmma.commit_group.sync.aligned;\n}}"),
                              inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31],
                              frags v [0 1 2 3 4 5 6 7], in(reg64) desc_p, options(nostack))
                };
            }
        }
    };
}

wide_fp8_chains_impl!(E4m3, "e4m3");
wide_fp8_chains_impl!(E5m2, "e5m2");

/// Waits for the S^T chain of [`WideFp8Chains`] (the only one in flight) and returns its
/// accumulators for the reads after the wait.
#[inline(always)]
pub unsafe fn wait_scores_t32(s: [[f32; 4]; 4]) -> [[f32; 4]; 4] {
    unsafe {
        with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}", in s [0 1 2 3], options(nostack))
    };
    s
}

/// Waits for a P V chain of [`WideFp8Chains`]: O^T `o` and its A fragments `v`.
#[inline(always)]
pub unsafe fn wait_pv_t32(o: &mut [[f32; 4]; 32], v: &[[u32; 4]; 8]) {
    unsafe {
        with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}, {96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}, {112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}, {128}, {129}, {130}, {131}, {132}, {133}, {134}, {135}, {136}, {137}, {138}, {139}, {140}, {141}, {142}, {143}, {144}, {145}, {146}, {147}, {148}, {149}, {150}, {151}, {152}, {153}, {154}, {155}, {156}, {157}, {158}, {159}",
                  inout o [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31], frags v [0 1 2 3 4 5 6 7], options(nostack))
    };
}

/// One k-step of a `wgmma` with both operands in shared memory (`$shape`: the `mNkK.f32.a.b`
/// part), on descriptors `a0`/`ah` and `b0`/`bh` advanced by `$da` and `$db` (16-byte units; the
/// address field is in the low word and never carries out of it), accumulating into `$acc`
/// under predicate `$pred`; `$trans`: the 16-bit types' transpose immediates, or nothing.
macro_rules! ss_step {
    ($n:literal, $shape:literal, $acc:literal, $da:literal, $db:literal, $pred:literal, $trans:literal) => {
        concat!(
            "add.s32 al, a0, ",
            $da,
            ";\nmov.b64 da, {{al, ah}};\nadd.s32 bl, b0, ",
            $db,
            ";\nmov.b64 db, {{bl, bh}};\n",
            "wgmma.mma_async.sync.aligned.m64n",
            $n,
            $shape,
            " ",
            $acc,
            ", da, db, ",
            $pred,
            ", 1, 1",
            $trans,
            ";\n"
        )
    };
}

/// One k-step of an e4m3 `wgmma` with A in registers (`$frag`) and B at descriptor `db`,
/// accumulating into `$acc`.
macro_rules! rs_step {
    ($n:literal, $k:literal, $acc:literal, $frag:literal) => {
        concat!("wgmma.mma_async.sync.aligned.m64n", $n, "k32.f32.", $k, ".e4m3 ", $acc, ", ", $frag, ", db, po, 1, 1;\n")
    };
}

/// S^T = K Q^T of the decode with the keys on M (`attn_math::keys_m`), for K rows of this type:
/// `W` elements a row (128 or 256 bytes), `G` column groups of 8 query rows (N = 8G). Accumulators
/// `[j][e]` (j < G): M row (key) `16w + g + 8 (e >> 1)` of warp w, N column (query row)
/// `8j + 2t4 + (e & 1)`.
pub trait KeysOnMScores {
    /// Over a 64-key tile: K rows at `desc_k` (A, K-major, 128-byte swizzle: atoms of 64 rows, 8
    /// KB apart), the queries at `desc_q` (B, the queries' e4m3 or 16-bit rows, atoms of 8G
    /// rows), 32 bytes of the rows a k-step. Not waited for: [`wait_scores_km`].
    unsafe fn scores_km<const W: usize, const G: usize>(desc_k: u64, desc_q: u64) -> [[f32; 4]; 2];
}

macro_rules! keys_on_m_scores_impl {
    ($t:ty, $shape:literal, $bytes:literal, $trans:literal) => {
        impl KeysOnMScores for $t {
            #[inline(always)]
            unsafe fn scores_km<const W: usize, const G: usize>(desc_k: u64, desc_q: u64) -> [[f32; 4]; 2] {
                const { assert!((W * $bytes == 128 || W * $bytes == 256) && (G == 1 || G == 2)) };
                let mut s = [[0.0f32; 4]; 2];
                if W * $bytes == 128 && G == 1 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred pz, po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                            "mov.b64 {{a0, ah}}, {4};\nmov.b64 {{b0, bh}}, {5};\nwgmma.fence.sync.aligned;\n",
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "0", "0", "pz", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "2", "2", "po", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "4", "4", "po", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "6", "6", "po", $trans),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), out s [0], in(reg64) desc_k, in(reg64) desc_q, options(nostack))
                    };
                } else if W * $bytes == 128 && G == 2 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred pz, po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                            "mov.b64 {{a0, ah}}, {8};\nmov.b64 {{b0, bh}}, {9};\nwgmma.fence.sync.aligned;\n",
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "0", "0", "pz", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "2", "2", "po", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "4", "4", "po", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "6", "6", "po", $trans),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), out s [0 1], in(reg64) desc_k, in(reg64) desc_q, options(nostack))
                    };
                } else if W * $bytes == 256 && G == 1 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred pz, po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                            "mov.b64 {{a0, ah}}, {4};\nmov.b64 {{b0, bh}}, {5};\nwgmma.fence.sync.aligned;\n",
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "0", "0", "pz", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "2", "2", "po", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "4", "4", "po", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "6", "6", "po", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "512", "64", "po", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "514", "66", "po", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "516", "68", "po", $trans),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "518", "70", "po", $trans),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), out s [0], in(reg64) desc_k, in(reg64) desc_q, options(nostack))
                    };
                } else if W * $bytes == 256 && G == 2 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred pz, po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                            "mov.b32 zz, 0;\nsetp.ne.b32 pz, zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                            "mov.b64 {{a0, ah}}, {8};\nmov.b64 {{b0, bh}}, {9};\nwgmma.fence.sync.aligned;\n",
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "0", "0", "pz", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "2", "2", "po", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "4", "4", "po", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "6", "6", "po", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "512", "128", "po", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "514", "130", "po", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "516", "132", "po", $trans),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "518", "134", "po", $trans),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), out s [0 1], in(reg64) desc_k, in(reg64) desc_q, options(nostack))
                    };
                }
                s
            }
        }
    };
}

keys_on_m_scores_impl!(E4m3, "k32.f32.e4m3.e4m3", 1, "");
keys_on_m_scores_impl!(E5m2, "k32.f32.e5m2.e4m3", 1, "");
// 16-bit types take the transpose immediates: both operands K-major.
keys_on_m_scores_impl!(Bf16, "k16.f32.bf16.bf16", 2, ", 0, 0");
keys_on_m_scores_impl!(F16, "k16.f32.f16.f16", 2, ", 0, 0");

/// O^T += V^T P^T over a 64-key tile of the decode with the keys on M, FP8 rows: `W` the width
/// (128 or 256: `W/64` M blocks of 64 head dimensions), `G` column groups of 8 query rows;
/// `o[G b..G b + G]` M block b, `v[W/64 s + b]` its A fragments of this format for keys
/// 32s..32s + 31 (P^T's column order), P^T e4m3 at `desc_p` (B, K-major). Not waited for:
/// [`wait_pv_km`].
pub trait KeysOnMValuesFp8: Fp8Format {
    unsafe fn pv_km<const W: usize, const G: usize>(o: &mut [[f32; 4]; 8], v: &[[u32; 4]; 8], desc_p: u64);
}

macro_rules! keys_on_m_values_fp8_impl {
    ($t:ty, $k:literal) => {
        impl KeysOnMValuesFp8 for $t {
            #[inline(always)]
            unsafe fn pv_km<const W: usize, const G: usize>(o: &mut [[f32; 4]; 8], v: &[[u32; 4]; 8], desc_p: u64) {
                const { assert!((W == 128 || W == 256) && (G == 1 || G == 2)) };
                if W == 128 && G == 1 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
                            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 {{bl, bh}}, {24};\nwgmma.fence.sync.aligned;\n",
                            "mov.b64 db, {{bl, bh}};\n",
                            rs_step!("8", $k, "{{{0}, {1}, {2}, {3}}}", "{{{8}, {9}, {10}, {11}}}"),
                            rs_step!("8", $k, "{{{4}, {5}, {6}, {7}}}", "{{{12}, {13}, {14}, {15}}}"),
                            "add.s32 bl, bl, 2;\n",
                            "mov.b64 db, {{bl, bh}};\n",
                            rs_step!("8", $k, "{{{0}, {1}, {2}, {3}}}", "{{{16}, {17}, {18}, {19}}}"),
                            rs_step!("8", $k, "{{{4}, {5}, {6}, {7}}}", "{{{20}, {21}, {22}, {23}}}"),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), inout o [0 1], frags v [0 1 2 3], in(reg64) desc_p, options(nostack))
                    };
                } else if W == 128 && G == 2 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
                            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 {{bl, bh}}, {32};\nwgmma.fence.sync.aligned;\n",
                            "mov.b64 db, {{bl, bh}};\n",
                            rs_step!("16", $k, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "{{{16}, {17}, {18}, {19}}}"),
                            rs_step!("16", $k, "{{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}", "{{{20}, {21}, {22}, {23}}}"),
                            "add.s32 bl, bl, 2;\n",
                            "mov.b64 db, {{bl, bh}};\n",
                            rs_step!("16", $k, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "{{{24}, {25}, {26}, {27}}}"),
                            rs_step!("16", $k, "{{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}", "{{{28}, {29}, {30}, {31}}}"),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), inout o [0 1 2 3], frags v [0 1 2 3], in(reg64) desc_p, options(nostack))
                    };
                } else if W == 256 && G == 1 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
                            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 {{bl, bh}}, {48};\nwgmma.fence.sync.aligned;\n",
                            "mov.b64 db, {{bl, bh}};\n",
                            rs_step!("8", $k, "{{{0}, {1}, {2}, {3}}}", "{{{16}, {17}, {18}, {19}}}"),
                            rs_step!("8", $k, "{{{4}, {5}, {6}, {7}}}", "{{{20}, {21}, {22}, {23}}}"),
                            rs_step!("8", $k, "{{{8}, {9}, {10}, {11}}}", "{{{24}, {25}, {26}, {27}}}"),
                            rs_step!("8", $k, "{{{12}, {13}, {14}, {15}}}", "{{{28}, {29}, {30}, {31}}}"),
                            "add.s32 bl, bl, 2;\n",
                            "mov.b64 db, {{bl, bh}};\n",
                            rs_step!("8", $k, "{{{0}, {1}, {2}, {3}}}", "{{{32}, {33}, {34}, {35}}}"),
                            rs_step!("8", $k, "{{{4}, {5}, {6}, {7}}}", "{{{36}, {37}, {38}, {39}}}"),
                            rs_step!("8", $k, "{{{8}, {9}, {10}, {11}}}", "{{{40}, {41}, {42}, {43}}}"),
                            rs_step!("8", $k, "{{{12}, {13}, {14}, {15}}}", "{{{44}, {45}, {46}, {47}}}"),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), inout o [0 1 2 3], frags v [0 1 2 3 4 5 6 7], in(reg64) desc_p, options(nostack))
                    };
                } else if W == 256 && G == 2 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred po;\n.reg .b32 zz, bl, bh;\n.reg .b64 db;\n",
                            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\nmov.b64 {{bl, bh}}, {64};\nwgmma.fence.sync.aligned;\n",
                            "mov.b64 db, {{bl, bh}};\n",
                            rs_step!("16", $k, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "{{{32}, {33}, {34}, {35}}}"),
                            rs_step!("16", $k, "{{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}", "{{{36}, {37}, {38}, {39}}}"),
                            rs_step!("16", $k, "{{{16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}}}", "{{{40}, {41}, {42}, {43}}}"),
                            rs_step!("16", $k, "{{{24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}}}", "{{{44}, {45}, {46}, {47}}}"),
                            "add.s32 bl, bl, 2;\n",
                            "mov.b64 db, {{bl, bh}};\n",
                            rs_step!("16", $k, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "{{{48}, {49}, {50}, {51}}}"),
                            rs_step!("16", $k, "{{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}", "{{{52}, {53}, {54}, {55}}}"),
                            rs_step!("16", $k, "{{{16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}}}", "{{{56}, {57}, {58}, {59}}}"),
                            rs_step!("16", $k, "{{{24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}}}", "{{{60}, {61}, {62}, {63}}}"),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), inout o [0 1 2 3 4 5 6 7], frags v [0 1 2 3 4 5 6 7], in(reg64) desc_p, options(nostack))
                    };
                }
            }
        }
    };
}

keys_on_m_values_fp8_impl!(E4m3, "e4m3");
keys_on_m_values_fp8_impl!(E5m2, "e5m2");

/// O^T += V^T P^T over a 64-key tile of the decode with the keys on M, 16-bit rows: `W` the
/// width (64 or 128: `W/64` M blocks), `G` column groups; `o[G b..G b + G]` M block b, V^T read
/// transposed from the tile's V rows at `desc_v` (A, M-major, 128-byte swizzle: M block b the
/// atom 8 KB on, 16 keys a k-step), P^T of this type at `desc_p` (B, K-major). Not waited for:
/// [`wait_pv_km`].
pub trait KeysOnMValuesHalf {
    unsafe fn pv_km<const W: usize, const G: usize>(o: &mut [[f32; 4]; 8], desc_v: u64, desc_p: u64);
}

macro_rules! keys_on_m_values_half_impl {
    ($t:ty, $shape:literal) => {
        impl KeysOnMValuesHalf for $t {
            #[inline(always)]
            unsafe fn pv_km<const W: usize, const G: usize>(o: &mut [[f32; 4]; 8], desc_v: u64, desc_p: u64) {
                const { assert!((W == 64 || W == 128) && (G == 1 || G == 2)) };
                if W == 64 && G == 1 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                            "mov.b64 {{a0, ah}}, {4};\nmov.b64 {{b0, bh}}, {5};\nwgmma.fence.sync.aligned;\n",
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "0", "0", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "128", "2", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "256", "4", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "384", "6", "po", ", 1, 0"),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), inout o [0], in(reg64) desc_v, in(reg64) desc_p, options(nostack))
                    };
                } else if W == 64 && G == 2 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                            "mov.b64 {{a0, ah}}, {8};\nmov.b64 {{b0, bh}}, {9};\nwgmma.fence.sync.aligned;\n",
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "0", "0", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "128", "2", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "256", "4", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "384", "6", "po", ", 1, 0"),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), inout o [0 1], in(reg64) desc_v, in(reg64) desc_p, options(nostack))
                    };
                } else if W == 128 && G == 1 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                            "mov.b64 {{a0, ah}}, {8};\nmov.b64 {{b0, bh}}, {9};\nwgmma.fence.sync.aligned;\n",
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "0", "0", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{4}, {5}, {6}, {7}}}", "512", "0", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "128", "2", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{4}, {5}, {6}, {7}}}", "640", "2", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "256", "4", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{4}, {5}, {6}, {7}}}", "768", "4", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{0}, {1}, {2}, {3}}}", "384", "6", "po", ", 1, 0"),
                            ss_step!("8", $shape, "{{{4}, {5}, {6}, {7}}}", "896", "6", "po", ", 1, 0"),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), inout o [0 1], in(reg64) desc_v, in(reg64) desc_p, options(nostack))
                    };
                } else if W == 128 && G == 2 {
                    unsafe {
                        with_acc!(concat!(
                            "{{\n.reg .pred po;\n.reg .b32 zz, a0, ah, al, b0, bh, bl;\n.reg .b64 da, db;\n",
                            "mov.b32 zz, 0;\nsetp.eq.b32 po, zz, 0;\n",
                            "mov.b64 {{a0, ah}}, {16};\nmov.b64 {{b0, bh}}, {17};\nwgmma.fence.sync.aligned;\n",
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "0", "0", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}", "512", "0", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "128", "2", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}", "640", "2", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "256", "4", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}", "768", "4", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}}", "384", "6", "po", ", 1, 0"),
                            ss_step!("16", $shape, "{{{8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}", "896", "6", "po", ", 1, 0"),
                            "wgmma.commit_group.sync.aligned;\n}}"
                        ), inout o [0 1 2 3], in(reg64) desc_v, in(reg64) desc_p, options(nostack))
                    };
                }
            }
        }
    };
}

keys_on_m_values_half_impl!(Bf16, "k16.f32.bf16.bf16");
keys_on_m_values_half_impl!(F16, "k16.f32.f16.f16");

/// Waits for the S^T chain of [`KeysOnMScores`] (the only one in flight) and returns its
/// accumulators for the reads after the wait.
#[inline(always)]
pub unsafe fn wait_scores_km<const G: usize>(s: [[f32; 4]; 2]) -> [[f32; 4]; 2] {
    if G == 1 {
        unsafe { with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}", in s [0], options(nostack)) };
    } else {
        unsafe { with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}", in s [0 1], options(nostack)) };
    }
    s
}

/// Waits for the O^T chain of [`KeysOnMValuesFp8`] or [`KeysOnMValuesHalf`]: the accumulators of
/// `W/64 x G` entries of `o` and (`FRAGS`, the FP8 chain) the `2 W/64` A fragments of `v`.
#[inline(always)]
pub unsafe fn wait_pv_km<const W: usize, const G: usize, const FRAGS: bool>(o: &mut [[f32; 4]; 8], v: &[[u32; 4]; 8]) {
    if W == 64 && G == 1 && !FRAGS {
        unsafe { with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}", inout o [0], options(nostack)) };
    } else if W == 64 && G == 2 && !FRAGS {
        unsafe { with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}", inout o [0 1], options(nostack)) };
    } else if W == 128 && G == 1 && FRAGS {
        unsafe {
            with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}",
                      inout o [0 1], frags v [0 1 2 3], options(nostack))
        };
    } else if W == 128 && G == 1 && !FRAGS {
        unsafe { with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}", inout o [0 1], options(nostack)) };
    } else if W == 128 && G == 2 && FRAGS {
        unsafe {
            with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}",
                      inout o [0 1 2 3], frags v [0 1 2 3], options(nostack))
        };
    } else if W == 128 && G == 2 && !FRAGS {
        unsafe {
            with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}", inout o [0 1 2 3], options(nostack))
        };
    } else if W == 256 && G == 1 && FRAGS {
        unsafe {
            with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}",
                      inout o [0 1 2 3], frags v [0 1 2 3 4 5 6 7], options(nostack))
        };
    } else if W == 256 && G == 2 && FRAGS {
        unsafe {
            with_acc!("wgmma.wait_group.sync.aligned 0; // {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}",
                      inout o [0 1 2 3 4 5 6 7], frags v [0 1 2 3 4 5 6 7], options(nostack))
        };
    }
}
