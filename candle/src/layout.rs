//! candle layouts as the ops' row descriptions, without a copy: a tensor's strides become a
//! [`RowsDesc`]'s token and head strides, and its start offset the first element of the view
//! the op gets. Layouts the kernels cannot index (a head dimension that is not contiguous,
//! heads or tokens that overlap or interleave, broadcast dimensions) are refused, naming the
//! argument and saying to call `.contiguous()`.

use crate::error::{ensure, invalid};
use attn_rs::RowsDesc;
use candle_core::{Layout, Result};

/// Why a layout is refused, and what to do.
fn not_rows(arg: &str, layout: &Layout, what: &str) -> candle_core::Error {
    invalid(
        arg,
        format!(
            "shape {:?} with strides {:?} is not {what} (contiguous head dimension; heads and tokens neither overlapping nor \
             interleaved): call `.contiguous()` on it first",
            layout.dims(),
            layout.stride()
        ),
    )
}

/// `[num_tokens, num_heads, head_size]` rows of a tensor shaped `[T, H, D]` (with `D ==
/// head_size`) or `[T, H * D]`: its strides in elements, its start offset apart.
pub(crate) fn rows(arg: &str, layout: &Layout, head_size: usize) -> Result<RowsDesc> {
    ensure(head_size > 0, arg, || "head size 0".into())?;
    let (dims, strides) = (layout.dims(), layout.stride());
    // (tokens, heads, token stride, head stride, element stride)
    let (t, h, ts, hs, es) = match *dims {
        [t, h, d] => {
            ensure(d == head_size, arg, || format!("shape {dims:?}: last dimension {d}, expected head size {head_size}"))?;
            (t, h, strides[0], strides[1], strides[2])
        }
        [t, w] => {
            ensure(w % head_size == 0, arg, || format!("shape {dims:?}: width {w} is not a multiple of the head size {head_size}"))?;
            (t, w / head_size, strides[0], head_size * strides[1], strides[1])
        }
        _ => return Err(invalid(arg, format!("shape {dims:?}: expected [tokens, heads, {head_size}] or [tokens, heads * {head_size}]"))),
    };
    let d = head_size;
    // A dimension of one element has no stride that matters: give it the dense one.
    let hs = if h <= 1 { d } else { hs };
    let span = (h.max(1) - 1).saturating_mul(hs).saturating_add(d);
    let ts = if t <= 1 { span } else { ts };
    let ok = (es == 1 || d == 1) && (h <= 1 || hs >= d) && (t <= 1 || ts >= span);
    if !ok {
        return Err(not_rows(arg, layout, "rows of heads"));
    }
    let desc = RowsDesc { num_tokens: t, num_heads: h, head_size: d, token_stride: ts, head_stride: hs };
    desc.validate("rows").map_err(|_| not_rows(arg, layout, "rows of heads"))?;
    Ok(desc)
}

/// `(num_tokens, token_stride)` of latent rows of `dim` elements: a tensor shaped `[T, dim]` or
/// `[T, 1, dim]` (MLA's `kv_c` and `k_pe`).
pub(crate) fn latent_rows(arg: &str, layout: &Layout, dim: usize) -> Result<(usize, usize)> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let (t, w, ts, es) = match *dims {
        [t, w] => (t, w, strides[0], strides[1]),
        [t, 1, w] => (t, w, strides[0], strides[2]),
        _ => return Err(invalid(arg, format!("shape {dims:?}: expected [tokens, {dim}] or [tokens, 1, {dim}]"))),
    };
    ensure(w == dim, arg, || format!("shape {dims:?}: rows of {w}, expected {dim}"))?;
    let ts = if t <= 1 { dim } else { ts };
    if !((es == 1 || dim <= 1) && (t <= 1 || ts >= dim)) {
        return Err(not_rows(arg, layout, "latent rows"));
    }
    Ok((t, ts))
}

/// The first dimension of a tensor (its tokens, or requests).
pub(crate) fn leading(arg: &str, layout: &Layout) -> Result<usize> {
    layout.dims().first().copied().ok_or_else(|| invalid(arg, "a scalar: expected rows"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, IndexOp, Tensor};

    fn layout_of(t: &Tensor) -> Layout {
        t.layout().clone()
    }

    #[test]
    fn contiguous_and_sliced_rows() {
        let qkv = Tensor::zeros((5, 6, 4), DType::F32, &Device::Cpu).unwrap();
        let k = qkv.narrow(1, 2, 2).unwrap();
        let r = rows("k", &layout_of(&k), 4).unwrap();
        assert_eq!((r.num_tokens, r.num_heads, r.token_stride, r.head_stride), (5, 2, 24, 4));
        assert_eq!(k.layout().start_offset(), 8);
        let flat = Tensor::zeros((5, 24), DType::F32, &Device::Cpu).unwrap().narrow(1, 8, 8).unwrap();
        let r = rows("k", &layout_of(&flat), 4).unwrap();
        assert_eq!((r.num_heads, r.token_stride, r.head_stride), (2, 24, 4));
    }

    #[test]
    fn refused_layouts_name_the_argument() {
        let t = Tensor::zeros((4, 3, 8), DType::F32, &Device::Cpu).unwrap();
        // Heads before tokens: tokens interleave with heads.
        let hnd = Tensor::zeros((3, 4, 8), DType::F32, &Device::Cpu).unwrap().transpose(0, 1).unwrap();
        let e = rows("q", &layout_of(&hnd), 8).unwrap_err().to_string();
        assert!(e.contains("`q`") && e.contains(".contiguous()"), "{e}");
        // Head dimension not contiguous.
        let strided = t.transpose(1, 2).unwrap();
        assert!(rows("v", &layout_of(&strided), 3).is_err());
        // Broadcast tokens.
        let b = t.i(0..1).unwrap().broadcast_as((4, 3, 8)).unwrap();
        assert!(rows("k", &layout_of(&b), 8).unwrap_err().to_string().contains("`k`"));
        // Wrong head size.
        assert!(rows("k", &layout_of(&t), 4).is_err());
    }

    #[test]
    fn latent_layouts() {
        let t = Tensor::zeros((3, 40), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(latent_rows("kv_c", &layout_of(&t.narrow(1, 0, 32).unwrap()), 32).unwrap(), (3, 40));
        assert_eq!(latent_rows("k_pe", &layout_of(&t.narrow(1, 32, 8).unwrap().unsqueeze(1).unwrap()), 8).unwrap(), (3, 40));
        assert!(latent_rows("kv_c", &layout_of(&t.t().unwrap()), 3).is_err());
    }
}
