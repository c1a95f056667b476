//! Buffers become addresses here, ordered so that a caller may drop, reuse or overwrite any
//! buffer, on any stream, as soon as a call returns.
//!
//! For each buffer of a call, gpucast takes cudarc's own access guard on the buffer's own
//! stream `S` (`device_ptr` / `device_ptr_mut`): `S` first waits for the buffer's pending
//! cudarc events (work on other streams), and the guard, dropped after the call, records the
//! buffer's read or write event on `S`. Then:
//!
//! - when `S` is the rank's clique stream (the common case), the broadcast is simply queued
//!   behind the buffer's earlier work on that stream, and the buffer's free and later work on
//!   `S` queue behind the broadcast: no event is needed beyond cudarc's own (the clique's
//!   streams are cudarc streams, so cudarc tracks every buffer of its contexts, and work on
//!   any other stream, the default stream included, waits for the events recorded here);
//! - otherwise the rank's stream waits for `S` before the broadcast, and `S` waits for the
//!   rank's stream after it, before the guard records on `S`. The buffer's free (which cudarc
//!   queues on `S`) and any later use ordered by cudarc's events thus come after the broadcast.
//!
//! A buffer from another context than the clique's on its device is rejected by validation.

use std::sync::Arc;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaStream, DeviceSlice};

use super::args::{BufferInfo, Place};
use crate::dtype::{DType, Element};
use crate::engine::{EngineGuard, Item};
use crate::error::Result;
use crate::tensor::DeviceTensor;

/// Where a stream lives, for validation.
pub(crate) fn place_of(stream: &CudaStream) -> Place {
    Place {
        ordinal: stream.context().ordinal(),
        ctx: stream.context().cu_ctx() as usize,
    }
}

/// A typed buffer as validation sees it.
pub(crate) fn info_of<T: Element, S: DeviceSlice<T>>(s: &S) -> BufferInfo {
    BufferInfo {
        place: place_of(s.stream()),
        len: s.len(),
        dtype: T::DTYPE,
    }
}

/// A type-erased buffer as validation sees it.
pub(crate) fn info_of_dyn(t: &dyn DeviceTensor) -> BufferInfo {
    BufferInfo {
        place: place_of(t.stream()),
        len: t.len(),
        dtype: t.dtype(),
    }
}

/// The streams of a call's buffers that are not their rank's clique stream, once each.
#[derive(Default)]
pub(crate) struct Foreign {
    list: Vec<(usize, CUstream)>,
}

impl Foreign {
    /// Notes that a buffer of `rank` lives on `stream`, whose clique stream is `rank_stream`.
    pub(crate) fn note(&mut self, rank: usize, stream: &CudaStream, rank_stream: &CudaStream) {
        self.note_raw(rank, stream.cu_stream(), rank_stream);
    }

    /// [`Foreign::note`] for a raw stream handle.
    pub(crate) fn note_raw(&mut self, rank: usize, stream: CUstream, rank_stream: &CudaStream) {
        if stream != rank_stream.cu_stream() && !self.list.contains(&(rank, stream)) {
            self.list.push((rank, stream));
        }
    }

    /// Runs `f` (which queues work on the clique's streams) between the two orderings: every
    /// rank's stream waits for its foreign streams before, every foreign stream waits for its
    /// rank's stream after, even when `f` fails (whatever it queued must be waited for).
    pub(crate) fn around(
        &self,
        engine: &mut EngineGuard<'_>,
        f: impl FnOnce(&mut EngineGuard<'_>) -> Result<()>,
    ) -> Result<()> {
        for &(rank, s) in &self.list {
            engine.stream_waits_for(rank, s)?;
        }
        let done = f(engine);
        let mut after = Ok(());
        for &(rank, s) in &self.list {
            after = after.and(engine.waits_for_stream(rank, s));
        }
        done.and(after)
    }
}

/// Clones of the buffers' streams, so that guards can borrow them while the buffers are
/// borrowed mutably.
pub(crate) fn streams_of<'t>(
    tensors: impl Iterator<Item = &'t Arc<CudaStream>>,
) -> Vec<Arc<CudaStream>> {
    tensors.cloned().collect()
}

/// An item for a tensor of `count` elements of `dtype`.
pub(crate) fn item(src: u64, dsts: &[u64], count: usize, dtype: DType) -> Item {
    let mut item = Item {
        src,
        dsts: [0; crate::config::MAX_GPUS],
        count,
        dtype,
    };
    item.dsts[..dsts.len()].copy_from_slice(dsts);
    item
}
