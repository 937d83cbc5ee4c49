//! cubeattn: flash, grouped (shared K,V with overlapping key ranges), varlen, paged and
//! block-sparse attention: one validated [`spec`] whose [`KeySet`] is dense, paged or
//! block-sparse ([`sparse`]).
//!
//! Layers, top to bottom: Python bindings (`python`, feature `python`) -> validated [`spec`] ->
//! [`backend`] (CPU always; CUDA with feature `cuda`; [`backend_for`] chooses) -> kernels
//! (`kernels`, CubeCL, feature `cuda`). Device detection and VRAM estimation are pure functions beside the backends.
//! With feature `candle`, [`candle`] exposes the same calls as candle custom ops (with autograd).

pub mod backend;
mod config;
pub mod device;
pub mod dtype;
pub mod error;
pub mod format;
pub mod fp8;
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

pub use backend::{backend_for, Backend, BackendKind, DevicePref, ForwardOutput, Gradients};
pub use dtype::{DType, Element, HostData, HostView};
pub use error::{Error, Result};
pub use spec::{AttnSpec, Dims, KeySet, Layout, Pass, Segment, SparseView, TensorMeta, Window};
pub use sparse::{BlockSparse, Int8Qk, QuantGran};
