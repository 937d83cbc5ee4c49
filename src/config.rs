//! Every `CUBEATTN_*` environment variable the library reads, read once per process ([`get`]);
//! nothing else in `src/` calls `std::env::var` for them. (Test programs, scripts and the Python
//! package read their own: `CUBEATTN_GPU_BENCH`, `CUBEATTN_REQUIRE_GPU`, `CUBEATTN_TORCH_HOST_COPY`...)
//!
//! | variable | effect | used by |
//! |---|---|---|
//! | `CUBEATTN_CACHE_DIR` | directory of the compiled-kernel disk cache; `off` (or `0`, `none`, empty) disables it; default `$XDG_CACHE_HOME/cubeattn`, else `~/.cache/cubeattn` | users, scripts, tests |
//! | `CUBEATTN_DUMP_DIR` | writes the CUDA source of every kernel compiled (not read from the cache) into this directory | `scripts/dry-run.sh`, `scripts/kernel_code.py`, the `dump_tensor_core_kernels` test |
//! | `CUBEATTN_TRACE=1` | reports on stderr where each kernel came from (disk cache or NVRTC) and how long it took | users, `cubeattn.bench` first-call |
//! | `CUBEATTN_NVRTC_FLAGS` | replaces the NVRTC options besides the architecture and include paths (space separated; default `-ftz=true`) | experiments |
//! | `CUBEATTN_CUDA_PORTABLE=1` | builds every kernel as for GPUs below sm_90, on any GPU ([`crate::backend::cuda::Target`]) | `tests/python/test_portable_gpu.py`, `scripts/gpu-test.sh --portable` |
//! | `CUBEATTN_CUDA_SM90=0` | keeps the mma.sync forward on sm_90 GPUs (default: the wgmma forward) | comparisons of the two forwards on one GPU |
//! | `CUBEATTN_CUDA_SM90_TILE=bn:cubes` | the wgmma forward's tile and cubes per SM (`FwdOptions::sm90_tile`) at every head_dim | A/B runs of its tile choices on one GPU |
//! | `CUBEATTN_CUDA_DECODE=0` | decode-sized calls (at most 32 rows of a sequence a tile) keep `flash_fwd_sm90`'s 128-row tiles instead of `kernels::flash_fwd_decode` (one-warpgroup cubes, the keys as the MMA's M; `FwdOptions::sm90_decode`) | A/B runs of the two on one GPU |
//! | `CUBEATTN_CUDA_SM90_WS=0` | keeps `flash_fwd_sm90` where the warp-specialised wgmma forward (`kernels::flash_fwd_ws`, `FwdOptions::sm90_ws`) is the default | A/B runs of the two Hopper frames on one GPU |
//! | `CUBEATTN_CUDA_WS_BN=128` (or 144) | keys per tile of the warp-specialised forward at head_dim 128 where no row's key range is cut (non-causal, no window, K / V not paged, not block-sparse; `FwdOptions::ws_bn`, default 160) | A/B runs of its tile widths on one GPU |
//! | `CUBEATTN_CUDA_WS_BN_V=64` | keys per tile of the warp-specialised forward at head_dim 192 with v at most 128 wide (DeepSeek's MLA; `FwdOptions::ws_bn_v`, default 128) | A/B runs of its tile widths on one GPU |
//! | `CUBEATTN_CUDA_SPLIT=0` | no split-K of long forward tiles | the sanitizer families (`tests/python/sanitize_driver.py`) |
//! | `CUBEATTN_WORK_ORDER=cost` | the forward's, the dK/dV kernels' and the dQ pass's work lists strictly by cost, without taking items of close cost sequence by sequence (`FwdOptions::seq_waves`) | A/B runs of the two orders |
//! | `CUBEATTN_BWD_DQ=pass` / `atomic` | `deterministic = false` backward calls take the separate dQ pass / the dQ fused into the dK/dV kernel with atomics, wherever the default would take the other (default: fused, except dense d64 calls on sm_90) | sanitizer families, comparisons |
//! | `CUBEATTN_BWD_SM90_WS=0` | keeps `flash_bwd_sm90` where the warp-specialised wgmma dK/dV kernel (`kernels::flash_bwd_ws`) is the default (head_dim 128; 64 without the fused dQ) | A/B runs of the two Hopper backward frames on one GPU |
//! | `CUBEATTN_BWD_DQ_SM90=0` | the dQ pass runs the `mma.sync` kernel on sm_90 too, instead of the wgmma one (`flash_bwd_dq_sm90`, head_dim 64, 128, 192, 256) | A/B runs of the two dQ passes |
//! | `CUBEATTN_BWD_ORDER=kv` / `heads` | the dense dK/dV cubes launched kv head outer / heads fastest, wherever the default (`backward::kv_outer`) takes the other | A/B runs of the two orders |
//! | `CUBEATTN_DQ_ORDER=kv` / `heads` | the same for the dQ pass's cubes (`backward::kv_outer`) | A/B runs of the two orders |
//! | `CUBEATTN_FWD_ORDER=kv` / `heads` | the dense Hopper forward's cubes launched kv head outer / heads fastest, wherever the default (`forward::kv_outer`) takes the other | A/B runs of the two orders |
//! | `CUBEATTN_BWD_Q_STAGES=1` | the dK/dV kernel with one query-tile stage (what GPUs with less shared memory get) on any GPU | `tests/python/test_portable_gpu.py` |
//! | `CUBEATTN_CPU_KERNEL=gemm` | the CPU backend's gemm-crate path instead of its AVX-512 tiles | `examples/cpu_forward.rs`, docs/cpu.md |
//!
//! Deleted (experiments whose alternative lost, docs/measured-and-lost.md; no test, script or
//! benchmark set them): `CUBEATTN_CUDA_PACK_HEADS`, `CUBEATTN_CUDA_SPLIT_WAVES`,
//! `CUBEATTN_CUDA_PLANE_ROWS`, `CUBEATTN_CUDA_BLOCK_N` (the GPU tests and benchmarks switch those
//! forward variants with [`set_fwd_options`]), `CUBEATTN_BWD_ATOMIC_VEC` (scalar dQ atomics on
//! sm_90+; the portable build still runs them), `CUBEATTN_CPU_BLOCKS` and
//! `CUBEATTN_CPU_BWD_BLOCKS` (CPU tile sizes), `CUBEATTN_BWD_SM90_EARLY_DV` and
//! `CUBEATTN_BWD_SM90_WGS` (the wgmma backward's early dV product and one-warpgroup cubes,
//! docs/backward.md), `CUBEATTN_BWD_DQ_ORDERED` (the ordered fused deterministic dQ, removed with
//! it: the wgmma dQ pass measured faster, docs/backward.md).

#[cfg(feature = "cuda")]
use std::path::PathBuf;
use std::sync::OnceLock;

/// The environment switches of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Config {
    /// `CUBEATTN_CPU_KERNEL=gemm`: the CPU backend skips its AVX-512 tiles.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub cpu_gemm: bool,
    /// `CUBEATTN_CACHE_DIR`, resolved: the disk cache's directory, `None` when disabled.
    #[cfg(feature = "cuda")]
    pub cache_dir: Option<PathBuf>,
    /// `CUBEATTN_DUMP_DIR`.
    #[cfg(feature = "cuda")]
    pub dump_dir: Option<PathBuf>,
    /// `CUBEATTN_TRACE=1`.
    #[cfg(feature = "cuda")]
    pub trace: bool,
    /// `CUBEATTN_NVRTC_FLAGS`, split, or the default `-ftz=true` (`exp` / `pow` use the
    /// flush-to-zero approximations, no denormal path; FlashAttention-2 builds with --use_fast_math).
    #[cfg(feature = "cuda")]
    pub nvrtc_flags: Vec<String>,
    /// `CUBEATTN_CUDA_PORTABLE=1`.
    #[cfg(feature = "cuda")]
    pub portable: bool,
    /// `CUBEATTN_BWD_DQ=pass`.
    #[cfg(feature = "cuda")]
    pub bwd_dq_pass: bool,
    /// `CUBEATTN_BWD_DQ=atomic`.
    #[cfg(feature = "cuda")]
    pub bwd_dq_atomic: bool,
    /// `CUBEATTN_BWD_Q_STAGES=1`.
    #[cfg(feature = "cuda")]
    pub bwd_one_q_stage: bool,
    /// `CUBEATTN_BWD_SM90_WS` (`0` turns the warp-specialised dK/dV kernel off).
    #[cfg(feature = "cuda")]
    pub bwd_sm90_ws: bool,
    /// `CUBEATTN_BWD_DQ_SM90` (`0` runs the dQ pass on `mma.sync` on sm_90 too).
    #[cfg(feature = "cuda")]
    pub bwd_dq_sm90: bool,
    /// `CUBEATTN_BWD_ORDER=kv` / `heads`: the dense dK/dV cubes kv head outer / heads fastest
    /// wherever the default would take the other (`backward::kv_outer`).
    #[cfg(feature = "cuda")]
    pub bwd_order: Option<bool>,
    /// `CUBEATTN_DQ_ORDER=kv` / `heads`: the dQ pass's cubes kv head outer / heads fastest
    /// wherever the default would take the other (`backward::kv_outer`).
    #[cfg(feature = "cuda")]
    pub dq_order: Option<bool>,
    /// `CUBEATTN_FWD_ORDER=kv` / `heads`: the dense Hopper forward's cubes kv head outer / heads
    /// fastest wherever the default would take the other (`forward::kv_outer`).
    #[cfg(feature = "cuda")]
    pub fwd_order: Option<bool>,
    /// `CUBEATTN_BWD_WS_ROWS=64` / `128`: the query rows a tile of `flash_bwd_ws` where
    /// `backward::ws_rows` may choose (head_dim 64 without the fused dQ).
    #[cfg(feature = "cuda")]
    pub bwd_ws_rows: Option<usize>,
    /// The forward switches before any [`set_fwd_options`]: `CUBEATTN_CUDA_SPLIT`,
    /// `CUBEATTN_CUDA_SM90` (each `0` to turn off), `CUBEATTN_CUDA_SM90_TILE`, the rest at their
    /// defaults.
    #[cfg(feature = "cuda")]
    pub fwd: FwdOptions,
}

/// `name` unset or not `0`.
#[cfg(feature = "cuda")]
fn on_unless_zero(var: &Option<String>) -> bool {
    var.as_deref() != Some("0")
}

impl Config {
    /// The switches from `var` (the environment, or a test's table).
    fn from(var: impl Fn(&str) -> Option<String>) -> Config {
        #[cfg(feature = "cuda")]
        let is = |name: &str, value: &str| var(name).as_deref() == Some(value);
        // a cube-order switch: `kv` (kv head outer), `heads` (heads fastest), else the default
        #[cfg(feature = "cuda")]
        let order = |name: &str| match var(name).as_deref() {
            Some("kv") => Some(true),
            Some("heads") => Some(false),
            _ => None,
        };
        Config {
            cpu_gemm: var("CUBEATTN_CPU_KERNEL").as_deref() == Some("gemm"),
            #[cfg(feature = "cuda")]
            cache_dir: match var("CUBEATTN_CACHE_DIR") {
                Some(v) if matches!(v.as_str(), "" | "0" | "off" | "none") => None,
                Some(v) => Some(PathBuf::from(v)),
                None => var("XDG_CACHE_HOME")
                    .map(PathBuf::from)
                    .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
                    .map(|base| base.join("cubeattn")),
            },
            #[cfg(feature = "cuda")]
            dump_dir: var("CUBEATTN_DUMP_DIR").map(PathBuf::from),
            #[cfg(feature = "cuda")]
            trace: is("CUBEATTN_TRACE", "1"),
            #[cfg(feature = "cuda")]
            nvrtc_flags: match var("CUBEATTN_NVRTC_FLAGS") {
                Some(v) => v.split_whitespace().map(String::from).collect(),
                None => vec!["-ftz=true".into()],
            },
            #[cfg(feature = "cuda")]
            portable: is("CUBEATTN_CUDA_PORTABLE", "1"),
            #[cfg(feature = "cuda")]
            bwd_dq_pass: is("CUBEATTN_BWD_DQ", "pass"),
            #[cfg(feature = "cuda")]
            bwd_dq_atomic: is("CUBEATTN_BWD_DQ", "atomic"),
            #[cfg(feature = "cuda")]
            bwd_one_q_stage: is("CUBEATTN_BWD_Q_STAGES", "1"),
            #[cfg(feature = "cuda")]
            bwd_sm90_ws: on_unless_zero(&var("CUBEATTN_BWD_SM90_WS")),
            #[cfg(feature = "cuda")]
            bwd_dq_sm90: on_unless_zero(&var("CUBEATTN_BWD_DQ_SM90")),
            #[cfg(feature = "cuda")]
            bwd_order: order("CUBEATTN_BWD_ORDER"),
            #[cfg(feature = "cuda")]
            dq_order: order("CUBEATTN_DQ_ORDER"),
            #[cfg(feature = "cuda")]
            fwd_order: order("CUBEATTN_FWD_ORDER"),
            #[cfg(feature = "cuda")]
            bwd_ws_rows: match var("CUBEATTN_BWD_WS_ROWS").as_deref() {
                Some("64") => Some(64),
                Some("128") => Some(128),
                _ => None,
            },
            #[cfg(feature = "cuda")]
            fwd: FwdOptions {
                split: on_unless_zero(&var("CUBEATTN_CUDA_SPLIT")),
                sm90: on_unless_zero(&var("CUBEATTN_CUDA_SM90")),
                sm90_tile: var("CUBEATTN_CUDA_SM90_TILE").and_then(|v| parse_tile(&v)),
                sm90_ws: on_unless_zero(&var("CUBEATTN_CUDA_SM90_WS")),
                sm90_decode: on_unless_zero(&var("CUBEATTN_CUDA_DECODE")),
                ws_bn: match var("CUBEATTN_CUDA_WS_BN").as_deref() {
                    Some("128") => 128,
                    Some("144") => 144,
                    _ => FwdOptions::defaults().ws_bn,
                },
                ws_bn_v: match var("CUBEATTN_CUDA_WS_BN_V").as_deref() {
                    Some("64") => 64,
                    _ => FwdOptions::defaults().ws_bn_v,
                },
                seq_waves: !is("CUBEATTN_WORK_ORDER", "cost"),
                ..FwdOptions::defaults()
            },
        }
    }
}

/// The switches of this process, read from the environment on first use.
pub(crate) fn get() -> &'static Config {
    static C: OnceLock<Config> = OnceLock::new();
    // a variable that is not valid unicode counts as unset (as `std::env::var` errs on it)
    C.get_or_init(|| Config::from(|name| std::env::var(name).ok()))
}

/// Tuning switches of the tensor-core forward. Defaults: [`FwdOptions::defaults`], with `split`
/// and `sm90` from the environment ([`Config::fwd`]). The GPU tests and benchmarks run the other
/// variants (head packing off, no split, other split targets, 32-key tiles, 16-row planes, the
/// mma.sync forward on sm_90) by replacing them with [`set_fwd_options`].
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FwdOptions {
    /// The q heads of one kv head share a tile (rows = (query, head) pairs).
    pub pack_heads: bool,
    /// Split long tiles over several cubes when the launch has too few cubes to fill the GPU
    /// (`CUBEATTN_CUDA_SPLIT`).
    pub split: bool,
    /// Split target: about this many cubes per multiprocessor (2: measured best of 2/4/8/16 on
    /// the shared-prefix shape).
    pub split_waves: u32,
    /// Forward rows per plane: 32 (4 planes, 128 threads) or 16 (8 planes).
    pub plane_rows: u32,
    /// Forward keys per shared-memory tile: 32, 64 or 128, or 0 (the default) for the head_dim's
    /// own ([`FwdOptions::block_n_for`]).
    pub block_n: u32,
    /// The Hopper forward (`kernels::flash_fwd_sm90`) on GPUs with wgmma (`CUBEATTN_CUDA_SM90`, `0`
    /// keeps the mma.sync kernel there: how the two are compared on one GPU).
    pub sm90: bool,
    /// The Hopper forward's tile choice at every head_dim as `block_n:cubes_per_sm`
    /// (`CUBEATTN_CUDA_SM90_TILE`, e.g. `128:1`; unset: [`FwdOptions::sm90_tile_for`]'s
    /// defaults). How the choices are measured against each other on one GPU.
    pub sm90_tile: Option<(u32, u32)>,
    /// The warp-specialised Hopper forward (`kernels::flash_fwd_ws`: a producer warpgroup, two
    /// consumer warpgroups overlapping softmax and MMAs) where it is measured faster
    /// (`backend::cuda::forward::sm90_frame`; `CUBEATTN_CUDA_SM90_WS=0` turns it off).
    pub sm90_ws: bool,
    /// Decode-sized Hopper calls (at most `forward::FEW_ROWS` rows of a sequence a tile, head_dim 64
    /// / 128) on `kernels::flash_fwd_decode`: one-warpgroup cubes whose MMAs take the keys as M and
    /// the tile's rows (rounded up to 8) as N (`CUBEATTN_CUDA_DECODE=0` keeps `flash_fwd_sm90`'s
    /// `check_v` variant).
    pub sm90_decode: bool,
    /// Keys per tile of `kernels::flash_fwd_ws` at head_dim 128 where no row's key range is cut
    /// inside the keys it reads (non-causal, no window, K / V not paged, not block-sparse:
    /// `backend::cuda::forward::sm90_frame`): 160 (`CUBEATTN_CUDA_WS_BN` = 128 or 144 for A/B runs).
    /// Other calls take 128-key tiles. H200, kernel time against 128 keys (alternating processes,
    /// bench/results/h200-2026-12-01-ws-wide): -1 to -2% at 8K-16K, level at 4K; FlashAttention-3's
    /// 176 spilled (108 bytes) and lost 2-5%.
    pub ws_bn: u32,
    /// Keys per tile of `kernels::flash_fwd_ws` at head_dim 192 where v is at most 128 wide
    /// (`backend::cuda::forward::value_dim_native`, DeepSeek's MLA 192 / 128): 128
    /// (`CUBEATTN_CUDA_WS_BN_V=64` for A/B runs; 64 is the d192 frame's tile when v is as wide as q).
    pub ws_bn_v: u32,
    /// The work list's items of close cost taken sequence by sequence (`cuda::plan::order_by_cost`),
    /// so that a wave's cubes share a sequence's K / V in L2; off (`CUBEATTN_WORK_ORDER=cost`):
    /// strictly by cost. The backward's lists follow the process's value (`Config::fwd`).
    pub seq_waves: bool,
}

#[cfg(feature = "cuda")]
impl FwdOptions {
    /// The defaults without environment overrides.
    pub fn defaults() -> FwdOptions {
        FwdOptions {
            pack_heads: true,
            split: true,
            split_waves: 2,
            plane_rows: 32,
            block_n: 0,
            sm90: true,
            sm90_tile: None,
            sm90_ws: true,
            sm90_decode: true,
            ws_bn: 160,
            ws_bn_v: 128,
            seq_waves: true,
        }
    }

    /// The Hopper forward's `(block_n, cubes per SM)` at `head_dim`: two cubes per SM, whose
    /// MMAs and softmax interleave, with the key tile that fits them (H100, 8K causal, SDPA cuDNN
    /// in the same run: d64 128 keys 0.617 ms vs cuDNN 0.704; d128 64 keys 0.957 vs 0.934, where
    /// 128 keys at one cube per SM took 1.062: h100-2026-11-27-ab-sm90-tiles). Above 128 one cube
    /// per SM with 64-key tiles: O takes head_dim / 2 registers a thread (128 at d256), and Q plus
    /// two K and two V tiles take 144 / 192 KiB of shared memory at d192 / d256. The override
    /// applies up to head_dim 128.
    pub fn sm90_tile_for(&self, head_dim: usize) -> (usize, u32) {
        match self.sm90_tile {
            _ if head_dim > 128 => (64, 1),
            Some((bn, cubes)) => (bn as usize, cubes),
            None if head_dim <= 64 => (128, 2),
            None => (64, 2),
        }
    }

    /// Keys per tile at `head_dim`: `block_n` when set, else 128 at head_dim 64 (FlashAttention-2's
    /// d64 tile: 255 registers, two cubes per SM, 5-9% faster than 64-key tiles at three per SM,
    /// docs/forward.md) and 64 above (a 128-key tile's S and O do not fit the registers).
    pub fn block_n_for(&self, head_dim: usize) -> usize {
        match self.block_n {
            0 if head_dim <= 64 => 128,
            0 => 64,
            n => n as usize,
        }
    }
}

/// `block_n:cubes` with block_n 64 or 128 and 1 or 2 cubes per SM.
#[cfg(feature = "cuda")]
fn parse_tile(v: &str) -> Option<(u32, u32)> {
    let f: Vec<u32> = v.split(':').map(|x| x.trim().parse().ok()).collect::<Option<Vec<u32>>>()?;
    match f.as_slice() {
        &[bn @ (64 | 128), cubes @ (1 | 2)] => Some((bn, cubes)),
        _ => None,
    }
}

/// The override of the forward switches ([`set_fwd_options`]), `None` until one is set.
#[cfg(feature = "cuda")]
static FWD_OVERRIDE: std::sync::Mutex<Option<FwdOptions>> = std::sync::Mutex::new(None);

/// The forward switches in force.
#[cfg(feature = "cuda")]
pub fn fwd_options() -> FwdOptions {
    FWD_OVERRIDE.lock().unwrap_or_else(|e| e.into_inner()).unwrap_or(get().fwd)
}

/// Replaces the forward switches (process-wide; for tests and benchmarks).
#[cfg(feature = "cuda")]
pub fn set_fwd_options(o: FwdOptions) {
    *FWD_OVERRIDE.lock().unwrap_or_else(|e| e.into_inner()) = Some(o);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Config {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from(move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn unset_variables_give_the_defaults() {
        let c = with(&[]);
        assert!(!c.cpu_gemm);
        #[cfg(feature = "cuda")]
        {
            assert_eq!(c.cache_dir, None, "no CUBEATTN_CACHE_DIR, XDG_CACHE_HOME or HOME");
            assert_eq!((c.dump_dir.clone(), c.trace, c.portable, c.bwd_dq_pass, c.bwd_one_q_stage), (None, false, false, false, false));
            assert_eq!(c.nvrtc_flags, vec!["-ftz=true".to_string()]);
            assert_eq!(c.fwd, FwdOptions::defaults());
        }
    }

    #[test]
    fn each_variable_sets_its_switch() {
        assert!(with(&[("CUBEATTN_CPU_KERNEL", "gemm")]).cpu_gemm);
        assert!(!with(&[("CUBEATTN_CPU_KERNEL", "tiles")]).cpu_gemm);
        #[cfg(feature = "cuda")]
        {
            let home = with(&[("HOME", "/h")]);
            assert_eq!(home.cache_dir, Some(PathBuf::from("/h/.cache/cubeattn")));
            let xdg = with(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]);
            assert_eq!(xdg.cache_dir, Some(PathBuf::from("/x/cubeattn")));
            assert_eq!(with(&[("HOME", "/h"), ("CUBEATTN_CACHE_DIR", "/c")]).cache_dir, Some(PathBuf::from("/c")));
            for off in ["", "0", "off", "none"] {
                assert_eq!(with(&[("HOME", "/h"), ("CUBEATTN_CACHE_DIR", off)]).cache_dir, None, "{off:?}");
            }
            assert_eq!(with(&[("CUBEATTN_DUMP_DIR", "/d")]).dump_dir, Some(PathBuf::from("/d")));
            assert!(with(&[("CUBEATTN_TRACE", "1")]).trace);
            assert_eq!(with(&[("CUBEATTN_NVRTC_FLAGS", " -G  -lineinfo ")]).nvrtc_flags, vec!["-G", "-lineinfo"]);
            assert!(with(&[("CUBEATTN_CUDA_PORTABLE", "1")]).portable);
            assert!(!with(&[("CUBEATTN_CUDA_PORTABLE", "yes")]).portable);
            assert!(with(&[("CUBEATTN_BWD_DQ", "pass")]).bwd_dq_pass);
            assert!(!with(&[("CUBEATTN_BWD_DQ", "atomic")]).bwd_dq_pass);
            assert!(with(&[("CUBEATTN_BWD_DQ", "atomic")]).bwd_dq_atomic && !with(&[("CUBEATTN_BWD_DQ", "pass")]).bwd_dq_atomic);
            assert!(with(&[("CUBEATTN_BWD_Q_STAGES", "1")]).bwd_one_q_stage);
            assert!(with(&[]).bwd_sm90_ws && !with(&[("CUBEATTN_BWD_SM90_WS", "0")]).bwd_sm90_ws);
            assert_eq!(with(&[]).bwd_ws_rows, None);
            assert_eq!(with(&[("CUBEATTN_BWD_WS_ROWS", "64")]).bwd_ws_rows, Some(64));
            assert_eq!(with(&[("CUBEATTN_BWD_WS_ROWS", "96")]).bwd_ws_rows, None);
            let off = with(&[("CUBEATTN_CUDA_SPLIT", "0"), ("CUBEATTN_CUDA_SM90", "0")]).fwd;
            assert_eq!(off, FwdOptions { split: false, sm90: false, ..FwdOptions::defaults() });
            assert_eq!(with(&[("CUBEATTN_CUDA_SPLIT", "1")]).fwd, FwdOptions::defaults());
            assert_eq!(with(&[("CUBEATTN_CUDA_SM90_TILE", "128:1")]).fwd.sm90_tile, Some((128, 1)));
            assert_eq!(with(&[]).fwd.ws_bn, 160);
            assert_eq!(with(&[("CUBEATTN_CUDA_WS_BN", "128")]).fwd.ws_bn, 128);
            assert_eq!(with(&[("CUBEATTN_CUDA_WS_BN", "176")]).fwd.ws_bn, 160, "176 lost: not offered");
            assert_eq!((with(&[]).fwd.ws_bn_v, with(&[("CUBEATTN_CUDA_WS_BN_V", "64")]).fwd.ws_bn_v), (128, 64));
            for bad in ["32:2", "64:3", "64:0:2", "64", "x"] {
                assert_eq!(with(&[("CUBEATTN_CUDA_SM90_TILE", bad)]).fwd.sm90_tile, None, "{bad}");
            }
        }
    }
}
