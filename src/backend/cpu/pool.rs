//! Recycled, 64-byte-aligned f32 buffers for the CPU backend (all architectures).

use std::sync::Mutex;

/// Floats of slack for the alignment offset (64 bytes).
const ALIGN_FLOATS: usize = 16;

/// An f32 buffer whose first element is 64-byte aligned. Its contents are unspecified (buffers
/// are recycled through a small pool, see [`Aligned::take`]); users write what they read.
pub(crate) struct Aligned {
    buf: Vec<f32>,
    off: usize,
    len: usize,
}

/// Recycled buffers: the packed operands of one forward (three buffers) and the backward's
/// head-major inputs and dK / dV / dQ accumulators (two) are tens of MiB, and fresh pages cost a
/// page fault and a zeroing each (about 8% of a 2K forward; in the backward, with both threads
/// faulting, a third of the time went to the kernel), so a few buffers are kept.
static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());
/// At most this many buffers, holding at most `POOL_MAX_FLOATS` floats together (512 MiB), are
/// kept between calls; larger buffers are freed when returned.
const POOL_SLOTS: usize = 6;
const POOL_MAX_FLOATS: usize = 1 << 27;

impl Aligned {
    /// A buffer of `len` floats, from the pool when one is large enough.
    pub(crate) fn take(len: usize) -> Self {
        let need = len + ALIGN_FLOATS;
        let reused = {
            let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
            // the smallest pooled buffer that fits
            let best = (0..pool.len()).filter(|&i| pool[i].len() >= need).min_by_key(|&i| pool[i].len());
            best.map(|i| pool.swap_remove(i))
        };
        let buf = reused.unwrap_or_else(|| vec![0.0f32; need]);
        let off = buf.as_ptr().align_offset(64).min(ALIGN_FLOATS);
        Aligned { buf, off, len }
    }
    /// A zeroed buffer of `len` floats, not from the pool (for small per-thread scratch, which
    /// must not take one of the pool's large buffers).
    pub(crate) fn fresh(len: usize) -> Self {
        let buf = vec![0.0f32; len + ALIGN_FLOATS];
        let off = buf.as_ptr().align_offset(64).min(ALIGN_FLOATS);
        Aligned { buf, off, len }
    }
    /// Returns the buffer to the pool (or frees it).
    pub(crate) fn give(self) {
        if self.buf.len() > POOL_MAX_FLOATS {
            return;
        }
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(self.buf);
        // drop the smallest until both limits hold (the new buffer alone fits the size limit)
        while pool.len() > POOL_SLOTS || pool.iter().map(Vec::len).sum::<usize>() > POOL_MAX_FLOATS {
            let i = (0..pool.len()).min_by_key(|&i| pool[i].len()).unwrap_or(0);
            pool.swap_remove(i);
        }
    }
    pub(crate) fn as_slice(&self) -> &[f32] {
        &self.buf[self.off..self.off + self.len]
    }
    pub(crate) fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.buf[self.off..self.off + self.len]
    }
}
