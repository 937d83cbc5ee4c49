//! Tuning switches of the tensor-core forward (environment defaults, test overrides).

/// Tuning switches of the tensor-core kernels (defaults from the environment:
/// `CUBEATTN_CUDA_PACK_HEADS`, `CUBEATTN_CUDA_SPLIT`, each `0` to turn off). Tests and benchmarks switch them with [`set_fwd_options`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FwdOptions {
    /// The q heads of one kv head share a tile (rows = (query, head) pairs).
    pub pack_heads: bool,
    /// Split long tiles over several cubes when the launch has too few cubes to fill the GPU.
    pub split: bool,
    /// Split target: about this many cubes per multiprocessor (`CUBEATTN_CUDA_SPLIT_WAVES`, 2:
    /// measured best of 2/4/8/16 on the shared-prefix shape).
    pub split_waves: u32,
    /// Forward rows per plane: 32 (4 planes, 128 threads) or 16 (8 planes) (`CUBEATTN_CUDA_PLANE_ROWS`).
    pub plane_rows: u32,
    /// Forward keys per shared-memory tile: 32, 64 or 128, or 0 (the default) for the head_dim's
    /// own ([`FwdOptions::block_n_for`]) (`CUBEATTN_CUDA_BLOCK_N`).
    pub block_n: u32,
    /// The Hopper forward (`kernels::flash_fwd_sm90`) on sm_90+ GPUs (`CUBEATTN_CUDA_SM90`, `0`
    /// keeps the mma.sync kernel there: how the two are compared on one GPU).
    pub sm90: bool,
    /// The Hopper forward's tile choice at every head_dim as `block_n:cubes_per_sm`
    /// (`CUBEATTN_CUDA_SM90_TILE`, e.g. `128:1`; unset: [`FwdOptions::sm90_tile_for`]'s
    /// defaults). How the choices are measured against each other on one GPU.
    pub sm90_tile: Option<(u32, u32)>,
}

static FWD_OPTS: std::sync::Mutex<Option<FwdOptions>> = std::sync::Mutex::new(None);

fn env_on(name: &str) -> bool {
    std::env::var(name).map(|v| v != "0").unwrap_or(true)
}

fn env_u32(name: &str, allowed: &[u32], default: u32) -> u32 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).filter(|w| allowed.contains(w)).unwrap_or(default)
}

impl FwdOptions {
    /// The defaults without environment overrides.
    pub fn defaults() -> FwdOptions {
        FwdOptions { pack_heads: true, split: true, split_waves: 2, plane_rows: 32, block_n: 0, sm90: true, sm90_tile: None }
    }

    /// Keys per tile at `head_dim`: `block_n` when set, else 128 at head_dim 64 (FlashAttention-2's
    /// d64 tile: 255 registers, two cubes per SM, 5-9% faster than 64-key tiles at three per SM,
    /// docs/forward.md) and 64 above (a 128-key tile's S and O do not fit the registers).
    /// The Hopper forward's `(block_n, cubes per SM)` at `head_dim`: two cubes per SM, whose
    /// MMAs and softmax interleave, with the key tile that fits them (H100, 8K causal, SDPA cuDNN
    /// in the same run: d64 128 keys 0.617 ms vs cuDNN 0.704; d128 64 keys 0.957 vs 0.934, where
    /// 128 keys at one cube per SM took 1.062: h100-2026-11-27-ab-sm90-tiles).
    pub fn sm90_tile_for(&self, head_dim: usize) -> (usize, u32) {
        if let Some((bn, cubes)) = self.sm90_tile {
            return (bn as usize, cubes);
        }
        if head_dim <= 64 { (128, 2) } else { (64, 2) }
    }

    pub fn block_n_for(&self, head_dim: usize) -> usize {
        match self.block_n {
            0 if head_dim <= 64 => 128,
            0 => 64,
            n => n as usize,
        }
    }
}

/// `block_n:cubes` with block_n 64 or 128 and 1 or 2 cubes per SM.
fn parse_tile(v: &str) -> Option<(u32, u32)> {
    let f: Vec<u32> = v.split(':').map(|x| x.trim().parse().ok()).collect::<Option<Vec<u32>>>()?;
    match f.as_slice() {
        &[bn @ (64 | 128), cubes @ (1 | 2)] => Some((bn, cubes)),
        _ => None,
    }
}

/// The forward switches in force.
pub fn fwd_options() -> FwdOptions {
    let mut g = FWD_OPTS.lock().unwrap_or_else(|e| e.into_inner());
    *g.get_or_insert_with(|| FwdOptions {
        pack_heads: env_on("CUBEATTN_CUDA_PACK_HEADS"),
        split: env_on("CUBEATTN_CUDA_SPLIT"),
        split_waves: std::env::var("CUBEATTN_CUDA_SPLIT_WAVES").ok().and_then(|v| v.parse().ok()).filter(|&w| w > 0).unwrap_or(2),
        plane_rows: env_u32("CUBEATTN_CUDA_PLANE_ROWS", &[16, 32], 32),
        block_n: env_u32("CUBEATTN_CUDA_BLOCK_N", &[32, 64, 128], 0),
        sm90: env_on("CUBEATTN_CUDA_SM90"),
        sm90_tile: std::env::var("CUBEATTN_CUDA_SM90_TILE").ok().and_then(|v| parse_tile(&v)),
    })
}

/// Replaces the forward switches (process-wide; for tests and benchmarks).
pub fn set_fwd_options(o: FwdOptions) {
    *FWD_OPTS.lock().unwrap_or_else(|e| e.into_inner()) = Some(o);
}
