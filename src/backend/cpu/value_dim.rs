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
/// is wider, the first `to` columns when narrower (a borrowed view where the widths agree).
fn reshape_rows(x: HostView, cols: usize, to: usize) -> HostData {
    let es = x.dtype().size();
    let (src, (sb, tb)) = (x.as_bytes(), (cols * es, to * es));
    let rows = if sb == 0 { 0 } else { src.len() / sb };
    let mut out = vec![0u8; rows * tb];
    let keep = sb.min(tb);
    for (o, s) in out.chunks_exact_mut(tb.max(1)).zip(src.chunks_exact(sb.max(1))) {
        o[..keep].copy_from_slice(&s[..keep]);
    }
    HostData::from_bytes(x.dtype(), &out)
}

/// The forward of the mixed-head_dim `spec` through `run` on its uniform spec `u`.
pub(super) fn forward(spec: &AttnSpec, u: &AttnSpec, q: HostView, k: HostView, v: HostView, run: impl FnOnce(&AttnSpec, HostView, HostView, HostView) -> ForwardOutput) -> ForwardOutput {
    let (d, w) = (spec.dims, u.dims.head_dim);
    let (qw, kw, vw) = (reshape_rows(q, d.head_dim, w), reshape_rows(k, d.head_dim, w), reshape_rows(v, d.head_dim_v, w));
    let r = run(u, qw.view(), kw.view(), vw.view());
    ForwardOutput { out: reshape_rows(r.out.view(), w, d.head_dim_v), lse: r.lse }
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
    let (qw, kw, vw) = (reshape_rows(q, d.head_dim, w), reshape_rows(k, d.head_dim, w), reshape_rows(v, d.head_dim_v, w));
    let (ow, gw) = (reshape_rows(g.out, d.head_dim_v, w), reshape_rows(g.dout, d.head_dim_v, w));
    let gu = BackwardInputs { out: ow.view(), dout: gw.view(), ..g };
    let r = run(u, qw.view(), kw.view(), vw.view(), gu);
    Gradients {
        dq: reshape_rows(r.dq.view(), w, d.head_dim),
        dk: reshape_rows(r.dk.view(), w, d.head_dim),
        dv: reshape_rows(r.dv.view(), w, d.head_dim_v),
    }
}
