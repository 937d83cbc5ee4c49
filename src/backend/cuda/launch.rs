//! Launching a compiled kernel ([`super::compile`]) on a stream with raw device pointers.
//!
//! Parameter layout of CubeCL 0.10's generated CUDA kernels with grid constants (what CubeCL's
//! own CUDA runtime passes, cubecl-cuda `compute/context.rs`): the tensor maps by value, then one
//! pointer per array argument in declaration order (a tensor map's buffer first), with tensor
//! maps a pointer to the dynamic metadata (shapes and strides), then one by-value info struct
//! holding the scalar arguments grouped by type and the array (and tensor) metadata. The info
//! bytes come from CubeCL's public `InfoBuilder`, fed in declaration order exactly as its
//! launcher does, so the layout is CubeCL's by construction. The
//! GPU tests compare every kernel family with the f64 reference through this path, so a change of
//! the ABI in another CubeCL version fails them loudly; and every launch checks the arguments'
//! counts (arrays, f32 and u32 scalars) against the kernel's generated signature ([`Abi`]).

use std::ffi::c_void;

use cubecl::prelude::AddressType;
use cubecl::zspace::{Shape, Strides};
use cubecl::InfoBuilder;
use cudarc::driver::sys;

use super::compile::{Abi, Func};
use crate::error::{Error, Result};

/// Arguments of one launch, in the kernel's declaration order.
#[derive(Default)]
pub(crate) struct Args {
    maps: Vec<sys::CUtensorMap>,
    ptrs: Vec<u64>,
    info: InfoBuilder,
    f32s: u32,
    u32s: u32,
}

impl Args {
    pub fn new() -> Args {
        Args::default()
    }

    /// An array argument: device address and its length in the kernel's element type (vector
    /// elements for vectorised arrays).
    pub fn array(&mut self, ptr: u64, len: usize) -> &mut Args {
        self.ptrs.push(ptr);
        self.info.metadata.register_array(len as u64, len as u64, AddressType::U32);
        self
    }

    /// A tensor-map argument (declared before the arrays): the map, and the buffer it describes
    /// (its metadata as CubeCL's launcher registers it).
    pub fn tensor_map(&mut self, m: &MapArg) -> &mut Args {
        let (rows, cols) = (m.rows, m.cols);
        self.maps.push(m.map);
        self.ptrs.push(m.ptr);
        let len = (rows * cols) as u64;
        let (shape, strides) = (Shape::new([rows, cols]), Strides::new(&[cols, 1]));
        self.info.metadata.register_tensor(2, len, len, shape, strides, AddressType::U32);
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Args {
        self.info.scalars.push(v);
        self.u32s += 1;
        self
    }

    pub fn f32(&mut self, v: f32) -> &mut Args {
        self.info.scalars.push(v);
        self.f32s += 1;
        self
    }

    /// A scalar argument of either type.
    pub fn scalar<T: Scalar>(&mut self, v: T) -> &mut Args {
        v.push(self);
        self
    }

    /// The kernel's parameters as these arguments fill them. CubeCL pads each scalar group and the
    /// static metadata of the info struct to 8 bytes (two 4-byte words; the kernel declares
    /// `static_meta[2n]` for 2n - 1 words), as its `InfoBuilder` does for the data.
    fn abi(&self) -> Abi {
        Abi { maps: self.maps.len() as u32, dynamic_meta: !self.maps.is_empty(), arrays: self.ptrs.len() as u32, f32s: self.f32s.div_ceil(2) * 2, u32s: self.u32s.div_ceil(2) * 2, meta: (self.info.metadata.static_len(AddressType::U32) as u32).div_ceil(2) * 2 }
    }
}

/// A tensor-map argument: the map, and the buffer it describes as a row-major `rows` x `cols`
/// tensor.
#[derive(Clone, Copy)]
pub(crate) struct MapArg {
    pub map: sys::CUtensorMap,
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
}

/// The scalar types a kernel argument has.
pub(crate) trait Scalar {
    fn push(self, a: &mut Args);
}

impl Scalar for f32 {
    fn push(self, a: &mut Args) {
        a.f32(self);
    }
}

impl Scalar for u32 {
    fn push(self, a: &mut Args) {
        a.u32(self);
    }
}

/// Enqueues `func` on `stream` over `grid` cubes.
pub(crate) fn launch(func: &Func, grid: (u32, u32, u32), args: &mut Args, stream: sys::CUstream) -> Result<()> {
    if args.abi() != func.abi {
        return Err(Error::Device(format!(
            "launch of {}: the host passes {:?}, the kernel takes {:?}",
            func.name,
            args.abi(),
            func.abi
        )));
    }
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return Ok(());
    }
    let info = args.info.finish(AddressType::U32);
    let mut params: Vec<*mut c_void> = args.maps.iter().map(|m| m as *const sys::CUtensorMap as *mut c_void).collect();
    params.extend(args.ptrs.iter().map(|p| p as *const u64 as *mut c_void));
    // The kernels read no tensor-map shape or stride, so the dynamic metadata pointer CubeCL
    // declares with tensor maps is never dereferenced: the first map's buffer stands in.
    if func.abi.dynamic_meta {
        params.push(&args.ptrs[0] as *const u64 as *mut c_void);
    }
    params.push(info.data.as_ptr() as *mut c_void);
    // SAFETY: `func` is a loaded function whose parameters are the tensor maps and arrays pushed
    // here in order followed by the info struct (see the module doc); the caller guarantees that
    // every address is a live device allocation of at least the given length on this context, and `params`,
    // `args` and `info` outlive the call (the driver copies the parameter values at launch).
    unsafe {
        cudarc::driver::result::launch_kernel(
            func.f,
            grid,
            (func.block[0], func.block[1], func.block[2]),
            func.smem,
            stream,
            &mut params,
        )
    }
    .map_err(|e| Error::Device(format!("cuLaunchKernel: {e:?}")))
}

/// A 2-D grid (x fastest) of at least `cubes` cubes.
pub(crate) fn grid_2d(cubes: usize) -> (u32, u32, u32) {
    let cubes = cubes.max(1);
    if cubes <= 65535 {
        (cubes as u32, 1, 1)
    } else {
        let y = cubes.div_ceil(65535);
        (cubes.div_ceil(y) as u32, y as u32, 1)
    }
}
