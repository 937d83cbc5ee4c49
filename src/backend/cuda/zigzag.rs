//! Zigzag row copies on the GPU: the host side of `kernels::zigzag_copy` (extract: gathered
//! zigzag K/V -> causal prefixes; scatter: the prefixes' gradient -> gathered layout, other rows
//! zero). Enqueued on the caller's stream with the caller's device pointers, like the attention
//! calls; no synchronization.
//!
//! Row maps: per layout (cu_seqlens, world size, last chunk) the extract map
//! (`zigzag::gathered_rows`) and the scatter map (its inverse over all gathered rows, [`NO_ROW`]
//! outside the prefixes) are built once and kept on the host and the device (one allocation per
//! layout and device), in a small least-recently-used cache with the stream rules of the launch
//! plans (`plans`): uploaded on the calling stream, a switch to another stream waits for the last
//! one once, entries used during a CUDA graph capture are kept, a miss during a capture is an
//! error, memory is freed stream-ordered on the last stream that used it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::{ComputeClient, Int, KernelSettings};
use cudarc::driver::{result as drv, sys};

use super::compile::{codegen, Source, A};
use super::driver::{bind, capturing, err, DevBuf};
use super::launch::{grid_2d, launch, Args};
use super::word_copy::{copy_width, word_copy_kernel, WordCopy};
use super::CudaBackend;
use crate::error::{invalid, Error, Result};
use crate::kernels::zigzag_copy::{copy_rows, COPY_THREADS, NO_ROW};

/// Layouts kept per device.
const CAPACITY: usize = 64;

/// Which copy: [`ZigzagCopy::Extract`] reads the gathered buffer (`kv`, `zigzag::gathered_len` rows)
/// and writes the prefixes; [`ZigzagCopy::Scatter`] reads the prefixes' gradient (`grad`) and
/// writes the whole gathered layout.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ZigzagCopy {
    Extract,
    Scatter,
}

impl ZigzagCopy {
    /// The argument name of the input (errors name it).
    fn input(self) -> &'static str {
        match self {
            ZigzagCopy::Extract => "kv",
            ZigzagCopy::Scatter => "grad",
        }
    }
}

/// The extract map (`n_extract` entries) followed, 16-byte aligned, by the scatter map (`total`
/// entries: the extracted row feeding each gathered row, or [`NO_ROW`]).
pub(crate) fn build_maps(cu_seqlens: &[i32], world_size: usize, max_chunk: usize) -> Result<(Vec<u32>, usize, usize)> {
    let rows = crate::zigzag::gathered_rows(cu_seqlens, world_size, max_chunk)?;
    let total = crate::zigzag::gathered_len(cu_seqlens, world_size)?;
    let n = rows.len();
    let at = n.next_multiple_of(4);
    let mut host = vec![NO_ROW; at + total];
    for (i, &g) in rows.iter().enumerate() {
        host[i] = g as u32;
        host[at + g] = i as u32;
    }
    Ok((host, n, total))
}

/// The maps of one layout on one device.
struct Maps {
    ptr: u64,
    n_extract: usize,
    total: usize,
    /// The stream that used the maps last (their memory is freed ordered on it).
    stream: AtomicU64,
    ctx: usize,
    /// The uploaded words, kept until the entry goes (the upload is asynchronous).
    _host: Vec<u32>,
}

impl Maps {
    fn extract_map(&self) -> (u64, usize) {
        (self.ptr, self.n_extract.max(1))
    }

    fn scatter_map(&self) -> (u64, usize) {
        (self.ptr + 4 * self.n_extract.next_multiple_of(4) as u64, self.total.max(1))
    }
}

impl Drop for Maps {
    fn drop(&mut self) {
        let _ = bind(self.ctx);
        // SAFETY: freed once, ordered after the last launch enqueued on the tracked stream.
        let _ = unsafe { drv::free_async(self.ptr, self.stream.load(Ordering::SeqCst) as sys::CUstream) };
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct MapKey {
    ctx: usize,
    cu: Vec<i32>,
    world_size: usize,
    max_chunk: usize,
}

struct Slot {
    maps: Arc<Maps>,
    last: u64,
    pinned: bool,
}

static CACHE: Mutex<Option<(HashMap<MapKey, Slot>, u64)>> = Mutex::new(None);

/// The maps of a layout for a launch on `stream` (the current context must be `ctx`): from the
/// cache, or built, validated and uploaded on `stream`.
fn maps(ctx: usize, cu: &[i32], world_size: usize, max_chunk: usize, stream: sys::CUstream) -> Result<Arc<Maps>> {
    let key = MapKey { ctx, cu: cu.to_vec(), world_size, max_chunk };
    let mut g = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let (map, tick) = g.get_or_insert_with(|| (HashMap::new(), 0));
    *tick += 1;
    let now = *tick;
    let capture = capturing(stream)?;
    if let Some(slot) = map.get_mut(&key) {
        slot.last = now;
        let prev = slot.maps.stream.swap(stream as u64, Ordering::SeqCst);
        if capture {
            slot.pinned = true; // the graph keeps these addresses
        } else if prev != stream as u64 {
            // SAFETY: `prev` is a stream these maps were used on; waiting makes its work (the
            // upload included) complete before the maps follow the new stream.
            let _ = unsafe { drv::stream::synchronize(prev as sys::CUstream) };
        }
        return Ok(slot.maps.clone());
    }
    let (host, n_extract, total) = build_maps(cu, world_size, max_chunk)?;
    if capture {
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: "this zigzag layout has no row maps on the device yet and none can be uploaded during CUDA graph \
                  capture: run the call once (same cu_seqlens, world_size, max_chunk_idx) before capturing"
                .into(),
        });
    }
    // `host` is kept in the entry until the memory is freed
    let ptr = super::driver::upload_u32_async(&host, stream)?;
    let maps = Arc::new(Maps { ptr, n_extract, total, stream: AtomicU64::new(stream as u64), ctx, _host: host });
    // evict on this device only: dropping another device's maps would bind its context (Maps::drop)
    // under the launch that follows
    if map.keys().filter(|k| k.ctx == ctx).count() >= CAPACITY {
        let victim = map
            .iter()
            .filter(|(k, s)| k.ctx == ctx && !s.pinned)
            .min_by_key(|(_, s)| s.last)
            .map(|(k, _)| k.clone());
        if let Some(k) = victim {
            map.remove(&k);
        }
    }
    map.insert(key, Slot { maps: maps.clone(), last: now, pinned: false });
    Ok(maps)
}

/// `kernels::zigzag_copy::copy_rows` for [`word_copy_kernel`].
struct CopyRowsKernel;

impl WordCopy for CopyRowsKernel {
    const NAME: &'static str = "zigzag_copy_rows";
    const THREADS: usize = COPY_THREADS;
    fn source<W: Int>(s: KernelSettings, client: &ComputeClient<CudaRuntime>, n: usize) -> Result<Source> {
        codegen(copy_rows::CopyRows::<W, CudaRuntime>::new(s, client.clone(), A, A, A, (), (), n))
    }
}

impl CudaBackend {
    /// Enqueues a zigzag row copy on `stream`: extract (`src` is the gathered buffer,
    /// `zigzag::gathered_len` rows; `out` gets the prefixes of chunks `0..=max_chunk`) or scatter (`src`
    /// holds the prefixes; `out` gets all gathered rows, zero outside the
    /// prefixes). Rows of `row_bytes` bytes, any dtype. A layout error names `cu_seqlens`,
    /// `world_size` or `max_chunk_idx`; a wrong row count names `kv` (extract) or `grad`
    /// (scatter) for the input, `out` for the output.
    ///
    /// # Safety
    /// `src` must point to `src_rows` contiguous rows of `row_bytes` bytes on this backend's
    /// device and `out` to room for `out_rows` such rows, both alive and untouched by other
    /// streams until the enqueued work completes; `stream` a live stream of the device.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn zigzag_copy_device(
        &self,
        op: ZigzagCopy,
        cu_seqlens: &[i32],
        world_size: usize,
        max_chunk: usize,
        src: u64,
        src_rows: usize,
        out: u64,
        out_rows: usize,
        row_bytes: usize,
        stream: u64,
    ) -> Result<()> {
        // the layout's own checks first (cheap, and they name the layout arguments)
        crate::zigzag::seq_lengths(cu_seqlens, world_size)?;
        bind(self.ctx)?;
        let s = stream as sys::CUstream;
        let m = maps(self.ctx, cu_seqlens, world_size, max_chunk, s)?;
        let (want, want_out, (map, map_len)) = match op {
            ZigzagCopy::Extract => (m.total, m.n_extract, m.extract_map()),
            ZigzagCopy::Scatter => (m.n_extract, m.total, m.scatter_map()),
        };
        if src_rows != want {
            let what = match op {
                ZigzagCopy::Extract => format!("the gathered buffer of cu_seqlens has {want}"),
                ZigzagCopy::Scatter => format!("the extracted prefixes have {want}"),
            };
            return Err(invalid(op.input(), format!("has {src_rows} rows, {what}")));
        }
        if out_rows != want_out {
            return Err(invalid("out", format!("has room for {out_rows} rows, the copy writes {want_out}")));
        }
        if row_bytes == 0 || out_rows == 0 {
            return Ok(());
        }
        let width = copy_width(row_bytes, src, out);
        let row_vecs = row_bytes / width;
        let too_big = |rows: usize| (rows as u64).checked_mul(row_vecs as u64).is_none_or(|v| v > u32::MAX as u64);
        let n_vecs = out_rows * row_vecs;
        let grid = grid_2d(n_vecs.div_ceil(COPY_THREADS));
        // the kernel's unit index is a u32 over the whole (padded) grid
        let units = grid.0 as u64 * grid.1 as u64 * COPY_THREADS as u64;
        if too_big(src_rows) || too_big(out_rows) || units > 1 << 32 {
            return Err(Error::Unsupported {
                backend: "cuda",
                msg: format!(
                    "`{}` too large for the zigzag copy kernel's 32-bit indexing ({} rows of {row_bytes} bytes)",
                    op.input(),
                    src_rows.max(out_rows)
                ),
            });
        }
        let f = word_copy_kernel::<CopyRowsKernel>(self, width)?;
        let mut a = Args::new();
        a.array(src, src_rows * row_vecs).array(map, map_len).array(out, n_vecs);
        a.u32(row_vecs as u32).u32(n_vecs as u32);
        launch(&f, grid, &mut a, s)
    }

    /// [`Self::zigzag_copy_device`] on host bytes (`src`: whole rows of `row_bytes` bytes): copies
    /// in, runs on the backend's own stream, copies the result back, synchronizes. For tests
    /// and callers without device buffers; exact like `zigzag::extract` / `zigzag::scatter`. The
    /// device output is filled with 0xFF bytes before the copy, so a row the kernel did not write
    /// cannot pass for one of the scatter's zero rows.
    pub fn zigzag_copy_host(
        &self,
        op: ZigzagCopy,
        cu_seqlens: &[i32],
        world_size: usize,
        max_chunk: usize,
        src: &[u8],
        row_bytes: usize,
    ) -> Result<Vec<u8>> {
        if row_bytes == 0 {
            return Err(invalid("row_bytes", "must be positive"));
        }
        if !src.len().is_multiple_of(row_bytes) {
            return Err(invalid(op.input(), format!("has {} bytes, not a multiple of the row size {row_bytes}", src.len())));
        }
        crate::zigzag::seq_lengths(cu_seqlens, world_size)?;
        let total = crate::zigzag::gathered_len(cu_seqlens, world_size)?;
        let out_rows = match op {
            ZigzagCopy::Extract => crate::zigzag::gathered_rows(cu_seqlens, world_size, max_chunk)?.len(),
            ZigzagCopy::Scatter => total,
        };
        let _g = self.host_lock.lock().unwrap_or_else(|e| e.into_inner());
        bind(self.ctx)?;
        let s = self.stream.0;
        let sb = DevBuf::alloc(src.len())?;
        sb.upload(src, s)?;
        let ob = DevBuf::alloc(out_rows * row_bytes)?;
        // SAFETY: `ob` holds at least `out_rows * row_bytes` bytes; ordered on the live stream.
        unsafe { drv::memset_d8_async(ob.ptr, 0xFF, out_rows * row_bytes, s) }.map_err(|e| err("cuMemsetD8Async", e))?;
        // SAFETY: both buffers are device allocations of this context holding `src` and room for
        // `out_rows` rows; the stream is synchronized before they are dropped.
        let n = unsafe {
            let src_rows = src.len() / row_bytes;
            self.zigzag_copy_device(op, cu_seqlens, world_size, max_chunk, sb.ptr, src_rows, ob.ptr, out_rows, row_bytes, s as u64)
        };
        let mut out = vec![0u8; out_rows * row_bytes];
        let r = n.and_then(|_| ob.download(&mut out, s));
        // wait even after an error: work may be enqueued that reads or writes the buffers
        self.stream.sync()?;
        r?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_are_the_row_index_and_its_inverse() {
        let cu = [0, 24, 36, 84];
        for w in 1..=3usize {
            for m in 0..2 * w {
                let rows = crate::zigzag::gathered_rows(&cu, w, m).unwrap();
                let (host, n, total) = build_maps(&cu, w, m).unwrap();
                assert_eq!((n, total), (rows.len(), 84));
                let at = n.next_multiple_of(4);
                assert_eq!(host.len(), at + total);
                for (i, &g) in rows.iter().enumerate() {
                    assert_eq!(host[i] as usize, g);
                    assert_eq!(host[at + g] as usize, i);
                }
                let fed = host[at..].iter().filter(|&&x| x != NO_ROW).count();
                assert_eq!(fed, n, "W={w} m={m}: every prefix row feeds one gathered row");
            }
        }
        // uneven lengths: the gathered buffer has every rank's shard padded to the longest
        let (_, n, total) = build_maps(&[0, 13, 14], 2, 3).unwrap();
        assert_eq!((n, total), (14, 16));
        assert!(build_maps(&[0, 10, 4], 2, 0).is_err());
        assert!(build_maps(&[0, 8], 2, 4).is_err());
    }
}
