//! Compiling the `#[cube]` kernels ourselves: CubeCL generates the CUDA source (its public
//! `CubeKernel::define` + `Compiler::compile`), NVRTC compiles it to a cubin with our options, the
//! cubin is cached on disk, and the function is loaded into the device's primary context. The
//! launches themselves are ours too ([`super::launch`]), on the caller's stream with the caller's
//! pointers. Why this route and not CubeCL's own launch (CubeCL 0.10 owns its streams and
//! buffers: a call through it needs staging copies and three synchronisations): docs/design.md.
//!
//! Disk cache: one file per (kernel, comptime choices, dtype, GPU architecture, NVRTC options,
//! kernel sources, cubeattn and CubeCL versions) under `CUBEATTN_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/cubeattn`, else `~/.cache/cubeattn`; `CUBEATTN_CACHE_DIR=off` disables it.
//! A hit skips CubeCL's code generation and NVRTC's compile; an entry records the NVRTC version
//! that built it, and a hit from another version than the loadable one is recompiled (NVRTC
//! releases differ in register allocation and spills: docs/cuda-build.md). Without a loadable NVRTC,
//! cached entries still load. `CUBEATTN_DUMP_DIR=dir` writes the
//! CUDA source of every kernel compiled (not read from the cache) into `dir`.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cubecl::cuda::CudaCompiler;
use cubecl::prelude::*;
use cubecl::Compiler;
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures};
use cudarc::driver::sys;

use super::target::Target;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// CubeCL version the generated-source ABI was checked against (Cargo.toml pins it with `=`).
pub const CUBECL_VERSION: &str = "0.10.0";

/// First line of a disk-cache entry (a different format is a cache miss).
const CACHE_FORMAT: &str = "cubeattn-cubin 5";

/// Identifies one compiled kernel: its name, the dtype it is instantiated for and every comptime
/// choice (block shapes, flags), which together fix the generated source.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct KernelKey {
    pub name: &'static str,
    pub dtype: DType,
    pub params: [u32; KEY_PARAMS],
}

/// Comptime choices a [`KernelKey`] holds (the forward kernel has 9).
const KEY_PARAMS: usize = 12;

impl KernelKey {
    pub fn new(name: &'static str, dtype: DType, p: &[u32]) -> KernelKey {
        assert!(p.len() <= KEY_PARAMS, "KernelKey of {name}: {} comptime choices, room for {KEY_PARAMS}", p.len());
        let mut params = [0u32; KEY_PARAMS];
        params[..p.len()].copy_from_slice(p);
        KernelKey { name, dtype, params }
    }
}

/// What CubeCL generated for one kernel.
pub(crate) struct Source {
    pub entry: String,
    pub cuda: String,
    pub smem: u32,
    pub block: [u32; 3],
    pub abi: Abi,
}

/// The launch parameters a generated kernel takes (read from its signature and its info struct):
/// tensor maps (by value), array pointers (a tensor map's buffer among them), then the f32 and
/// u32 scalars (each group padded to an even count by CubeCL). [`super::launch::launch`] refuses arguments
/// that do not match, so a host/kernel mismatch is an error, never a launch that reads garbage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Abi {
    pub maps: u32,
    /// The `dynamic_meta` pointer CubeCL adds after the arrays (with tensor maps).
    pub dynamic_meta: bool,
    pub arrays: u32,
    pub f32s: u32,
    pub u32s: u32,
    /// u32 words of static metadata (array lengths; tensor ranks and offsets).
    pub meta: u32,
}

impl Abi {
    /// Parses the `__global__` signature (`buffer_N` parameters) and `struct info_st`
    /// (`float scalars_float[F]; uint32 scalars_uint32[U]; ...`) of CubeCL 0.10's CUDA output.
    pub fn of_source(entry: &str, cuda: &str) -> Result<Abi> {
        let bad = |what: &str| Error::Device(format!("generated source of {entry}: {what} not found (CubeCL output changed?)"));
        let sig_at = cuda.find("__global__").ok_or_else(|| bad("__global__ signature"))?;
        let sig_end = cuda[sig_at..].find(") {").ok_or_else(|| bad("end of the signature"))? + sig_at;
        let arrays = cuda[sig_at..sig_end].matches(" buffer_").count() as u32;
        let maps = cuda[sig_at..sig_end].matches("CUtensorMap tensor_map_").count() as u32;
        let dynamic_meta = cuda[sig_at..sig_end].contains(" dynamic_meta");
        let count = |field: &str| -> u32 {
            let Some(i) = cuda.find("struct info_st {") else { return 0 };
            let body = &cuda[i..i + cuda[i..].find("};").unwrap_or(0)];
            body.find(field)
                .and_then(|j| body[j + field.len()..].split(']').next())
                .and_then(|n| n.trim_start_matches('[').parse().ok())
                .unwrap_or(0)
        };
        Ok(Abi { maps, dynamic_meta, arrays, f32s: count("scalars_float"), u32s: count("scalars_uint32"), meta: count("static_meta") })
    }
}

/// A loaded kernel function.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Func {
    pub f: sys::CUfunction,
    pub smem: u32,
    pub block: [u32; 3],
    pub abi: Abi,
    /// The kernel's [`KernelKey::name`] (for errors).
    pub name: &'static str,
}

// SAFETY: a CUfunction handle is valid in every thread once its module is loaded in the context.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

/// The options CubeCL's code generator gets: those CubeCL's CUDA runtime uses on sm_70+.
/// `grid_constants` makes the scalars and array lengths one by-value `__grid_constant__` struct
/// after the buffer pointers, which is the parameter layout [`super::launch`] builds.
fn codegen_options() -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            grid_constants: true,
            fast_math: true,
            ..Default::default()
        },
    }
}

/// CUDA source of a kernel (CubeCL's code generator; no device work).
/// [`codegen`] with `2^x` rewritten into `exp2f`, the cp.async barriers' copy arrivals made
/// `.noinc`, and ldmatrix / cp.async given 32-bit shared addresses ([`super::rewrite`]; the last
/// took the forward at 8K causal from 1.90 to 1.77 ms on an H200, docs/cuda-build.md); for the kernels
/// that use `kernels::math::fast_exp2`. `spin`: barrier waits as a plain `try_wait` loop (the
/// backward kernels: fwd+bwd 8K 9.90 -> 9.82 ms on an H200; the INT8 / FP8 Hopper forward, 2-5%;
/// the 16-bit forward measured 0.3-0.9% slower with it, so it keeps libcu++'s wait).
pub(crate) fn codegen_exp2<K: CubeKernel>(kernel: K, spin: bool) -> Result<Source> {
    let mut src = codegen(kernel)?;
    src.cuda = super::rewrite::exp2_calls(&src.entry, &src.cuda)?;
    src.cuda = super::rewrite::mbarriers(&src.entry, &src.cuda, true, spin)?;
    src.cuda = super::rewrite::bulk_adds(&src.entry, &src.cuda)?;
    src.cuda = super::rewrite::smem_addresses(&src.entry, &src.cuda)?;
    src.cuda = super::rewrite::stmatrix_fallback(&src.entry, &src.cuda)?;
    Ok(src)
}

pub(crate) fn codegen<K: CubeKernel>(kernel: K) -> Result<Source> {
    let addr = kernel.address_type();
    let def = kernel.define();
    let entry = def.options.kernel_name.clone();
    let cube_dim = def.cube_dim;
    let mut compiler = CudaCompiler::default();
    let repr = compiler
        .compile(def, &codegen_options(), ExecutionMode::Unchecked, addr)
        .map_err(|e| Error::Device(format!("CubeCL code generation of {entry} failed: {e:?}")))?;
    // the layout's own size: every buffer padded to the common alignment, never below CubeCL's
    // count for its own (unpadded last buffer) layout
    let (cuda, smem) = super::rewrite::smem_layout(&entry, &repr.to_string())?;
    Ok(Source {
        smem,
        abi: Abi::of_source(&entry, &cuda)?,
        cuda,
        entry,
        block: [cube_dim.x, cube_dim.y, cube_dim.z],
    })
}

/// The array argument every kernel struct takes for a plain (not in-place) array.
pub(crate) const A: cubecl::prelude::ArrayCompilationArg = cubecl::prelude::ArrayCompilationArg { inplace: None };

/// Kernel settings of a launch with `threads` threads in x (the kernels are 1-D cubes).
pub(crate) fn settings(threads: u32) -> KernelSettings {
    KernelSettings::default().cube_dim(CubeDim::new_1d(threads)).address_type(AddressType::U32)
}

/// Directory of the disk cache, `None` when disabled (`CUBEATTN_CACHE_DIR`, `crate::config`).
pub fn cache_dir() -> Option<PathBuf> {
    crate::config::get().cache_dir.clone()
}

/// CUDA headers NVRTC needs (CubeCL's generated source includes cuda_fp16/bf16, mma, pipeline).
fn include_dirs() -> Result<Vec<PathBuf>> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("CUDA_PATH") {
        roots.push(PathBuf::from(p));
    }
    roots.extend(["/usr/local/cuda", "/opt/cuda", "/usr"].map(PathBuf::from));
    for r in roots {
        let inc = r.join("include");
        if inc.join("cuda_fp16.h").exists() {
            let mut v = vec![inc.clone()];
            if inc.join("cccl").exists() {
                v.push(inc.join("cccl"));
            }
            return Ok(v);
        }
    }
    Err(Error::BackendUnavailable {
        backend: "cuda",
        reason: "CUDA headers (cuda_fp16.h) not found to compile kernels: set CUDA_PATH".into(),
    })
}

/// FNV-1a 64-bit over several byte strings (stable across processes and builds).
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter().chain(&[0xffu8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The backend files that decide a kernel's CUDA source besides the kernels themselves: the
/// code-generation options and source rewrites, and the comptime arguments each launcher passes.
const CODEGEN_SOURCES: &[&str] = &[
    include_str!("compile.rs"),
    include_str!("rewrite/mod.rs"),
    include_str!("rewrite/bulk_adds.rs"),
    include_str!("rewrite/exp2.rs"),
    include_str!("rewrite/int8_words.rs"),
    include_str!("rewrite/mbarriers.rs"),
    include_str!("rewrite/min_blocks.rs"),
    include_str!("rewrite/sm90.rs"),
    include_str!("rewrite/smem_addresses.rs"),
    include_str!("rewrite/smem_layout.rs"),
    include_str!("rewrite/stmatrix.rs"),
    include_str!("forward.rs"),
    include_str!("backward.rs"),
    include_str!("sparse.rs"),
    include_str!("sparse_bwd.rs"),
    include_str!("sparse_int8.rs"),
    include_str!("nonfinite.rs"),
    include_str!("zigzag.rs"),
];

/// Hash of every kernel source file and of the backend files that shape the generated source
/// (computed once per process): a cached cubin is never reused after a kernel edit or a changed
/// rewrite (before, a rewrite edit kept serving the old cubins from the disk cache).
fn kernel_sources_hash() -> u64 {
    static H: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *H.get_or_init(|| {
        let parts: Vec<&[u8]> = crate::kernels::SOURCES.iter().chain(CODEGEN_SOURCES).map(|s| s.as_bytes()).collect();
        fnv(&parts)
    })
}

fn nvrtc_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("{what}: {e:?}"))
}

/// The version of the NVRTC library that compiles (`"13.0"`), `None` when none can be loaded
/// (looked up once per process).
fn nvrtc_version() -> Option<&'static str> {
    static V: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        use cudarc::nvrtc::sys as nsys;
        if !super::driver::nvrtc_lib_present() {
            return None;
        }
        // SAFETY: nvrtcVersion writes two ints.
        unsafe {
            let (mut major, mut minor) = (0, 0);
            nsys::nvrtcVersion(&mut major, &mut minor).result().ok()?;
            Some(format!("{major}.{minor}"))
        }
    })
    .as_deref()
}

/// Compiles CUDA source to a cubin for `arch` (e.g. "sm_90a").
fn nvrtc_cubin(src: &Source, arch: &str, flags: &[String]) -> Result<Vec<u8>> {
    if nvrtc_version().is_none() {
        return Err(Error::BackendUnavailable {
            backend: "cuda",
            reason: format!(
                "NVRTC (libnvrtc.so) was not found to compile kernel {}: install the CUDA toolkit's NVRTC \
                 or the nvidia-cuda-nvrtc package and put its lib directory on LD_LIBRARY_PATH",
                src.entry
            ),
        });
    }
    let mut opts = vec![format!("--gpu-architecture={arch}")];
    for inc in include_dirs()? {
        opts.push(format!("--include-path={}", inc.display()));
    }
    opts.extend(flags.iter().cloned());
    let code = CString::new(src.cuda.as_str()).map_err(|e| nvrtc_err("kernel source", e))?;
    use cudarc::nvrtc::{result as nv, sys as nsys};
    let prog = nv::create_program(code.as_c_str(), None).map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?;
    // SAFETY: `prog` is a live program until destroy_program below; buffers are sized by NVRTC.
    unsafe {
        let r = nv::compile_program(prog, &opts);
        if r.is_err() {
            let log = nv::get_program_log(prog).unwrap_or_default();
            let log: String = log.iter().map(|&c| c as u8 as char).collect();
            let _ = nv::destroy_program(prog);
            return Err(Error::Device(format!("NVRTC failed on {} ({opts:?}):\n{log}", src.entry)));
        }
        let mut size = 0usize;
        nsys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
        let mut cubin = vec![0u8; size];
        nsys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _).result().map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
        let _ = nv::destroy_program(prog);
        Ok(cubin)
    }
}

/// Whether a cache entry built by NVRTC `built` may be loaded when `loadable` is the NVRTC this
/// process would compile with: only the same version, or any when none can be loaded (the entry
/// is then the only way to run).
fn entry_usable(built: &str, loadable: Option<&str>) -> bool {
    loadable.is_none_or(|cur| cur == built)
}

/// On-disk entry: a short text header (NVRTC version, entry point, shared bytes, block, launch
/// ABI) then the cubin.
fn encode(nvrtc: &str, src: &Source, cubin: &[u8]) -> Vec<u8> {
    let (b, a) = (src.block, src.abi);
    let head = format!(
        "{CACHE_FORMAT}\n{nvrtc}\n{}\n{}\n{} {} {}\n{} {} {} {} {} {}\n",
        src.entry, src.smem, b[0], b[1], b[2], a.maps, a.dynamic_meta as u32, a.arrays, a.f32s, a.u32s, a.meta
    );
    let mut v = head.into_bytes();
    v.extend_from_slice(cubin);
    v
}

/// (NVRTC version, kernel, cubin) of an entry; `None` for another format or a damaged entry.
fn decode(bytes: &[u8]) -> Option<(String, Source, Vec<u8>)> {
    let mut lines = 0;
    let mut end = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'\n' {
            lines += 1;
            if lines == 6 {
                end = i + 1;
                break;
            }
        }
    }
    if lines < 6 {
        return None;
    }
    let head = std::str::from_utf8(&bytes[..end]).ok()?;
    let mut it = head.lines();
    if it.next()? != CACHE_FORMAT {
        return None;
    }
    let nvrtc = it.next()?.to_string();
    let entry = it.next()?.to_string();
    let smem = it.next()?.parse().ok()?;
    let b: Vec<u32> = it.next()?.split(' ').filter_map(|x| x.parse().ok()).collect();
    let a: Vec<u32> = it.next()?.split(' ').filter_map(|x| x.parse().ok()).collect();
    if b.len() != 3 || a.len() != 6 || bytes.len() <= end {
        return None;
    }
    let abi = Abi { maps: a[0], dynamic_meta: a[1] != 0, arrays: a[2], f32s: a[3], u32s: a[4], meta: a[5] };
    Some((nvrtc, Source { entry, cuda: String::new(), smem, block: [b[0], b[1], b[2]], abi }, bytes[end..].to_vec()))
}

/// Compiled-kernel registry of one device: in memory, backed by the disk cache.
pub(crate) struct Kernels {
    ctx: usize,
    /// The device's target: its NVRTC architecture, defines and shared-memory limit.
    target: Target,
    arch: String,
    flags: Vec<String>,
    loaded: Mutex<HashMap<KernelKey, Func>>,
    /// Kernels compiled (not read from disk) by this process, for reports and tests.
    compiled: std::sync::atomic::AtomicUsize,
}

impl Kernels {
    pub fn new(ctx: usize, target: Target) -> Kernels {
        let mut flags = crate::config::get().nvrtc_flags.clone();
        flags.extend(target.nvrtc_defines());
        Kernels { ctx, target, arch: target.arch(), flags, loaded: Mutex::new(HashMap::new()), compiled: Default::default() }
    }

    /// Kernels this process compiled with NVRTC (the rest came from the disk cache).
    pub fn compiled_count(&self) -> usize {
        self.compiled.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn cache_file(&self, key: &KernelKey) -> Option<PathBuf> {
        let dir = cache_dir()?;
        let k = format!("{key:?}");
        let flags = self.flags.join(" ");
        let h = fnv(&[
            CACHE_FORMAT.as_bytes(),
            env!("CARGO_PKG_VERSION").as_bytes(),
            CUBECL_VERSION.as_bytes(),
            &kernel_sources_hash().to_le_bytes(),
            k.as_bytes(),
            self.arch.as_bytes(),
            flags.as_bytes(),
        ]);
        Some(dir.join(&self.arch).join(format!("{}-{h:016x}.cubin", key.name)))
    }

    /// The loaded function of `key`; on a miss, from the disk cache or compiled from `build()`.
    pub fn get(&self, key: &KernelKey, build: impl FnOnce() -> Result<Source>) -> Result<Func> {
        if let Some(f) = self.loaded.lock().unwrap().get(key) {
            return Ok(*f);
        }
        let t0 = std::time::Instant::now();
        let file = self.cache_file(key);
        let cached = file
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| decode(&b))
            .filter(|(v, _, _)| entry_usable(v, nvrtc_version()))
            .map(|(_, src, cubin)| (src, cubin));
        let from = if cached.is_some() { "disk cache" } else { "compiled" };
        let (src, cubin) = match cached {
            Some(x) => x,
            None => {
                let src = build()?;
                if let Some(dir) = &crate::config::get().dump_dir {
                    let _ = std::fs::create_dir_all(dir);
                    let _ = std::fs::write(dir.join(format!("{}.cu", src.entry)), &src.cuda);
                }
                let cubin = nvrtc_cubin(&src, &self.arch, &self.flags)?;
                self.compiled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Some(p) = &file {
                    store(p, &encode(nvrtc_version().unwrap_or("?"), &src, &cubin));
                }
                (src, cubin)
            }
        };
        let f = self.load(key.name, &src, &cubin)?;
        self.loaded.lock().unwrap().insert(*key, f);
        if crate::config::get().trace {
            eprintln!("cubeattn kernel {} ({key:?}): {from}, {:.1} ms", src.entry, t0.elapsed().as_secs_f64() * 1e3);
        }
        Ok(f)
    }

    fn load(&self, name: &'static str, src: &Source, cubin: &[u8]) -> Result<Func> {
        use cudarc::driver::result as drv;
        smem_fits(&src.entry, src.smem, self.target.smem_limit)?;
        let entry = CString::new(src.entry.as_str()).map_err(|e| nvrtc_err("entry point", e))?;
        // SAFETY: `ctx` is the device's retained primary context; `cubin` is a complete image
        // produced by NVRTC for this device's architecture (or read back byte for byte).
        unsafe {
            drv::ctx::set_current(self.ctx as sys::CUcontext).map_err(|e| nvrtc_err("cuCtxSetCurrent", e))?;
            let module = drv::module::load_data(cubin.as_ptr() as *const c_void).map_err(|e| nvrtc_err("cuModuleLoadData", e))?;
            let f = drv::module::get_function(module, entry).map_err(|e| nvrtc_err("cuModuleGetFunction", e))?;
            drv::function::set_function_attribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                src.smem as i32,
            )
            .map_err(|e| nvrtc_err("cuFuncSetAttribute", e))?;
            Ok(Func { f, smem: src.smem, block: src.block, abi: src.abi, name })
        }
    }
}

/// A kernel's shared memory against the device's per-block limit (`limit` 0: unknown, not
/// checked), as an error that says so instead of the driver's bare `cuFuncSetAttribute` failure.
fn smem_fits(entry: &str, need: u32, limit: u32) -> Result<()> {
    if limit == 0 || need <= limit {
        return Ok(());
    }
    Err(Error::Unsupported {
        backend: "cuda",
        msg: format!(
            "kernel {entry} needs {} KiB of shared memory per block and this GPU allows {} KiB (the CUDA \
             kernels are sized for H100 / H200, 227 KiB); run this call with device=\"cpu\"",
            need.div_ceil(1024),
            limit / 1024
        ),
    })
}

/// Writes a cache file atomically (temporary file + rename); failures only cost a recompile.
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!(".tmp-{}-{:?}", std::process::id(), std::thread::current().id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_beyond_the_device_limit_is_a_clear_error() {
        assert!(smem_fits("k", 106_496, 232_448).is_ok());
        assert!(smem_fits("k", 106_496, 0).is_ok(), "an unknown limit is not checked");
        match smem_fits("flash_fwd_mma2_x", 175_000, 101_376) {
            Err(Error::Unsupported { msg, .. }) => {
                assert!(msg.contains("flash_fwd_mma2_x needs 171 KiB") && msg.contains("allows 99 KiB"), "{msg}")
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }

    #[test]
    fn cache_entries_round_trip() {
        let abi = Abi { maps: 2, dynamic_meta: true, arrays: 13, f32s: 2, u32s: 8, meta: 32 };
        let src = Source { entry: "k_f16".into(), cuda: String::new(), smem: 12345, block: [128, 1, 1], abi };
        let cubin: Vec<u8> = (0..=255u8).collect();
        let (v, s, c) = decode(&encode("13.0", &src, &cubin)).unwrap();
        assert_eq!((v.as_str(), s.entry.as_str(), s.smem, s.block, s.abi), ("13.0", "k_f16", 12345, [128, 1, 1], abi));
        assert_eq!(c, cubin);
        assert!(decode(b"cubeattn-cubin 5\n13.0\nk\n1\n1 1 1\n1 2\nxx").is_none());
        // entries of format 4 (no tensor-map count) are misses
        assert!(decode(b"cubeattn-cubin 4\n13.0\nk\n1\n1 1 1\n1 2 3\nxxxx").is_none());
        // entries of format 3 (no NVRTC version) are misses
        assert!(decode(b"cubeattn-cubin 3\nk\n1\n1 1 1\n1 2 3\nxxxx").is_none());
        // entries of format 2 (compiled without the mbarrier rewrites) are misses
        assert!(decode(b"cubeattn-cubin 2\nk\n1\n1 1 1\n1 2 3\nxxxx").is_none());
        // the previous format (no ABI line) is a miss, not a misread
        assert!(decode(b"cubeattn-cubin 1\nk\n1\n1 1 1\nxxxx").is_none());
    }

    #[test]
    fn entries_of_another_nvrtc_are_misses_unless_none_loads() {
        assert!(entry_usable("13.0", Some("13.0")));
        assert!(!entry_usable("13.0", Some("13.5")));
        assert!(!entry_usable("?", Some("13.0")));
        assert!(entry_usable("13.5", None));
    }

    #[test]
    fn abi_is_read_from_the_generated_signature() {
        let cuda = "struct info_st {\n    float scalars_float[2];\nuint32 scalars_uint32[8];uint32 static_meta[26];\n};\n\
            extern \"C\" __global__ void __launch_bounds__(128)k (\n    const float* __restrict__ buffer_0, \
            float* buffer_1, const uint32* __restrict__ buffer_2, const __grid_constant__ info_st info\n) {\n}";
        assert_eq!(Abi::of_source("k", cuda).unwrap(), Abi { maps: 0, dynamic_meta: false, arrays: 3, f32s: 2, u32s: 8, meta: 26 });
        let no_scalars = cuda.replace("    float scalars_float[2];\nuint32 scalars_uint32[8];", "");
        assert_eq!(Abi::of_source("k", &no_scalars).unwrap(), Abi { maps: 0, dynamic_meta: false, arrays: 3, f32s: 0, u32s: 0, meta: 26 });
        let with_map = cuda
            .replace("    const float* __restrict__ buffer_0", "    const __grid_constant__ CUtensorMap tensor_map_0, float* buffer_0")
            .replace("buffer_2, const __grid", "buffer_2, const uint32* __restrict__ dynamic_meta, const __grid");
        assert_eq!(Abi::of_source("k", &with_map).unwrap(), Abi { maps: 1, dynamic_meta: true, arrays: 3, f32s: 2, u32s: 8, meta: 26 });
        assert!(Abi::of_source("k", "no kernel here").is_err());
    }

    #[test]
    fn keys_differ_by_every_field() {
        let a = KernelKey::new("fwd", DType::BF16, &[128, 1]);
        assert_ne!(a, KernelKey::new("fwd", DType::F16, &[128, 1]));
        assert_ne!(a, KernelKey::new("fwd", DType::BF16, &[64, 1]));
        assert_ne!(a, KernelKey::new("bwd", DType::BF16, &[128, 1]));
        assert_ne!(fnv(&[b"ab", b"c"]), fnv(&[b"a", b"bc"]));
    }
}
