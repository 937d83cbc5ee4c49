//! Launch plans kept on the device, per call shape: the work lists and tables of a spec are built
//! and uploaded once (stream-ordered on the calling stream), then every later call with the same
//! shape launches at once with no host-to-device traffic. That also makes the calls capturable
//! in a CUDA graph once each shape has run before the capture.
//!
//! Memory: each entry owns one device allocation (`cuMemAllocAsync`), freed stream-ordered on the
//! stream that used it last when the entry leaves the cache (least recently used beyond
//! [`CAPACITY`] entries) and the last launch holding it is enqueued. An entry first used on one
//! stream and then on another waits for the first stream once, at the switch, so its memory is
//! never freed under work of a stream it no longer tracks. Entries used during a graph capture are
//! pinned (the graph keeps their addresses).

use std::collections::HashMap;
use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, sys};

use super::driver::capturing;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::spec::{AttnSpec, Window};

/// Entries kept per device and direction.
pub const CAPACITY: usize = 256;

/// What a plan depends on: the call's shape (dims, v's head_dim included, dtype, causal, sliding
/// window, segments, the page table of a paged K,V) and the options that change the plan. (v's
/// head_dim picks the backward's key tiles at head_dim 192: `backward::key_tile`; without it a
/// 192 / 128 call took the 64-key plan of an earlier 192 / 192 call over the same segments.)
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct PlanKey {
    dtype: DType,
    dims: [usize; 6],
    causal: bool,
    window: Window,
    segs: Vec<[usize; 4]>,
    /// The page table of a paged K,V (uploaded with the plan's tables).
    pages: Option<Vec<u32>>,
    opts: u64,
    extra: [u64; 2],
}

impl PlanKey {
    pub fn new(spec: &AttnSpec, opts: u64) -> PlanKey {
        let d = &spec.dims;
        PlanKey {
            dtype: spec.dtype,
            dims: [d.total_q, d.total_k, d.heads_q, d.heads_kv, d.head_dim, d.head_dim_v],
            causal: spec.causal,
            window: spec.window,
            segs: spec.segments.iter().map(|s| [s.q_start, s.q_len, s.k_start, s.k_len]).collect(),
            pages: spec.kv_pages().map(<[u32]>::to_vec),
            opts,
            extra: [0; 2],
        }
    }

    /// A key with two more words of what the plan depends on (the block-sparse index hashes).
    pub fn with_extra(spec: &AttnSpec, opts: u64, extra: [u64; 2]) -> PlanKey {
        PlanKey { extra, ..PlanKey::new(spec, opts) }
    }
}

/// The names of one plan kind's tables: an enum whose variants, in declaration order, are the
/// tables' upload order ([`table_names`]), so a launch asks for a table by name and a plan kind's
/// names cannot index another kind's tables.
pub(crate) trait TableName: Copy + std::fmt::Debug {
    const COUNT: usize;
    fn index(self) -> usize;
}

/// A plan kind: its host part, and the names of its device tables.
pub(crate) trait PlanKind {
    type Table: TableName;
}

/// Declares a plan kind's table names ([`TableName`]).
macro_rules! table_names {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($(#[$vm:meta])* $v:ident),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        $vis enum $name { $($(#[$vm])* $v),+ }
        impl $crate::backend::cuda::plans::TableName for $name {
            const COUNT: usize = [$($name::$v),+].len();
            fn index(self) -> usize {
                self as usize
            }
        }
    };
}
pub(crate) use table_names;

/// The tables a plan build makes, each put by name; a name left out is a bug of that build.
pub(crate) struct TableSet<K> {
    tables: Vec<Option<Vec<u32>>>,
    _names: PhantomData<K>,
}

impl<K: TableName> TableSet<K> {
    pub fn new() -> TableSet<K> {
        TableSet { tables: vec![None; K::COUNT], _names: PhantomData }
    }

    /// The set with table `name` (replacing none: each name is put once).
    pub fn with(mut self, name: K, table: Vec<u32>) -> TableSet<K> {
        debug_assert!(self.tables[name.index()].is_none(), "plan table {name:?} put twice");
        self.tables[name.index()] = Some(table);
        self
    }

    /// Device bytes the tables take in the plan cache (empty ones are one word).
    pub fn bytes(&self) -> u64 {
        self.tables.iter().map(|t| 4 * t.as_ref().map_or(0, Vec::len).max(1) as u64).sum()
    }

    fn into_tables(self) -> Vec<Vec<u32>> {
        self.tables
            .into_iter()
            .enumerate()
            .map(|(i, t)| t.unwrap_or_else(|| panic!("plan table {i} of {} was not built", std::any::type_name::<K>())))
            .collect()
    }
}

/// u32 tables on the device (one allocation), named by `K`.
pub(crate) struct Tables<K> {
    ptr: u64,
    spans: Vec<(u64, usize)>,
    stream: AtomicU64,
    ctx: usize,
    /// The uploaded words, kept alive until the entry goes (the upload is asynchronous).
    _host: Vec<u32>,
    _names: PhantomData<K>,
}

impl<K: TableName> Tables<K> {
    /// Device address and length (u32 words; empty tables are one zero word) of table `name`.
    pub fn get(&self, name: K) -> (u64, usize) {
        self.spans[name.index()]
    }

    fn upload(ctx: usize, tables: &[&[u32]], stream: sys::CUstream) -> Result<Tables<K>> {
        let mut host = Vec::new();
        let mut offs = Vec::new();
        for t in tables {
            // every table starts 16-byte aligned
            while host.len() % 4 != 0 {
                host.push(0);
            }
            offs.push((host.len(), t.len().max(1)));
            if t.is_empty() {
                host.push(0);
            } else {
                host.extend_from_slice(t);
            }
        }
        // `host` is kept in the returned value until the memory is freed
        let ptr = super::driver::upload_u32_async(&host, stream)?;
        let spans = offs.iter().map(|&(o, n)| (ptr + 4 * o as u64, n)).collect();
        Ok(Tables { ptr, spans, stream: AtomicU64::new(stream as u64), ctx, _host: host, _names: PhantomData })
    }
}

impl<K> Drop for Tables<K> {
    fn drop(&mut self) {
        let _ = super::driver::bind(self.ctx);
        // SAFETY: freed once, ordered after the last launch enqueued on the tracked stream.
        let _ = unsafe { drv::free_async(self.ptr, self.stream.load(Ordering::SeqCst) as sys::CUstream) };
    }
}

/// A cached plan: the host-side plan `P` and its tables on the device.
pub(crate) struct Cached<P: PlanKind> {
    pub host: P,
    pub tables: Tables<P::Table>,
}

struct Slot<P: PlanKind> {
    plan: Arc<Cached<P>>,
    last: u64,
    pinned: bool,
}

/// Per-device cache of plans of one kind.
pub(crate) struct PlanCache<P: PlanKind> {
    ctx: usize,
    inner: Mutex<(HashMap<PlanKey, Slot<P>>, u64)>,
}

impl<P: PlanKind> PlanCache<P> {
    pub fn new(ctx: usize) -> PlanCache<P> {
        PlanCache { ctx, inner: Mutex::new((HashMap::new(), 0)) }
    }

    /// The plan of `key` for a launch on `stream`. On a miss `build` makes the host plan and its
    /// tables, which are uploaded on `stream`; a miss while `stream` is being captured into a
    /// CUDA graph is an error (run the call once before capturing).
    pub fn get(
        &self,
        key: PlanKey,
        stream: sys::CUstream,
        build: impl FnOnce() -> (P, TableSet<P::Table>),
    ) -> Result<Arc<Cached<P>>> {
        self.get_init(key, stream, build, |_| Ok(()))
    }

    /// [`PlanCache::get`] with `init`, run once on a miss right after the new plan's tables are
    /// uploaded (under the cache lock, before anyone else sees the plan): it may enqueue device
    /// work on `stream` that fills tables in place (the plan's first stream, so a launch on
    /// another stream waits for it at the switch). An error drops the new plan.
    pub fn get_init(
        &self,
        key: PlanKey,
        stream: sys::CUstream,
        build: impl FnOnce() -> (P, TableSet<P::Table>),
        init: impl FnOnce(&Cached<P>) -> Result<()>,
    ) -> Result<Arc<Cached<P>>> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (map, tick) = &mut *g;
        *tick += 1;
        let now = *tick;
        let capture = capturing(stream)?;
        if let Some(slot) = map.get_mut(&key) {
            slot.last = now;
            let prev = slot.plan.tables.stream.swap(stream as u64, Ordering::SeqCst);
            if capture {
                // graph capture starts from an idle device (torch synchronizes before it); the
                // graph keeps this plan's addresses
                slot.pinned = true;
            } else if prev != stream as u64 {
                // SAFETY: `prev` is a stream this plan was launched on; waiting makes its work
                // (the upload included) complete before the plan follows the new stream.
                let _ = unsafe { drv::stream::synchronize(prev as sys::CUstream) };
            }
            return Ok(slot.plan.clone());
        }
        if capture {
            return Err(Error::Unsupported {
                backend: "cuda",
                msg: "this call shape has no launch plan yet and none can be uploaded during CUDA graph capture: \
                      run the call once (same shapes) before capturing"
                    .into(),
            });
        }
        let (host, tables) = build();
        let tables = tables.into_tables();
        let refs: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
        let plan = Arc::new(Cached { host, tables: Tables::upload(self.ctx, &refs, stream)? });
        init(&plan)?;
        if map.len() >= CAPACITY {
            let victim = map.iter().filter(|(_, s)| !s.pinned).min_by_key(|(_, s)| s.last).map(|(k, _)| k.clone());
            if let Some(k) = victim {
                map.remove(&k);
            }
        }
        map.insert(key, Slot { plan: plan.clone(), last: now, pinned: false });
        Ok(plan)
    }

    /// Number of cached plans (tests).
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TensorMeta;

    /// Calls that differ only in v's head_dim have plans of their own (the backward's key tiles
    /// follow it at head_dim 192).
    #[test]
    fn plan_key_tells_value_head_dims_apart() {
        let spec = |dv| {
            let m = |h, d| TensorMeta::new(&[300, h, d], DType::BF16);
            AttnSpec::varlen(&m(4, 192), &m(2, 192), &m(2, dv), &[0, 100, 300], &[0, 100, 300], 200, 200, None, true).unwrap()
        };
        assert_eq!(PlanKey::new(&spec(128), 0), PlanKey::new(&spec(128), 0));
        assert_ne!(PlanKey::new(&spec(192), 0), PlanKey::new(&spec(128), 0));
    }
}
