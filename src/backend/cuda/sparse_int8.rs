//! CUDA INT8 Q K^T of the block-sparse forward: the workspace, the quantisation launches
//! (`kernels::int8_qk`) and the operands they hand to the forward kernel (`int8 = true`).
//!
//! All on the caller's stream, in the caller's workspace ([`int8_workspace`] bytes), no host
//! synchronisation: (with K smoothing) K's chunk sums and mean, then Q and K quantised per block
//! (int8 rows, scales, Q's LSE correction), then the forward.

use cubecl::cuda::CudaRuntime;
use cudarc::driver::sys;
use half::{bf16, f16};

use super::compile::{codegen, settings, Func, KernelKey, A};
use super::forward::{layout, FwdPtrs};
use super::driver::byte_map_2d_sw64;
use super::launch::{launch, Args, MapArg};
use super::CudaBackend;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::chunk_stats::CHUNK_THREADS;
use crate::kernels::fp8_v::{self, vt_row_bytes, VT_CHUNK, VT_THREADS};
use crate::kernels::int8_qk::{self, quant_rows, MEAN_CHUNK, QUANT_CUBES_PER_SM, QUANT_THREADS, QUANT_VEC};
use crate::sparse::{GroupRule, Int8Qk};
use crate::spec::SparseView;

/// Workspace parts, in order: int8 Q, int8 K, Q scales + LSE corrections (+ with FP8 P.V the V
/// scales and their inverses, `fp8_v`), K scales, K chunk sums, K mean, and with FP8 P.V: V^T in
/// e4m3, V's chunk maxima.
fn parts(spec: SparseView) -> [usize; 8] {
    let d = &spec.attn.dims;
    let (tq, tk, hq, hkv, hd) = (d.total_q, d.total_k, d.heads_q, d.heads_kv, d.head_dim);
    let batch = spec.attn.segments.len();
    let chunks = spec.attn.max_seqlen_k.div_ceil(MEAN_CHUNK).max(1);
    let fp8 = spec.int8.is_some_and(|o| o.pv_fp8);
    let nv = if fp8 { batch * hkv * hd } else { 0 };
    let vt = if fp8 { hkv * hd * vt_row_bytes(tk, batch) } else { 0 };
    let vchunks = spec.attn.max_seqlen_k.div_ceil(VT_CHUNK).max(1);
    [
        tq * hq * hd,
        tk * hkv * hd,
        (2 * hq * tq + 2 * nv) * 4,
        tk * hkv * 4,
        chunks * batch * hkv * hd * 4,
        batch * hkv * hd * 4,
        vt,
        if fp8 { vchunks * nv * 4 } else { 0 },
    ]
}

/// Workspace bytes of a block-sparse forward of `spec` on CUDA (0 without the INT8 option).
pub fn int8_workspace(spec: SparseView) -> usize {
    if spec.int8.is_none() {
        return 0;
    }
    layout(&parts(spec)).1
}

/// Device addresses of the quantised operands (inside the workspace).
pub(crate) struct Int8Operands {
    pub q8: u64,
    pub k8: u64,
    pub q_scale: u64,
    pub k_scale: u64,
    /// FP8 P.V: V^T in e4m3 and its row bytes (`fp8_v`; 0, 0 without it).
    pub vt: u64,
    pub vt_row_bytes: usize,
}

impl Int8Operands {
    /// The tensor map of V^T in e4m3 (`heads_kv * head_dim` rows of `vt_row_bytes`, 64-byte
    /// boxes of `head_dim` rows, 64-byte swizzled: `kernels::fp8_v`).
    pub(crate) fn vt_map(&self, heads_kv: usize, head_dim: usize) -> Result<MapArg> {
        let rows = heads_kv * head_dim;
        let map = byte_map_2d_sw64(self.vt, self.vt_row_bytes, rows, self.vt_row_bytes, head_dim as u32)?;
        Ok(MapArg { map, ptr: self.vt, rows, cols: self.vt_row_bytes })
    }
}

/// One quantisation launch: Q or K rows (addresses of the input, the int8 rows and the scales).
struct Rows {
    x: u64,
    xq: u64,
    sc: u64,
    total: usize,
    heads: usize,
    /// q heads per kv head (Q), 1 (K)
    group: usize,
    block: usize,
    max_len: usize,
    rule: GroupRule,
    is_k: bool,
}

fn kernel(be: &CudaBackend, name: &'static str, dt: DType, p: &[u32], src: impl FnOnce() -> Result<super::compile::Source>) -> Result<Func> {
    be.kernels.get(&KernelKey::new(name, dt, p), src)
}

/// Enqueues the quantisation of Q and K of `spec` (option `opt`) into `workspace` on `stream`.
/// `segs` is the plan's sequence table (device address, u32 words). `natural`: the int8 rows in
/// channel order (the Hopper kernel's wgmma operands), else in `flash_fwd_mma2`'s word order.
/// `flag`: the call's non-finite-v flag, zeroed; with FP8 P.V the V maxima pass sets it (the
/// caller skips `v_nonfinite`'s scan of v, [`scans_v`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize(
    be: &CudaBackend,
    spec: SparseView,
    opt: Int8Qk,
    p: &FwdPtrs,
    segs: (u64, usize),
    natural: bool,
    flag: u64,
    stream: sys::CUstream,
) -> Result<Int8Operands> {
    let d = &spec.attn.dims;
    let (tq, tk, hq, hkv, hd) = (d.total_q, d.total_k, d.heads_q, d.heads_kv, d.head_dim);
    let dt = spec.attn.dtype;
    let client = be.client();
    let batch = spec.attn.segments.len();
    let chunks = spec.attn.max_seqlen_k.div_ceil(MEAN_CHUNK).max(1);
    let pr = parts(spec);
    let (offs, _) = layout(&pr);
    let at = |i: usize| p.workspace + offs[i] as u64;
    let (q8, k8, qsc, ksc, sums, mean) = (at(0), at(1), at(2), at(3), at(4), at(5));
    if opt.smooth_k {
        let f = kernel(be, "chunk_stats", dt, &[hd as u32, 0], || chunk_source(client, dt, hd, false))?;
        let mut a = Args::new();
        a.array(p.k, (d.kv_len() / 8).max(1)).array(sums, pr[4] / 4).array(flag, 1).array(segs.0, segs.1).u32(hkv as u32);
        launch(&f, (chunks as u32, batch as u32, hkv as u32), &mut a, stream)?;
        let f = kernel(be, "int8_k_mean", DType::F32, &[hd as u32], || {
            codegen(int8_qk::int8_k_mean::Int8KMean::<CudaRuntime>::new(settings(hd as u32), client.clone(), A, A, A, (), (), hd))
        })?;
        let mut a = Args::new();
        a.array(sums, pr[4] / 4).array(mean, pr[5] / 4).array(segs.0, segs.1).u32(hkv as u32).u32(chunks as u32);
        launch(&f, (batch as u32, hkv as u32, 1), &mut a, stream)?;
    }
    let runs = [
        Rows { x: p.q, xq: q8, sc: qsc, total: tq, heads: hq, group: hq / hkv, block: spec.q_block, max_len: spec.attn.max_seqlen_q, rule: opt.gran.q_rule(spec.q_block), is_k: false },
        Rows { x: p.k, xq: k8, sc: ksc, total: tk, heads: hkv, group: 1, block: spec.k_block, max_len: spec.attn.max_seqlen_k, rule: opt.gran.k_rule(spec.k_block), is_k: true },
    ];
    for Rows { x, xq, sc, total, heads, group, block, max_len, rule, is_k } in runs {
        let smooth = opt.smooth_k;
        // the group rule as constants (0: the whole block)
        let g = if rule.chunk == block && rule.period == block && rule.width == block { [0, 0, 0] } else { [rule.chunk, rule.period, rule.width] };
        let rows = quant_rows(block);
        let f = kernel(be, "int8_quantize", dt, &[hd as u32, is_k as u32, smooth as u32, natural as u32, g[0] as u32, g[1] as u32, g[2] as u32, rows as u32], || {
            quantize_source(client, dt, hd, is_k, smooth, natural, g, rows)
        })?;
        let mut a = Args::new();
        a.array(x, (total * heads * hd / QUANT_VEC).max(1)).array(mean, pr[5] / 4).array(xq, (total * heads * hd / 4).max(1));
        a.array(sc, if is_k { tk * hkv } else { 2 * hq * tq }.max(1));
        // the LSE corrections follow the Q scales (K writes none)
        a.array(qsc + (hq * tq * 4) as u64, (hq * tq).max(1)).array(segs.0, segs.1);
        a.u32(heads as u32).u32(total as u32).u32(group as u32).u32(block as u32);
        a.f32(spec.attn.scale);
        let grid = (max_len.div_ceil(block).max(1) as u32, batch as u32, heads as u32);
        launch(&f, grid, &mut a, stream)?;
    }
    let (mut vt, mut vt_row) = (0, 0);
    if opt.pv_fp8 {
        // V's scales after the Q scales and LSE corrections (the forward reads them there)
        let nv = batch * hkv * hd;
        let vsc = qsc + (2 * hq * tq * 4) as u64;
        vt = at(6);
        vt_row = vt_row_bytes(tk, batch);
        let vchunks = spec.attn.max_seqlen_k.div_ceil(VT_CHUNK).max(1);
        let part = at(7);
        // V's maxima, and the non-finite-v flag (the host zeroed it; `launch_flag` without its scan)
        let f = kernel(be, "chunk_stats", dt, &[hd as u32, 1], || chunk_source(client, dt, hd, true))?;
        let mut a = Args::new();
        a.array(p.v, (d.kv_len() / 8).max(1)).array(part, vchunks * nv).array(flag, 1).array(segs.0, segs.1).u32(hkv as u32);
        launch(&f, (vchunks as u32, batch as u32, hkv as u32), &mut a, stream)?;
        let f = kernel(be, "fp8_v_scales", DType::F32, &[hd as u32], || {
            codegen(fp8_v::fp8_v_scales::Fp8VScales::<CudaRuntime>::new(settings(hd as u32), client.clone(), A, A, A, (), (), (), hd))
        })?;
        let mut a = Args::new();
        a.array(part, vchunks * nv).array(vsc, 2 * nv).array(segs.0, segs.1).u32(hkv as u32).u32(vchunks as u32).u32(nv as u32);
        launch(&f, (batch as u32, hkv as u32, 1), &mut a, stream)?;
        let f = kernel(be, "fp8_v_quantize", dt, &[hd as u32], || vt_source(client, dt, hd))?;
        let mut a = Args::new();
        a.array(p.v, (d.kv_len() / 8).max(1)).array(vsc, 2 * nv).array(vt, (hkv * hd * vt_row / 4).max(1)).array(segs.0, segs.1);
        a.u32(hkv as u32).u32((vt_row / 4) as u32).u32(nv as u32);
        launch(&f, (vchunks as u32, batch as u32, hkv as u32), &mut a, stream)?;
    }
    Ok(Int8Operands { q8, k8, q_scale: qsc, k_scale: ksc, vt, vt_row_bytes: vt_row })
}

/// Whether the quantisation with `opt` reads all of v and sets the non-finite-v flag itself (FP8
/// P.V: V's maxima pass).
pub(crate) fn scans_v(opt: Option<Int8Qk>) -> bool {
    opt.is_some_and(|o| o.pv_fp8)
}

/// CUDA source of `chunk_stats`: K's column sums (`absmax` false) or V's maxima of |v| and the
/// non-finite-v flag (`absmax`).
pub(crate) fn chunk_source(client: &cubecl::prelude::ComputeClient<CudaRuntime>, dt: DType, hd: usize, absmax: bool) -> Result<super::compile::Source> {
    use crate::kernels::chunk_stats::chunk_stats::ChunkStats;
    let s = settings(CHUNK_THREADS as u32);
    if dt == DType::F16 {
        codegen(ChunkStats::<f16, CudaRuntime>::new(s, client.clone(), A, A, A, A, (), 4, hd, absmax))
    } else {
        codegen(ChunkStats::<bf16, CudaRuntime>::new(s, client.clone(), A, A, A, A, (), 4, hd, absmax))
    }
}

/// CUDA source of the FP8 V^T kernel (`fp8_v::fp8_v_quantize`; its e4m3 conversions lowered by
/// `rewrite::sm90`).
pub(crate) fn vt_source(client: &cubecl::prelude::ComputeClient<CudaRuntime>, dt: DType, hd: usize) -> Result<super::compile::Source> {
    let s = settings(VT_THREADS as u32);
    let mut src = if dt == DType::F16 {
        codegen(fp8_v::fp8_v_quantize::Fp8VQuantize::<f16, CudaRuntime>::new(s, client.clone(), A, A, A, A, (), (), (), 4, hd))
    } else {
        codegen(fp8_v::fp8_v_quantize::Fp8VQuantize::<bf16, CudaRuntime>::new(s, client.clone(), A, A, A, A, (), (), (), 4, hd))
    }?;
    src.cuda = super::rewrite::sm90::lower(&src.entry, &src.cuda)?;
    Ok(src)
}

/// CUDA source of the quantisation kernel (`int8_qk::int8_quantize`) for Q (`is_k = false`) or K,
/// its rows in channel order (`natural`) or in the mma.sync word order, the group rule `g`
/// (chunk, period, width; chunk 0: the whole block; else powers of two, `width <= period <= chunk
/// <= rows`), tiles of `rows` rows (`int8_qk::quant_rows`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_source(
    client: &cubecl::prelude::ComputeClient<CudaRuntime>,
    dt: DType,
    hd: usize,
    is_k: bool,
    smooth: bool,
    natural: bool,
    g: [usize; 3],
    rows: usize,
) -> Result<super::compile::Source> {
    let [chunk, period, width] = g;
    assert!(
        chunk == 0 || ([chunk, period, width].iter().all(|v| v.is_power_of_two()) && width <= period && period <= chunk && chunk <= rows),
        "int8_quantize: group rule {g:?} with {rows}-row tiles"
    );
    assert!(rows.is_multiple_of(QUANT_THREADS * QUANT_VEC / hd), "int8_quantize: {rows}-row tiles at head_dim {hd}");
    let s = settings(QUANT_THREADS as u32);
    let mut src = if dt == DType::F16 {
        codegen(int8_qk::int8_quantize::Int8Quantize::<f16, CudaRuntime>::new(s, client.clone(), A, A, A, A, A, A, (), (), (), (), (), 4, hd, is_k, smooth, natural, chunk, period, width, rows, false))
    } else {
        codegen(int8_qk::int8_quantize::Int8Quantize::<bf16, CudaRuntime>::new(s, client.clone(), A, A, A, A, A, A, (), (), (), (), (), 4, hd, is_k, smooth, natural, chunk, period, width, rows, true))
    }?;
    src.cuda = super::rewrite::min_blocks(&src.entry, &src.cuda, QUANT_CUBES_PER_SM)?;
    Ok(src)
}
