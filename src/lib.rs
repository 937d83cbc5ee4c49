//! cubeattn: flash, grouped (shared K,V with overlapping key ranges), varlen and block-sparse
//! ([`sparse`]) attention.
//!
//! Layers, top to bottom: Python bindings (`python`, feature `python`) -> validated [`spec`] ->
//! [`backend`] (CPU always; CUDA with feature `cuda`) -> kernels (`kernels`, CubeCL, feature
//! `cuda`). Device detection and VRAM estimation are pure functions beside the backends.
//! With feature `candle`, [`candle`] exposes the same calls as candle custom ops (with autograd).

pub mod backend;
pub mod device;
pub mod dtype;
pub mod error;
pub mod reference;
pub mod spec;
pub mod sparse;
pub mod vram;
pub mod zigzag;

#[cfg(feature = "cuda")]
pub mod kernels;

#[cfg(feature = "candle")]
pub mod candle;

#[cfg(feature = "python")]
mod python;

pub use backend::{backend_for, backend_for_spec, Backend, BackendKind, DevicePref, ForwardOutput, Gradients};
pub use dtype::{DType, Element, HostData, HostView};
pub use error::{Error, Result};
pub use spec::{AttnSpec, Dims, Layout, Segment, TensorMeta, Window};
pub use sparse::{QuantGran, SparseSpec};
