//! Hopper (sm_90a) instructions that CubeCL 0.10 cannot express, as named intrinsics of `#[cube]`
//! code: the warpgroup MMA (`wgmma.mma_async` with shared-memory operands or a register A operand,
//! its fence / commit / wait), the generic-to-async proxy fence, the GPU-scope fence of counters
//! between cubes, and the turn counters that order bulk additions across cubes.
//!
//! Each intrinsic registers one marker in the kernel's IR: a `printf` whose format string is
//! [`MARK`] followed by the instruction's name and its compile-time parameters, and whose
//! arguments are the operands (local arrays, shared buffers, element offsets). CubeCL's CUDA
//! generator prints it as one statement, `printf("<MARK><name>", a,b,...);`, in program order, and
//! does not otherwise optimise the kernel (its CUDA path runs only the shared-memory analysis), so
//! a local array passed here is the very array the kernel reads afterwards. The one place that
//! lowers the markers to inline PTX is `backend::cuda::rewrite::sm90`; it refuses a kernel with a
//! marker it does not know, and a kernel built with it must contain no `printf` left over.
//!
//! Shared operands are 128-byte-swizzled tiles (what a tensor-map copy with
//! `CU_TENSOR_MAP_SWIZZLE_128B` writes, and what [`swizzle_128b`] computes for thread copies):
//! 64-element (128-byte) column chunks, each a run of rows 128 bytes apart, chunks `chunk_bytes`
//! apart, every buffer 1024-byte aligned. The accumulator of an `m64nN` MMA is `N / 2` f32 per
//! thread of the warpgroup in the `mma.sync` m16n8 C layout repeated `N / 8` times (warp `w` of the
//! group owns rows `16 w ..`), so mask and softmax code written for the m16n8 layout serves both.

use cubecl::prelude::*;

/// Prefix of every marker's format string.
pub const MARK: &str = "__cubeattn_sm90:";

/// Bytes of one swizzled row of a chunk (64 f16/bf16 elements).
pub const SW_ROW: usize = 128;
/// Elements of one chunk row.
pub const SW_COLS: usize = 64;

fn marker(scope: &mut Scope, text: String, args: Vec<cubecl::ir::Variable>) {
    cubecl::frontend::printf_expand(scope, format!("{MARK}{text}"), args);
}

fn elem_name<E: CubePrimitive>(scope: &Scope) -> &'static str {
    let ty = format!("{:?}", E::as_type(scope)).to_lowercase();
    if ty.contains("bf16") {
        "bf16"
    } else if ty.contains("f16") {
        "f16"
    } else {
        panic!("wgmma: f16 or bf16 operands only, not {ty}")
    }
}

/// `wgmma.fence`: orders this thread's earlier register writes (accumulators, register A operands)
/// before the warpgroup MMAs issued after it.
#[cube]
pub fn wgmma_fence() {
    intrinsic!(|scope| marker(scope, "fence".into(), vec![]))
}

/// `wgmma.commit_group`: closes the MMAs issued since the last commit into one group.
#[cube]
pub fn wgmma_commit() {
    intrinsic!(|scope| marker(scope, "commit".into(), vec![]))
}

/// `wgmma.wait_group pending`: waits until at most `pending` committed groups are in flight.
#[cube]
#[allow(unused_variables)]
pub fn wgmma_wait(#[comptime] pending: u32) {
    intrinsic!(|scope| marker(scope, format!("wait {pending}"), vec![]))
}

/// `fence.proxy.async.shared::cta`: makes this thread's generic-proxy shared-memory writes
/// (st.shared, cp.async) visible to the async proxy (wgmma operands, bulk copies).
#[cube]
pub fn fence_proxy_async() {
    intrinsic!(|scope| marker(scope, "proxy_fence".into(), vec![]))
}

/// `fence.acq_rel.gpu` (CUDA's `__threadfence`): orders this thread's global-memory accesses
/// before it against those after it at GPU scope, so that a cube's stores reach the other cubes
/// before its atomic arrival on a counter, and the reads after an arrival see theirs.
#[cube]
pub fn fence_gpu() {
    intrinsic!(|scope| marker(scope, "gpu_fence".into(), vec![]))
}

/// `setmaxnreg.inc` (`inc`) or `.dec` to `regs` registers a thread (a multiple of 8 in 24..=256)
/// for the executing warpgroup: the warp-specialised frame gives its producer few and its
/// consumers many. The kernel needs a min-blocks launch bound (`rewrite::min_blocks`), else ptxas
/// drops the instruction (HOPPER_NOTES.md); every thread of the warpgroup executes it.
#[cube]
#[allow(unused_variables)]
pub fn setmaxnreg(#[comptime] inc: bool, #[comptime] regs: u32) {
    intrinsic!(|scope| marker(scope, format!("setmaxnreg {} {regs}", if inc { "inc" } else { "dec" }), vec![]))
}

/// `bar.sync id, threads`: the named barrier `id` (1..=15; 0 is the cube's) over `threads` threads
/// (a multiple of 32), the warps of a subset of the cube (the consumer warpgroups).
#[cube]
#[allow(unused_variables)]
pub fn named_barrier(#[comptime] id: u32, #[comptime] threads: u32) {
    intrinsic!(|scope| marker(scope, format!("named_barrier {id} {threads}"), vec![]))
}

/// `bar.sync id, threads` with the barrier `id` (1..=15) known only at run time (uniform over the
/// warps that meet): a consumer warpgroup's own barrier, `threads` a multiple of 32.
#[cube]
#[allow(unused_variables)]
pub fn named_barrier_at(id: u32, #[comptime] threads: u32) {
    intrinsic!(|scope| marker(scope, format!("named_barrier_at {threads}"), vec![*id.expand]))
}

/// `acc[acc0 .. acc0 + n / 2] (+)= A B` for one m64 x n x k16 step, both operands in shared memory
/// (128-byte swizzle): A is 64 rows, K-major (`a_mn` false: rows 128 bytes apart per 64 columns of
/// K), or MN-major (`a_mn`: the 64 rows contiguous, K rows 128 bytes apart, as dS^T stored
/// key-major for dQ = dS K; `a_lbo` the bytes between 64-row chunks), its first element at
/// `a_off` of `a`; B is `n`
/// rows of K (K-major, `b_mn` false: B^T stored row-major, as K for S = Q K^T) or `n` columns
/// (`b_mn`: MN-major, rows of B stored 128 bytes apart per 64 columns, column chunks `b_lbo`
/// bytes apart, as V for O = P V), its first element at `b_off` of `b`. `accumulate` false
/// overwrites the accumulator (the scale-d predicate), else adds to it.
#[cube]
#[allow(clippy::too_many_arguments, unused_variables)]
pub fn wgmma_ss<E: Float>(
    acc: &mut Array<f32>,
    a: &SharedMemory<E>,
    a_off: u32,
    b: &SharedMemory<E>,
    b_off: u32,
    #[comptime] acc0: usize,
    #[comptime] n: usize,
    #[comptime] a_mn: bool,
    #[comptime] a_lbo: u32,
    #[comptime] b_mn: bool,
    #[comptime] b_lbo: u32,
    #[comptime] accumulate: bool,
) {
    intrinsic!(|scope| {
        let t = elem_name::<E>(scope);
        let args = vec![*acc.expand, *a.expand, *a_off.expand, *b.expand, *b_off.expand];
        marker(
            scope,
            format!("wgmma_ss {t} {n} {acc0} {} {a_lbo} {} {b_lbo} {}", a_mn as u32, b_mn as u32, accumulate as u32),
            args,
        )
    })
}

/// `acc[acc0 .. acc0 + n / 2] (+)= A B` for one m64 x n x k16 step with A from registers: the
/// four packed pairs `a_regs[a0 .. a0 + 4]` (the m16n8k16 A fragment of this thread's warp, which
/// is the f32 accumulator layout of two n8 blocks packed to pairs); B in shared memory as for
/// [`wgmma_ss`].
#[cube]
#[allow(clippy::too_many_arguments, unused_variables)]
pub fn wgmma_rs<E: Float>(
    acc: &mut Array<f32>,
    a_regs: &Array<Vector<E, Const<2>>>,
    b: &SharedMemory<E>,
    b_off: u32,
    #[comptime] acc0: usize,
    #[comptime] a0: usize,
    #[comptime] n: usize,
    #[comptime] b_mn: bool,
    #[comptime] b_lbo: u32,
    #[comptime] accumulate: bool,
) {
    intrinsic!(|scope| {
        let t = elem_name::<E>(scope);
        let args = vec![*acc.expand, *a_regs.expand, *b.expand, *b_off.expand];
        marker(
            scope,
            format!("wgmma_rs {t} {n} {acc0} {a0} {} {b_lbo} {}", b_mn as u32, accumulate as u32),
            args,
        )
    })
}

/// `acc[0 .. n / 2] (+)= A B` in exact i32 for one m64 x n x k32 step of int8 operands
/// (`wgmma ... .s32.s8.s8`), both in shared memory and K-major (the only major order of 8-bit
/// operands), 128-byte-swizzled as for [`wgmma_ss`]: a row holds 128 int8 per chunk. The buffers
/// are typed `E` (f16/bf16: the int8 bytes two to an element) and `a_off` / `b_off` count `E`
/// elements, so a k32 step advances 16 of them, as a k16 step of 16-bit operands does.
#[cube]
#[allow(clippy::too_many_arguments, unused_variables)]
pub fn wgmma_ss_s8<E: Float>(
    acc: &mut Array<i32>,
    a: &SharedMemory<E>,
    a_off: u32,
    b: &SharedMemory<E>,
    b_off: u32,
    #[comptime] n: usize,
    #[comptime] accumulate: bool,
) {
    intrinsic!(|scope| {
        let t = elem_name::<E>(scope);
        let args = vec![*acc.expand, *a.expand, *a_off.expand, *b.expand, *b_off.expand];
        marker(scope, format!("wgmma_ss_s8 {t} {n} {}", accumulate as u32), args)
    })
}

/// `acc[0 .. n / 2] += A B` for one m64 x n x k32 step of FP8 e4m3 operands (`wgmma ...
/// .f32.e4m3.e4m3`), A from registers: the four words `a_regs[a0 .. a0 + 4]` of
/// [`pack_p_e4m3`]; B in shared memory, K-major (the only major order of 8-bit operands) with
/// 64-byte rows, 64-byte-swizzled (what a tensor-map copy with `CU_TENSOR_MAP_SWIZZLE_64B` of
/// 64-byte boxes writes into a 512-byte-aligned buffer): `n` rows of 64 K-elements, its first
/// byte at element `b_off` of `b` (typed `E`: two bytes an element).
#[cube]
#[allow(clippy::too_many_arguments, unused_variables)]
pub fn wgmma_rs_e4m3<E: Float>(
    acc: &mut Array<f32>,
    a_regs: &Array<u32>,
    b: &SharedMemory<E>,
    b_off: u32,
    #[comptime] a0: usize,
    #[comptime] n: usize,
) {
    intrinsic!(|scope| {
        let t = elem_name::<E>(scope);
        let args = vec![*acc.expand, *a_regs.expand, *b.expand, *b_off.expand];
        marker(scope, format!("wgmma_rs_e4m3 {t} {n} {a0}"), args)
    })
}

/// The f32 scores / probabilities `s` (the m64nN accumulator layout: `s[4 nb + e]`, n8 block `nb`)
/// rounded to FP8 e4m3 (`cvt.rn.satfinite`) into the A words of [`wgmma_rs_e4m3`]: `chunks` k32
/// steps of four words each. The A fragment of a k32 step wants this lane's row-`g` bytes for
/// columns `4 t .. 4 t + 4` and `16 + 4 t ..` (rows `g + 8` in words 1 and 3), while the
/// accumulator holds columns `2 t, 2 t + 1` of each n8 block: word 0 takes n8 blocks `4 c` and
/// `4 c + 1` (elements 0, 1 of each), word 2 blocks `4 c + 2`, `4 c + 3`, words 1 / 3 the same
/// for elements 2, 3. So A's column `16 h + 4 t + i` holds key `16 h + 8 (i / 2) + 2 t + i % 2`
/// of the step: the B operand (V^T) must hold its keys in that order
/// (`fp8_v::slot_of_key`).
#[cube]
#[allow(unused_variables)]
pub fn pack_p_e4m3(s: &Array<f32>, out: &mut Array<u32>, #[comptime] chunks: usize) {
    intrinsic!(|scope| {
        let args = vec![*s.expand, *out.expand];
        marker(scope, format!("pack_p_e4m3 {chunks}"), args)
    })
}

/// `out[i]` = the four f32 `x0 .. x3` rounded to FP8 e4m3 (`cvt.rn.satfinite`: NaN stays NaN,
/// overflow and infinities saturate to +-448), `x0` in the lowest byte.
#[cube]
#[allow(unused_variables)]
pub fn e4m3x4(out: &mut Array<u32>, #[comptime] i: usize, x0: f32, x1: f32, x2: f32, x3: f32) {
    intrinsic!(|scope| {
        let args = vec![*out.expand, *x0.expand, *x1.expand, *x2.expand, *x3.expand];
        marker(scope, format!("e4m3x4 {i}"), args)
    })
}

/// `out[idx]`, `out[idx + 1]` = `a`, `b` rounded to the element type (f16 / bf16, round to
/// nearest), as one 4-byte store: `idx` even (the accumulator's two adjacent columns of a row).
/// CubeCL stores a global array's elements one by one (2-byte stores).
#[cube]
#[allow(unused_variables)]
pub fn store_pair<E: Float>(out: &mut Array<E>, idx: usize, a: f32, b: f32) {
    intrinsic!(|scope| pair_marker::<E>(scope, vec![*out.expand, *idx.expand, *a.expand, *b.expand]))
}

/// [`store_pair`] into shared memory: `out[idx]`, `out[idx + 1]` = `a`, `b` as one 4-byte store.
#[cube]
#[allow(unused_variables)]
pub fn store_pair_shared<E: Float>(out: &mut SharedMemory<E>, idx: usize, a: f32, b: f32) {
    intrinsic!(|scope| pair_marker::<E>(scope, vec![*out.expand, *idx.expand, *a.expand, *b.expand]))
}

/// The marker of [`store_pair`] and [`store_pair_shared`] (the helper takes a generic pointer).
fn pair_marker<E: CubePrimitive>(scope: &mut Scope, args: Vec<cubecl::ir::Variable>) {
    let t = elem_name::<E>(scope);
    marker(scope, format!("store_pair {t}"), args)
}

/// One 16-byte store: global `dst[dst_idx .. dst_idx + 8]` = shared `src[src_idx .. src_idx + 8]`
/// (f16 / bf16 elements; both indices multiples of 8, `dst` 16-byte aligned). CubeCL copies a
/// global array's elements one by one.
#[cube]
#[allow(unused_variables)]
pub fn copy16_out<E: Float>(dst: &mut Array<E>, dst_idx: usize, src: &SharedMemory<E>, src_idx: usize) {
    intrinsic!(|scope| {
        let _t = elem_name::<E>(scope);
        let args = vec![*dst.expand, *dst_idx.expand, *src.expand, *src_idx.expand];
        marker(scope, "copy16_out".into(), args)
    })
}

/// `bytes` of f32 of shared `src` from f32 element `src_off` on added into global `dst` from f32
/// element `dst_off` on by the copy engine (`cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`,
/// a run-time size: a multiple of 16, both addresses 16-byte aligned); the caller commits the bulk
/// group and waits for its reads (`tma_group_commit`, `tma_group_wait_read`).
#[cube]
#[allow(unused_variables)]
pub fn bulk_add_f32<N: Size>(dst: &mut Array<Vector<f32, N>>, dst_off: u32, src: &SharedMemory<Vector<f32, N>>, src_off: u32, bytes: u32) {
    intrinsic!(|scope| {
        let args = vec![*dst.expand, *dst_off.expand, *src.expand, *src_off.expand, *bytes.expand];
        marker(scope, "bulk_add".into(), args)
    })
}

/// `pairs` f32 pairs `x[2 j], x[2 j + 1]` packed to the element type: an f32 accumulator (m16n8
/// layout) as the A fragments of [`wgmma_rs`] (pair `4 k .. 4 k + 4` is step `k`'s operand).
#[cube]
pub fn pack_a_pairs<E: Float>(x: &Array<f32>, out: &mut Array<Vector<E, Const<2>>>, #[comptime] pairs: usize) {
    #[unroll]
    for j in 0..pairs {
        let mut pr = Vector::<E, Const<2>>::empty();
        pr[0] = E::cast_from(x[2 * j]);
        pr[1] = E::cast_from(x[2 * j + 1]);
        out[j] = pr;
    }
}

/// Element offset, inside a 128-byte-swizzled tile of `rows` rows per 64-column chunk, of element
/// `col` (a multiple of 8: one 16-byte unit) of row `row`: chunk `col / 64`, then the row's 16-byte
/// units permuted by `unit ^ (row % 8)` (the pattern a tensor-map copy with 128-byte swizzle writes
/// into a 1024-byte-aligned buffer).
#[cube]
pub fn swizzle_128b(row: usize, col: usize, #[comptime] rows: usize) -> usize {
    let chunk = col / SW_COLS;
    let unit = (col % SW_COLS) / 8;
    chunk * comptime!(rows * SW_COLS) + row * SW_COLS + ((unit ^ (row % 8)) * 8)
}
