//! The one error type of the crate. Every invalid input maps to `InvalidArgument`, which names the
//! argument and says what was expected; the Python layer turns it into `ValueError`/`TypeError`.

/// Errors returned by every public function of the crate.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum Error {
    /// An argument has the wrong shape, dtype or value.
    #[error("invalid argument `{arg}`: {msg}")]
    InvalidArgument { arg: &'static str, msg: String },
    /// An argument has the wrong dtype (Python: `TypeError`).
    #[error("invalid dtype for `{arg}`: {msg}")]
    InvalidDtype { arg: &'static str, msg: String },
    /// The request is valid but this backend cannot serve it (e.g. a head_dim without a kernel).
    #[error("unsupported by the {backend} backend: {msg}")]
    Unsupported { backend: &'static str, msg: String },
    /// A valid option this backend has no kernel for yet (Python: `NotImplementedError` naming
    /// the argument), e.g. `window_size` on CUDA.
    #[error("`{arg}` is not implemented by the {backend} backend yet: {msg}")]
    NotImplemented { arg: &'static str, backend: &'static str, msg: String },
    /// The asked-for backend cannot start here.
    #[error("backend `{backend}` unavailable: {reason}")]
    BackendUnavailable { backend: &'static str, reason: String },
    /// A device call failed at run time.
    #[error("device error: {0}")]
    Device(String),
    /// The GPU has too little free memory for the call (Python: `MemoryError`).
    #[error("out of GPU memory: the call needs {needed} bytes more, the device has {free} bytes free")]
    OutOfMemory { needed: u64, free: u64 },
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::InvalidArgument { arg, msg: msg.into() }
}

pub(crate) fn bad_dtype(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::InvalidDtype { arg, msg: msg.into() }
}
