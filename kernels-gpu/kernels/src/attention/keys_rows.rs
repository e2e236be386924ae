//! Keys-as-rows paged decode (`decode_kr_<q>[_fp8]_d<head_size>`): the keys-split decode CTA of
//! `crate::attention::mainloop` (same work items, splits and epilogue) with the score tile
//! transposed, for up to 8 query rows per kv head, or 16 (GQA 16) in the `_r16` kernels, which
//! run two column groups of 8 over each staged slab (`attn_math::keys_rows`).
//!
//! Per 16-key slab a warp computes S^T = K Q^T (keys on the MMA's 16 rows, query rows on its 8
//! columns), masks, runs the online softmax per column, turns P^T into the B operand of the next
//! MMA with `movmatrix`, and adds O^T += V^T P^T (head dimensions on the rows). At GQA <= 8 that
//! is half the MMAs, accumulators and softmax work of the 16-row S tile, so each tile's math
//! holds the warp's copy pipeline up for less of the time.
//!
//! Each warp streams its own 16 keys of every 64-key tile through its own `cp.async` ring, with
//! nothing but warp barriers in the loop. A slab of 16 keys lies in one cache block (block sizes
//! are multiples of 16 and slabs start on multiples of 16), so a slab's rows are one block-table
//! lookup away: the warp loads the block id of the slab it will copy next one iteration ahead,
//! and the copy addresses are the block's base plus offsets computed once. A slab whose block is
//! outside the cache is never read (zero-filled), masked, and reported in the status word.
//!
//! Two slab formats ([`SlabFormat`]): 16-bit rows in padded shared memory read with `ldmatrix`
//! ([`HalfRows`]), and FP8 rows (head sizes 64, 128 and 256) whose fragments are converted straight
//! from swizzled shared memory ([`Fp8Rows`], `crate::attention::fp8_direct`'s permuted head
//! dimensions applied to the transposed tile).

use crate::attention::config::{AttnConfig, Bits16, CacheFormat};
use crate::attention::fp8_direct::swizzled;
use crate::attention::lazy_rescale::must_rescale;
use crate::attention::logits::Logits;
use crate::attention::output::store_merged_rows;
use crate::attention::slab_copy::{SlabCopy, SlabRows, WarpSlabs};
use crate::attention::work::{work_item, RowInfo};
use crate::blocks::device::{
    atomic_or_global, dynamic_shared, fma, pdl_launch_dependents, pdl_wait, shfl_xor, static_for, sync_threads, sync_warp, thread_idx_x,
};
use crate::blocks::mma::{
    byte_perm, cp_async_commit, cp_async_wait, ld_shared_f32, ld_shared_u32, ld_shared_u64, ld_shared_v4, ldmatrix_x4, ldmatrix_x4_trans,
    movmatrix_trans, shared_addr, st_shared_f32, st_shared_f32x2, MmaHalf,
};
use crate::blocks::vec_io::{load8_nc, load_u32_nc};
use crate::merge::split_merge::merge_item_splits;
use attn_math::keys_rows::{ctas_per_sm, layout, plane_bytes, row_pitch, stage_bytes, stages, WARP_KEYS};
use attn_math::params::AttnParams;
use attn_math::softmax::{exp2, OnlineSoftmax};
use attn_math::status::BLOCK_OUT_OF_RANGE;

/// Waits until at most `stages - 1` of this thread's copy groups are in flight.
#[inline(always)]
fn wait_all_but(stages: u32) {
    match stages {
        6 => cp_async_wait::<5>(),
        5 => cp_async_wait::<4>(),
        4 => cp_async_wait::<3>(),
        3 => cp_async_wait::<2>(),
        _ => cp_async_wait::<1>(),
    }
}

/// How a cache format's slabs are turned into MMA fragments (how they are staged:
/// [`SlabRows`]). `M` is the tensor cores' input type; the accumulator m-tile `mt`, row `r` (0..16) of O^T holds head dimension
/// `dim(mt, r)`.
trait SlabFormat<const D: usize>: SlabRows<D> {
    type M: MmaHalf;
    /// The query B fragments of every k-step for query row `g` at `q` (16-bit `Q`), in the
    /// order [`Self::scores`] takes the head dimensions, times `conv` when `Q` is not `M`; 0
    /// for the dimensions at or past `head` (not read).
    unsafe fn queries<Q: MmaHalf>(q: u64, conv: f32, head: u32) -> [[u32; 2]; 16];
    /// S^T = K Q^T for the K plane at `k`, for each of `G` column groups of 8 query rows (each
    /// K fragment loaded once for all of them). Two accumulators halve the dependent chain.
    unsafe fn scores<const G: usize>(q: &[[[u32; 2]; 16]; G], k: u32) -> [[f32; 4]; G];
    /// O^T += V^T P^T for the V plane at `v`, for each column group; `b[c]` is group c's P^T as
    /// the B operand (each V fragment loaded once for all groups).
    unsafe fn pv<const G: usize>(b: [[u32; 2]; G], o: &mut [[[f32; 4]; 16]; G], v: u32);
    fn dim(mt: u32, r: u32) -> u32;
}

/// A 16-bit query element pair as `M`.
#[inline(always)]
fn convert<Q: MmaHalf, M: MmaHalf>(w: u32, conv: f32) -> u32 {
    if Q::IS_BF16 == M::IS_BF16 {
        w
    } else {
        let (lo, hi) = Q::unpack2(w);
        M::pack2(lo * conv, hi * conv)
    }
}

/// 16-bit rows, padded, read with `ldmatrix`; k-step `ks` is head dimensions `16 ks ..`.
struct HalfRows<Q>(core::marker::PhantomData<Q>);

impl<Q: MmaHalf, const D: usize> SlabRows<D> for HalfRows<Q> {
    type Cache = Bits16;
    const PLANE: u32 = plane_bytes(D as u32, false);

    #[inline(always)]
    fn at(r: u32, col: u32) -> u32 {
        r * row_pitch(D as u32) + col
    }
}

impl<Q: MmaHalf, const D: usize> SlabFormat<D> for HalfRows<Q> {
    type M = Q;

    #[inline(always)]
    unsafe fn queries<Q2: MmaHalf>(q: u64, _: f32, head: u32) -> [[u32; 2]; 16] {
        let t4 = thread_idx_x() % 4;
        let mut f = [[0u32; 2]; 16];
        static_for::<16>(|ks| {
            if ks < D / 16 {
                // Dimensions 16 ks + 2 t4 (+ 1) and 8 further: each in one 8-column group.
                let dim = 16 * ks as u32;
                let at = q + (dim as u64 + 2 * t4 as u64) * 2;
                if dim < head {
                    f[ks][0] = unsafe { load_u32_nc(at) };
                }
                if dim + 8 < head {
                    f[ks][1] = unsafe { load_u32_nc(at + 16) };
                }
            }
        });
        f
    }

    #[inline(always)]
    unsafe fn scores<const G: usize>(q: &[[[u32; 2]; 16]; G], k: u32) -> [[f32; 4]; G] {
        let lane = thread_idx_x() % 32;
        // Matrices: keys 0-7 / 8-15 (lanes 8-15 of each half) x dims 0-7 / 8-15 (lanes 16-31).
        let base = k + <Self as SlabRows<D>>::at((lane % 8) + 8 * ((lane / 8) % 2), 16 * (lane / 16));
        let mut acc = [[[0.0f32; 4]; 2]; G];
        static_for::<16>(|ks| {
            if ks < D / 16 {
                let a = unsafe { ldmatrix_x4(base + ks as u32 * 32) };
                static_for::<G>(|c| acc[c][ks % 2] = Q::mma(a, q[c][ks][0], q[c][ks][1], acc[c][ks % 2]));
            }
        });
        core::array::from_fn(|c| core::array::from_fn(|e| acc[c][0][e] + acc[c][1][e]))
    }

    #[inline(always)]
    unsafe fn pv<const G: usize>(b: [[u32; 2]; G], o: &mut [[[f32; 4]; 16]; G], v: u32) {
        let lane = thread_idx_x() % 32;
        // Matrices: keys 0-7 x dims 0-7, keys 0-7 x dims 8-15, keys 8-15 x dims 0-7, keys 8-15 x
        // dims 8-15, read transposed (dims on the A operand's rows).
        let base = v + <Self as SlabRows<D>>::at((lane % 8) + 8 * (lane / 16), 16 * ((lane / 8) % 2));
        static_for::<16>(|mt| {
            if mt < D / 16 {
                let a = unsafe { ldmatrix_x4_trans(base + mt as u32 * 32) };
                static_for::<G>(|c| o[c][mt] = Q::mma(a, b[c][0], b[c][1], o[c][mt]));
            }
        });
    }

    #[inline(always)]
    fn dim(mt: u32, r: u32) -> u32 {
        16 * mt + r
    }
}

/// FP8 E4M3 rows (head sizes 64, 128 and 256), swizzled in 16-byte units; fragments converted to
/// f16 in registers. The head dimensions are permuted so that each thread's bytes are runs:
/// - S^T: k-step `ks` of thread t4 takes dimensions `t4 * D/4 + 4 ks ..+ 4` (its k slots 2t4,
///   2t4 + 1, 2t4 + 8, 2t4 + 9), one run of D/4 bytes per key;
/// - O^T: m-tile `mt`, row `r` is dimension `r * D/16 + mt`, one run of D/16 bytes per (key, r).
///
/// `K`: `config::Fp8E4M3`, or `config::Fp8E4M3A8` for rows that may start only 8-byte aligned.
struct Fp8Rows<K>(core::marker::PhantomData<K>);

impl<K> Fp8Rows<K> {
    /// The D/16-byte run of `key`'s row from dimension `r * D/16`, as words (4 m-tiles each).
    #[inline(always)]
    unsafe fn v_run<const D: usize>(v: u32, key: u32, r: u32) -> [u32; 4] {
        let at = v + swizzled(key, r * (D as u32 / 16), D as u32);
        match D {
            256 => unsafe { ld_shared_v4(at) },
            128 => {
                let w = unsafe { ld_shared_u64(at) };
                [w as u32, (w >> 32) as u32, 0, 0]
            }
            _ => [unsafe { ld_shared_u32(at) }, 0, 0, 0],
        }
    }
}

impl<K: CacheFormat, const D: usize> SlabRows<D> for Fp8Rows<K> {
    type Cache = K;
    const PLANE: u32 = plane_bytes(D as u32, true);

    #[inline(always)]
    fn at(r: u32, col: u32) -> u32 {
        swizzled(r, col, D as u32)
    }
}

impl<K: CacheFormat, const D: usize> SlabFormat<D> for Fp8Rows<K> {
    type M = crate::blocks::elem::F16;

    #[inline(always)]
    unsafe fn queries<Q: MmaHalf>(q: u64, conv: f32, head: u32) -> [[u32; 2]; 16] {
        let t4 = thread_idx_x() % 4;
        let mut f = [[0u32; 2]; 16];
        static_for::<16>(|ks| {
            // Dimensions `dim ..+ 4`, in one 8-column group.
            let dim = t4 * (D as u32 / 4) + 4 * ks as u32;
            if ks < D / 16 && dim < head {
                let w = unsafe { load8_nc(q + dim as u64 * 2) };
                f[ks] = [convert::<Q, Self::M>(w[0], conv), convert::<Q, Self::M>(w[1], conv)];
            }
        });
        f
    }

    #[inline(always)]
    unsafe fn scores<const G: usize>(q: &[[[u32; 2]; 16]; G], k: u32) -> [[f32; 4]; G] {
        let lane = thread_idx_x() % 32;
        let (g, t4) = (lane / 4, lane % 4);
        // Keys g and g + 8: D/4 bytes each from t4 * D/4.
        let mut run = [[0u32; 16]; 2];
        static_for::<2>(|j| {
            static_for::<4>(|c| {
                if c < D / 64 {
                    let w = unsafe { ld_shared_v4(k + swizzled(g + 8 * j as u32, t4 * (D as u32 / 4) + c as u32 * 16, D as u32)) };
                    static_for::<4>(|i| run[j][4 * c + i] = w[i]);
                }
            });
        });
        let mut acc = [[[0.0f32; 4]; 2]; G];
        static_for::<16>(|ks| {
            if ks < D / 16 {
                // Each word's byte pairs converted as its 16-bit halves (no shifts or masks).
                let [k0_lo, k0_hi] = Self::M::from_fp8x4::<K::Fp8>(run[0][ks]);
                let [k1_lo, k1_hi] = Self::M::from_fp8x4::<K::Fp8>(run[1][ks]);
                let a = [k0_lo, k1_lo, k0_hi, k1_hi];
                static_for::<G>(|c| acc[c][ks % 2] = Self::M::mma(a, q[c][ks][0], q[c][ks][1], acc[c][ks % 2]));
            }
        });
        core::array::from_fn(|c| core::array::from_fn(|e| acc[c][0][e] + acc[c][1][e]))
    }

    #[inline(always)]
    unsafe fn pv<const G: usize>(b: [[u32; 2]; G], o: &mut [[[f32; 4]; 16]; G], v: u32) {
        let lane = thread_idx_x() % 32;
        let (g, t4) = (lane / 4, lane % 4);
        // Keys 2t4, 2t4 + 1, 2t4 + 8, 2t4 + 9 (A's k slots), rows g and g + 8.
        let mut run = [[[0u32; 4]; 2]; 4];
        static_for::<4>(|kk| {
            let key = 2 * t4 + (kk % 2) as u32 + 8 * (kk / 2) as u32;
            static_for::<2>(|h| run[kk][h] = unsafe { Self::v_run::<D>(v, key, g + 8 * h as u32) });
        });
        static_for::<4>(|m| {
            if m < D / 64 {
                // Byte d of word m is m-tile 4m + d: (key, key + 1) pairs of bytes 0, 1 and 2, 3.
                let pairs = |x: u32, y: u32| [byte_perm(x, y, 0x5140), byte_perm(x, y, 0x7362)];
                let a_lo = [pairs(run[0][0][m], run[1][0][m]), pairs(run[0][1][m], run[1][1][m])];
                let a_hi = [pairs(run[2][0][m], run[3][0][m]), pairs(run[2][1][m], run[3][1][m])];
                // m-tiles 4m + 2i and 4m + 2i + 1 are the 16-bit halves of word i of each pair,
                // converted together (no shifts or masks).
                static_for::<2>(|i| {
                    let cvt = |w: [u32; 2]| Self::M::from_fp8x4::<K::Fp8>(w[i]);
                    let (lo0, lo1, hi0, hi1) = (cvt(a_lo[0]), cvt(a_lo[1]), cvt(a_hi[0]), cvt(a_hi[1]));
                    static_for::<2>(|h| {
                        let a = [lo0[h], lo1[h], hi0[h], hi1[h]];
                        let mt = 4 * m + 2 * i + h;
                        static_for::<G>(|c| o[c][mt] = Self::M::mma(a, b[c][0], b[c][1], o[c][mt]));
                    });
                });
            }
        });
    }

    #[inline(always)]
    fn dim(mt: u32, r: u32) -> u32 {
        r * (D as u32 / 16) + mt
    }
}

/// The online-softmax step over `N` slabs for this thread's two rows (columns 2t4, 2t4 + 1 of
/// each slab): the column max across the 8 lanes that share it (both rows' shuffles
/// interleaved, once for the `N` slabs), the accumulators' rescale when some row of the warp
/// needs it (`lazy_rescale`: a warp-uniform branch, skipped by most steps), and the weights.
/// Each lane keeps its own part of the denominators (added up after the loop).
#[inline(always)]
fn slab_softmax<const D: usize, const N: usize>(s: &mut [[f32; 4]; N], o: &mut [[f32; 4]; 16], state: &mut [OnlineSoftmax; 2], mult: f32) {
    let mut m = [s[0][0].max(s[0][2]), s[0][1].max(s[0][3])];
    static_for::<N>(|n| {
        if n > 0 {
            m = [m[0].max(s[n][0].max(s[n][2])), m[1].max(s[n][1].max(s[n][3]))];
        }
    });
    static_for::<3>(|i| {
        let lanes = 4 << i;
        let other = [shfl_xor(m[0], lanes), shfl_xor(m[1], lanes)];
        m = [m[0].max(other[0]), m[1].max(other[1])];
    });
    if must_rescale(state, m, mult) {
        static_for::<2>(|h| {
            let factor = state[h].rescale_to(m[h] * mult);
            static_for::<16>(|mt| {
                if mt < D / 16 {
                    o[mt][h] *= factor;
                    o[mt][h + 2] *= factor;
                }
            });
        });
    }
    static_for::<2>(|h| {
        let neg_max = if state[h].max == f32::NEG_INFINITY { 0.0 } else { -state[h].max };
        static_for::<N>(|n| {
            static_for::<2>(|k| {
                let w = exp2(fma(s[n][h + 2 * k], mult, neg_max));
                s[n][h + 2 * k] = w;
                state[h].sum += w;
            });
        });
    });
}

/// What one step of the key loop reads besides the staged slabs.
struct StepInputs<'a, const G: usize> {
    q: &'a [[[u32; 2]; 16]; G],
    logits: &'a Logits,
    rows: &'a [[RowInfo; 2]; G],
    pos: (u32, u32),
    mult: f32,
}

/// One step of the key loop over `N` staged slabs (stage addresses `stages`, first keys `kbs`,
/// `bad`: the slab's block is outside the cache): S^T for each, masks, one softmax step for all
/// of them, P^T through `movmatrix`, and O^T += V^T P^T slab by slab. Two slabs a step give the
/// warp two independent score chains and share the column-max shuffles, the rescale test and
/// the loop's waits between them.
#[inline(always)]
unsafe fn slab_step<F: SlabFormat<D>, const D: usize, const G: usize, const N: usize>(
    x: &StepInputs<G>,
    stages: [u32; N],
    kbs: [u32; N],
    bad: [bool; N],
    o: &mut [[[f32; 4]; 16]; G],
    state: &mut [[OnlineSoftmax; 2]; G],
) {
    // Unrolled (not `from_fn`): a loop over the slabs would put the scores in local memory.
    let mut s = [[[0.0f32; 4]; G]; N];
    static_for::<N>(|n| s[n] = unsafe { F::scores::<G>(x.q, stages[n]) });
    let mut b = [[[0u32; 2]; G]; N];
    static_for::<G>(|c| {
        let mut sc = [[0.0f32; 4]; N];
        static_for::<N>(|n| sc[n] = s[n][c]);
        static_for::<N>(|n| x.logits.apply_keys_rows(&mut sc[n], &x.rows[c], kbs[n], x.pos, bad[n]));
        slab_softmax::<D, N>(&mut sc, &mut o[c], &mut state[c], x.mult);
        // P^T as the B operand: each 8x8 block (key g, rows 2t4..) transposed to (row g, keys
        // 2t4..).
        static_for::<N>(|n| {
            let w = &sc[n];
            b[n][c] = [movmatrix_trans(F::M::pack2(w[0], w[1])), movmatrix_trans(F::M::pack2(w[2], w[3]))];
        });
    });
    let plane = plane_bytes(D as u32, F::Cache::FP8);
    static_for::<N>(|n| unsafe { F::pv::<G>(b[n], o, stages[n] + plane) });
}

/// The kernel: one CTA per (work item, kv head), as `decode_tc_*` (the host plans both alike).
/// `Q`: the queries' type; `F`: the cache's slab format; `LONG`: the variant for long requests (FP8:
/// the deep pipeline; 16-bit at width 128: two CTAs an SM, `attn_math::keys_rows::ctas_per_sm`);
/// `G`: column groups of 8 query rows (the MMA's 8 columns) over each staged slab, 1 or 2 (GQA
/// 16); `R = 8 G`, the CTA's query rows.
#[inline(always)]
unsafe fn decode_keys_rows<Q: MmaHalf, F: SlabFormat<D>, const D: usize, const LONG: bool, const G: usize, const R: u32>(p: &AttnParams) {
    const { assert!((G == 1 || G == 2) && R == 8 * G as u32) };
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let fp8 = F::Cache::FP8;
    // Programmatic dependent launch, split: the next kernel may take the SM slots this grid
    // frees from now on, and this grid waits for the one before only where it must (below).
    pdl_launch_dependents();
    let Some(w) = (unsafe { work_item(p, R, D as u32) }) else {
        pdl_wait();
        return;
    };
    let keys = unsafe { WarpSlabs::of(p, &w, warp) };

    // The launch's head size (K and V alike here), at most `D`.
    let head = p.dims.qk_or(D as u32);
    let ctas = ctas_per_sm(D as u32, fp8, LONG, R);
    let st = stages(D as u32, fp8, ctas);
    let sb = stage_bytes(D as u32, fp8);
    let smem = shared_addr(dynamic_shared::<u8>());
    let ring = smem + warp * st * sb;
    let copy = unsafe { SlabCopy::<F, D>::new(p, &w, head) };
    let lookup = |tile: u32| unsafe { keys.block(p, &copy, tile) };

    // This thread's rows of each column group (columns 2t4, 2t4 + 1) and the query fragments
    // of the group's row g (rows past `live` repeat the last one; they are never written). FP8:
    // the scales fold into the score scale (k) and the output factor (v); bf16 queries go to f16
    // scaled by 2^-8.
    let q_conv = if Q::IS_BF16 == F::M::IS_BF16 { 1.0 } else { 1.0 / 256.0 };
    let rows: [[RowInfo; 2]; G] =
        core::array::from_fn(|c| unsafe { [w.row(p, 8 * c as u32 + 2 * t4), w.row(p, 8 * c as u32 + 2 * t4 + 1)] });
    let mut q = [[[0u32; 2]; 16]; G];
    static_for::<G>(|c| {
        let q_row = unsafe { w.row(p, 8 * c as u32 + g) };
        let q_addr = p.qkv.q + (q_row.token as u64 * p.qkv.q_token_stride + q_row.head as u64 * p.qkv.q_head_stride) * 2;
        q[c] = unsafe { F::queries::<Q>(q_addr, q_conv, head) };
    });
    let (k_scale, v_scale) = unsafe { F::Cache::scales(p, w.kv_head) };
    let mut ahead = [lookup(0), lookup(1)];

    // What is read before waiting for the kernel before (in an engine, this step's cache
    // write): the work item, block ids, queries, and the cache rows of the request's context
    // before its new tokens (`fresh`), all written before that kernel started. The rows of the
    // new tokens, and every write (outputs, partials, counters, the status word), come after
    // the wait. So a call streams its context while the kernel before drains, and the next
    // call's CTAs stream theirs in the slots this call's early finishers leave.
    let fresh = w.seq_len.saturating_sub(w.q_len);
    let mut waited = false;
    let logits = Logits::new(p, p.variant.scale_log2 * k_scale / q_conv, keys.end);
    let mult = logits.mult();

    // Copies in flight: slabs 0 .. st - 2 (one commit group each, empty ones included, so that
    // "all but st - 1 groups done" always means "this slab is in").
    let mut bad_ring = 0u32;
    let mut any_bad = false;
    let mut issued = 0u32;
    let mut issue = |tile: u32, block: u32, bad_ring: &mut u32| {
        let kb = keys.key(tile);
        if tile < keys.n_tiles && kb < keys.end {
            if !waited && kb + WARP_KEYS > fresh {
                pdl_wait();
                waited = true;
            }
            let bad = unsafe { copy.copy(p, kb, block, keys.end, ring + (tile % st) * sb) };
            let bit = 1 << (tile % st);
            *bad_ring = if bad { *bad_ring | bit } else { *bad_ring & !bit };
            any_bad |= bad;
        }
        cp_async_commit();
    };
    // Two slabs a step in the two-CTA kernels whose ring has four stages or more (two read, two
    // or more in flight); one elsewhere. At three and four CTAs an SM (168 and 128 registers)
    // the pairs spilled and lost what they gained (docs/decode.md).
    let pair = st >= 4 && ctas == 2;
    let per_step = if pair { 2 } else { 1 };
    let mut next_lookup = 2;
    while issued < st - per_step {
        let block = ahead[0];
        ahead = [ahead[1], lookup(next_lookup)];
        next_lookup += 1;
        issue(issued, block, &mut bad_ring);
        issued += 1;
    }

    let mut state = [[OnlineSoftmax::EMPTY; 2]; G];
    let mut o = [[[0.0f32; 4]; 16]; G];
    let x = StepInputs { q: &q, logits: &logits, rows: &rows, pos: keys.pos, mult };
    let ring_end = ring + st * sb;
    let next_stage = |stage: u32| if stage + sb == ring_end { ring } else { stage + sb };
    let mut stage = ring;
    let mut tile = 0;
    while tile < keys.n_tiles {
        static_for::<2>(|i| {
            if i == 0 || pair {
                let block = ahead[0];
                ahead = [ahead[1], lookup(next_lookup)];
                next_lookup += 1;
                issue(issued, block, &mut bad_ring);
                issued += 1;
            }
        });
        let kb = [keys.key(tile), keys.key(tile + 1)];
        let bad = |tile: u32| bad_ring & (1 << (tile % st)) != 0;
        let second = next_stage(stage);
        if pair && tile + 1 < keys.n_tiles && kb[1] < keys.end {
            // Slabs `tile` and `tile + 1` in: at most st - 2 groups still in flight.
            wait_all_but(st - 1);
            sync_warp();
            unsafe { slab_step::<F, D, G, 2>(&x, [stage, second], kb, [bad(tile), bad(tile + 1)], &mut o, &mut state) };
        } else {
            // One slab (the last one, when pairs are taken).
            wait_all_but(st);
            sync_warp();
            if kb[0] < keys.end {
                unsafe { slab_step::<F, D, G, 1>(&x, [stage], [kb[0]], [bad(tile)], &mut o, &mut state) };
            }
        }
        // The stages are refilled next step: every lane is done reading them.
        sync_warp();
        stage = if pair { next_stage(second) } else { second };
        tile += per_step;
    }
    cp_async_wait::<0>();
    if !waited {
        pdl_wait();
    }
    if any_bad && lane == 0 {
        unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
    }

    // Epilogue: each warp's rows at the CTA's common max into the merge area (over the ring),
    // then the rows added up and written.
    let l = layout(D as u32, fp8, ctas, R);
    let (merge, stats) = (smem + l.merge, smem + l.stats);
    sync_threads();
    static_for::<G>(|c| {
        static_for::<2>(|h| {
            let state = &mut state[c][h];
            state.sum += shfl_xor(state.sum, 4);
            state.sum += shfl_xor(state.sum, 8);
            state.sum += shfl_xor(state.sum, 16);
            if g == 0 {
                let r = 8 * c as u32 + 2 * t4 + h as u32;
                unsafe { st_shared_f32x2(stats + (warp * R + r) * 8, state.max, state.sum) };
            }
        });
    });
    sync_threads();
    static_for::<G>(|c| {
        static_for::<2>(|h| {
            let r = 8 * c as u32 + 2 * t4 + h as u32;
            let state = state[c][h];
            let mut max = f32::NEG_INFINITY;
            static_for::<4>(|wp| max = max.max(unsafe { ld_shared_f32(stats + (wp as u32 * R + r) * 8) }));
            let f = if state.max == f32::NEG_INFINITY { 0.0 } else { exp2(state.max - max) };
            let row = merge + (warp * R + r) * l.merge_pitch * 4;
            static_for::<16>(|mt| {
                if mt < D / 16 {
                    unsafe {
                        st_shared_f32(row + F::dim(mt as u32, g) * 4, o[c][mt][h] * f);
                        st_shared_f32(row + F::dim(mt as u32, g + 8) * 4, o[c][mt][h + 2] * f);
                    }
                }
            });
        });
    });
    sync_threads();
    let num_splits = unsafe { w.num_splits(p) };
    unsafe { store_merged_rows::<KeysRows<Q, F, D>, R>(p, &w, merge, l.merge_pitch, stats, num_splits, v_scale) };
    if num_splits > 1 && p.schedule.merge_counters != 0 {
        // The merge area is free now: its first word carries the "last to arrive" flag.
        unsafe { merge_item_splits::<Q, D, R>(p, &w, num_splits, merge) };
    }
}

/// What the helpers shared with `crate::attention::mainloop` see of these kernels
/// ([`AttnConfig`]): its keys-split decode shape, with the cache format of `F`.
struct KeysRows<Q, F, const D: usize>(core::marker::PhantomData<(Q, F)>);

impl<Q: MmaHalf, F: SlabFormat<D>, const D: usize> AttnConfig for KeysRows<Q, F, D> {
    type Q = Q;
    type M = F::M;
    type Cache = F::Cache;
    const DK: usize = D;
    const DV: usize = D;
    const KEYS: bool = true;
}

/// A 16-bit cache, `G` column groups of 8 rows, `R = 8 G` rows a CTA (`decode_kr_<q>_d<d>`,
/// `decode_kr_<q>_r16_d<d>`); `LONG` the kernels for long requests where a width has two
/// (`decode_kr_<q>_long_d<d>`, `attn_math::keys_rows::ctas_per_sm`).
#[inline(always)]
pub unsafe fn decode_keys_rows_half<Q: MmaHalf, const D: usize, const LONG: bool, const G: usize, const R: u32>(p: &AttnParams) {
    unsafe { decode_keys_rows::<Q, HalfRows<Q>, D, LONG, G, R>(p) }
}

/// An FP8 E4M3 cache (head sizes 64, 128 and 256; `K`: `config::Fp8E4M3`, or `Fp8E4M3A8` for
/// the `_fp8_a8` kernels): `LONG` the deep-pipeline kernels (`decode_kr_<q>_fp8[_a8]_long[_r16]_d<d>`),
/// else the three- or four-CTA ones (`decode_kr_<q>_fp8[_a8]_d<d>`); `G` column groups of 8 rows
/// (2 only with `LONG`), `R = 8 G` rows a CTA. Width 64 has no deep-pipeline kernel of 8 rows,
/// width 256 only that one (`attn_math::keys_rows::FP8_DEEP_HEAD_SIZES`).
#[inline(always)]
pub unsafe fn decode_keys_rows_fp8<Q: MmaHalf, K: CacheFormat, const D: usize, const LONG: bool, const G: usize, const R: u32>(
    p: &AttnParams,
) {
    const { assert!(LONG || G == 1) };
    unsafe { decode_keys_rows::<Q, Fp8Rows<K>, D, LONG, G, R>(p) }
}
