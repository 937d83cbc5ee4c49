//! Calls whose v has a head_dim of its own ([`crate::spec::Dims::head_dim_v`], as DeepSeek's MLA
//! with 192 / 128): the CPU kernels pack K and V panels at one width, so the call runs at the
//! wider head_dim, the narrower tensors with zero columns after the caller's, and the outputs are
//! cut back to the caller's widths. Zero columns add nothing to q.k and give zero columns of out,
//! dq, dk and dv, and the scale stays the caller's (resolved from q's head_dim): the result is the
//! call's, not an approximation.

use crate::backend::{BackwardInputs, ForwardOutput, Gradients};
use crate::dtype::{HostData, HostView};
use crate::spec::AttnSpec;

/// `spec` at one head_dim (the wider of q's and v's), or `None` where v has q's head_dim.
pub(super) fn uniform(spec: &AttnSpec) -> Option<AttnSpec> {
    let d = spec.dims;
    if d.is_uniform() {
        return None;
    }
    let mut s = spec.clone();
    s.dims = d.at_head_dim(d.head_dim.max(d.head_dim_v));
    Some(s)
}

/// Rows of `cols` elements of `x` as rows of `to` elements: zero columns after each row when `to`
/// is wider, the first `to` columns when narrower; `None` where the widths agree (`x` serves as
/// it is).
fn reshape_rows(x: HostView, cols: usize, to: usize) -> Option<HostData> {
    if cols == to {
        return None;
    }
    let es = x.dtype().size();
    let (src, (sb, tb)) = (x.as_bytes(), (cols * es, to * es));
    let rows = if sb == 0 { 0 } else { src.len() / sb };
    let mut out = vec![0u8; rows * tb];
    let keep = sb.min(tb);
    for (o, s) in out.chunks_exact_mut(tb.max(1)).zip(src.chunks_exact(sb.max(1))) {
        o[..keep].copy_from_slice(&s[..keep]);
    }
    Some(HostData::from_bytes(x.dtype(), &out))
}

/// An input at the uniform width `to` (its copy, or itself where it has that width already).
struct Widened<'a>(HostView<'a>, Option<HostData>);

impl<'a> Widened<'a> {
    fn new(x: HostView<'a>, cols: usize, to: usize) -> Self {
        Widened(x, reshape_rows(x, cols, to))
    }

    fn view(&self) -> HostView<'_> {
        self.1.as_ref().map_or(self.0, |d| d.view())
    }
}

/// An output of the uniform call cut back to the caller's `cols` (itself where they agree).
fn narrowed(x: HostData, w: usize, cols: usize) -> HostData {
    reshape_rows(x.view(), w, cols).unwrap_or(x)
}

/// The forward of the mixed-head_dim `spec` through `run` on its uniform spec `u`.
pub(super) fn forward(spec: &AttnSpec, u: &AttnSpec, q: HostView, k: HostView, v: HostView, run: impl FnOnce(&AttnSpec, HostView, HostView, HostView) -> ForwardOutput) -> ForwardOutput {
    let (d, w) = (spec.dims, u.dims.head_dim);
    let (qw, kw, vw) = (Widened::new(q, d.head_dim, w), Widened::new(k, d.head_dim, w), Widened::new(v, d.head_dim_v, w));
    let r = run(u, qw.view(), kw.view(), vw.view());
    ForwardOutput { out: narrowed(r.out, w, d.head_dim_v), lse: r.lse }
}

/// The backward of the mixed-head_dim `spec` through `run` on its uniform spec `u`.
pub(super) fn backward(
    spec: &AttnSpec,
    u: &AttnSpec,
    q: HostView,
    k: HostView,
    v: HostView,
    g: BackwardInputs,
    run: impl FnOnce(&AttnSpec, HostView, HostView, HostView, BackwardInputs) -> Gradients,
) -> Gradients {
    let (d, w) = (spec.dims, u.dims.head_dim);
    let (qw, kw, vw) = (Widened::new(q, d.head_dim, w), Widened::new(k, d.head_dim, w), Widened::new(v, d.head_dim_v, w));
    let (ow, gw) = (Widened::new(g.out, d.head_dim_v, w), Widened::new(g.dout, d.head_dim_v, w));
    let gu = BackwardInputs { out: ow.view(), dout: gw.view(), ..g };
    let r = run(u, qw.view(), kw.view(), vw.view(), gu);
    Gradients { dq: narrowed(r.dq, w, d.head_dim), dk: narrowed(r.dk, w, d.head_dim), dv: narrowed(r.dv, w, d.head_dim_v) }
}
