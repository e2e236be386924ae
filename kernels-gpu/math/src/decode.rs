//! Launch geometry of the paged decode kernel, shared by the kernel and the host.

/// Threads per CTA (4 warps).
pub const THREADS: u32 = 128;
pub const WARPS: usize = (THREADS / 32) as usize;

/// Dynamic shared memory of a CTA: the queries (f32) and one accumulator row per warp and row
/// (head_size values + max + sum) for the cross-warp merge.
pub const fn shared_bytes(rows: usize, head_size: usize) -> usize {
    4 * (rows * head_size + WARPS * rows * (head_size + 2))
}

/// Head sizes with kernels.
pub const HEAD_SIZES: [u32; 4] = [64, 96, 128, 256];

/// The largest rows-per-CTA instance for a head size (accumulators must stay in registers:
/// rows x head_size / 8 floats per lane).
pub const fn max_rows_per_cta(head_size: u32) -> u32 {
    match head_size {
        64 => 8,
        96 | 128 => 4,
        _ => 2,
    }
}

/// Rows per CTA for `rows` query rows per kv head: the smallest instance that holds them all,
/// or the largest one (then the rows run as several CTAs).
pub fn rows_per_cta(rows: u32, head_size: u32) -> u32 {
    rows.next_power_of_two().min(max_rows_per_cta(head_size))
}
