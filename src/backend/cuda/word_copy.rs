//! What the raw-word copy kernels share (`kernels::zigzag_copy::copy_rows`,
//! `kernels::pad_cols::copy_cols`): the word width a copy moves per unit, and the kernel of that
//! width. They copy raw words, so one kernel serves every dtype.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::compile::{settings, Func, KernelKey, Source};
use super::CudaBackend;
use crate::dtype::DType;
use crate::error::Result;

/// Bytes moved per unit: the widest of 16, 8, 4, 2, 1 that divides the row length and both
/// addresses.
pub(crate) fn copy_width(row_bytes: usize, src: u64, out: u64) -> usize {
    [16usize, 8, 4, 2, 1]
        .into_iter()
        .find(|&w| row_bytes.is_multiple_of(w) && src.is_multiple_of(w as u64) && out.is_multiple_of(w as u64))
        .unwrap_or(1)
}

/// A raw-word copy kernel, generic over its word type and words per unit.
pub(crate) trait WordCopy {
    /// The kernel cache's name of it.
    const NAME: &'static str;
    /// Units per cube.
    const THREADS: usize;
    /// Its source with words of `W`, `n` of them a unit.
    fn source<W: Int>(s: KernelSettings, client: &ComputeClient<CudaRuntime>, n: usize) -> Result<Source>;
}

/// The kernel of `K` moving `width` bytes per unit ([`copy_width`]: u32 x 4, u32 x 2, u32, u16,
/// u8); the key's dtype is a fixed placeholder.
pub(crate) fn word_copy_kernel<K: WordCopy>(be: &CudaBackend, width: usize) -> Result<Func> {
    let key = KernelKey::new(K::NAME, DType::F32, &[width as u32]);
    let client = be.client();
    be.kernels.get(&key, || {
        let s = settings(K::THREADS as u32);
        match width {
            16 => K::source::<u32>(s, client, 4),
            8 => K::source::<u32>(s, client, 2),
            4 => K::source::<u32>(s, client, 1),
            2 => K::source::<u16>(s, client, 1),
            _ => K::source::<u8>(s, client, 1),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::copy_width;

    #[test]
    fn copy_width_follows_row_length_and_alignment() {
        assert_eq!(copy_width(384, 0x1000, 0x2000), 16);
        assert_eq!(copy_width(384, 0x1008, 0x2000), 8);
        assert_eq!(copy_width(24, 0x1000, 0x2000), 8);
        assert_eq!(copy_width(12, 0x1000, 0x2000), 4);
        assert_eq!(copy_width(6, 0x1000, 0x2000), 2);
        assert_eq!(copy_width(256, 0x1002, 0x2000), 2);
        assert_eq!(copy_width(3, 0x1000, 0x2000), 1);
    }
}
