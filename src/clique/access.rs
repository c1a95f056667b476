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

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use super::args::{BufferInfo, Place};
use crate::config::MAX_GPUS;
use crate::engine::EngineGuard;
use crate::error::Result;
use crate::tensor::{DeviceTensor, DeviceTensorMut};

/// Where a stream lives, for validation.
pub(crate) fn place_of(stream: &CudaStream) -> Place {
    Place {
        ordinal: stream.context().ordinal(),
        ctx: stream.context().cu_ctx() as usize,
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

/// The streams of a call's buffers that are not their rank's clique stream, once each; every
/// one is live for `'s` (borrowed, or promised by [`Foreign::note_raw`]'s caller) and a stream
/// of its rank's context (validation checked every buffer's and raw stream's context first).
#[derive(Default)]
pub(crate) struct Foreign<'s> {
    list: Vec<(usize, CUstream)>,
    streams: PhantomData<&'s CudaStream>,
}

impl<'s> Foreign<'s> {
    /// Notes that a buffer of `rank` lives on `stream`, whose clique stream is `rank_stream`
    /// (an error if `stream` is of another context: validation refuses such buffers first).
    pub(crate) fn note(
        &mut self,
        rank: usize,
        stream: &'s CudaStream,
        rank_stream: &CudaStream,
    ) -> Result<()> {
        if stream.context().cu_ctx() != rank_stream.context().cu_ctx() {
            return Err(crate::error::Error::InvalidArgument(format!(
                "a buffer of rank {rank} is on a stream of another context"
            )));
        }
        if stream.cu_stream() != rank_stream.cu_stream() {
            // A buffer's stream that the caller is capturing: the orderings would record into
            // its graph, which gpucast does not count.
            // SAFETY: `stream` is borrowed, so live.
            let capturing = unsafe { crate::driver::stream::is_capturing(stream.cu_stream()) }
                .map_err(crate::error::Error::cuda(
                    "asking whether a buffer's stream is being captured",
                ))?;
            if capturing {
                return Err(crate::error::Error::CaptureInProgress);
            }
        }
        // SAFETY: `stream` is borrowed for `'s`, so live that long, and of the rank's context
        // (checked above).
        unsafe { self.note_raw(rank, stream.cu_stream(), rank_stream) };
        Ok(())
    }

    /// [`Foreign::note`] for a raw stream handle.
    ///
    /// # Safety
    /// `stream` is a live stream of rank `rank`'s context and stays live for `'s`.
    pub(crate) unsafe fn note_raw(
        &mut self,
        rank: usize,
        stream: CUstream,
        rank_stream: &CudaStream,
    ) {
        if stream != rank_stream.cu_stream() && !self.list.contains(&(rank, stream)) {
            self.list.push((rank, stream));
        }
    }

    /// Runs `f` (which queues work on the clique's streams) between the two orderings: every
    /// rank's stream waits for its foreign streams before, every foreign stream waits for its
    /// rank's stream after, even when `f` fails (whatever it queued must be waited for) and
    /// even when it panics: the after-orderings run before the panic goes on, so the buffers'
    /// guards, which record their events while it unwinds, record on streams that waited for
    /// whatever `f` queued.
    pub(crate) fn around(
        &self,
        engine: &mut EngineGuard<'_>,
        f: impl FnOnce(&mut EngineGuard<'_>) -> Result<()>,
    ) -> Result<()> {
        for &(rank, s) in &self.list {
            // SAFETY: every stream noted is a live stream of its rank's context for `'s` (the
            // type's invariant), and `self` is borrowed within `'s`.
            unsafe { engine.stream_waits_for(rank, s) }?;
        }
        // The engine's state stays consistent across a panic of `f` for what follows: the
        // orderings below only queue event records and waits on live streams.
        let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(engine)));
        let mut after = Ok(());
        for &(rank, s) in &self.list {
            // SAFETY: as above.
            after = after.and(unsafe { engine.waits_for_stream(rank, s) });
        }
        match done {
            Ok(done) => done.and(after),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// Queues `work` in the ordering sequence of a call with buffers (see the module's doc).
/// `buffers` names each buffer's local rank and stream (it is walked several times, so it
/// makes the iterator anew: no list is built per call). In order: an error cudarc stored on a
/// buffer's context is reported (nothing queued); `guard` takes every buffer's cudarc guard
/// (its waits) and returns them with what `work` needs (the addresses); a failed wait is
/// reported (nothing queued), the guards dropped while it is still stored, so that their
/// records fail too and every buffer's events stay as they were (a record on a stream that did
/// not wait would forget the buffer's earlier work); `work` queues the call between the
/// foreign streams' orderings ([`Foreign::around`]); the guards are dropped (their records)
/// and a failed record is reported (the call is queued).
pub(crate) fn ordered<'s, I, G>(
    engine: &mut EngineGuard<'_>,
    buffers: impl Fn() -> I,
    guard: impl FnOnce() -> G,
    work: impl FnOnce(&mut EngineGuard<'_>, &G) -> Result<()>,
) -> Result<()>
where
    I: Iterator<Item = (usize, &'s Arc<CudaStream>)>,
{
    let mut foreign = Foreign::default();
    for (local, s) in buffers() {
        foreign.note(local, s, engine.stream(local))?;
    }
    let streams = || buffers().map(|(_, s)| s);
    stored_error(streams(), Check::Before)?;
    let guards = guard();
    if let Some((ctx, e)) = take_stored(streams()) {
        ctx.record_err::<()>(Err(e));
        drop(guards);
        let _ = ctx.check_err();
        return Err(Check::Waits.error(e));
    }
    foreign.around(engine, |e| work(e, &guards))?;
    drop(guards);
    stored_error(streams(), Check::Records)
}

/// What a check of cudarc's stored errors guards.
#[derive(Clone, Copy)]
pub(crate) enum Check {
    /// Before the buffers' guards are taken: an error left by earlier work.
    Before,
    /// After the guards' waits, before anything is queued.
    Waits,
    /// After the call was queued and the guards dropped (their records).
    Records,
}

impl Check {
    /// The error for `source`, found by this check.
    fn error(self, source: DriverError) -> crate::error::Error {
        let during = match self {
            Check::Before => {
                "an earlier cudarc operation on a buffer's context (reported by this call, \
                 which queued nothing)"
            }
            Check::Waits => {
                "ordering a buffer's earlier work before this call (nothing was queued)"
            }
            Check::Records => {
                "recording a buffer's events after this call (it is queued: synchronize before \
                 touching its buffers on other streams)"
            }
        };
        crate::error::Error::Cuda {
            during: during.into(),
            source,
        }
    }
}

/// An error cudarc stored on the context of any of `streams`, reported now. cudarc keeps a
/// failed wait or record of a buffer guard as an error of the context, and while one is stored
/// every later guard of that context skips its waits and records (its first step, binding the
/// context, fails on it), which would leave buffers unordered without a word. So a call takes
/// the stored error first, fails if the guards' own waits failed (nothing is queued then), and
/// reports a failed record after it was queued.
pub(crate) fn stored_error<'s>(
    streams: impl IntoIterator<Item = &'s Arc<CudaStream>>,
    check: Check,
) -> Result<()> {
    match take_stored(streams) {
        Some((_, e)) => Err(check.error(e)),
        None => Ok(()),
    }
}

/// The first error cudarc stored on the context of any of `streams` (taken: no longer stored),
/// with its context; each context object looked at once (cudarc keeps the error in the
/// object: two objects of one CUDA context, as ranks sharing a GPU have, each keep their own).
fn take_stored<'s>(
    streams: impl IntoIterator<Item = &'s Arc<CudaStream>>,
) -> Option<(&'s Arc<CudaContext>, DriverError)> {
    let mut seen = [std::ptr::null(); MAX_GPUS + 1];
    for (i, s) in streams.into_iter().enumerate() {
        let ctx = s.context();
        if seen.contains(&Arc::as_ptr(ctx)) {
            continue;
        }
        if let Some(slot) = seen.get_mut(i) {
            *slot = Arc::as_ptr(ctx);
        }
        if let Err(e) = ctx.check_err() {
            return Some((ctx, e));
        }
    }
    None
}

/// Runs `f` with the buffers `outputs` as validation sees them, listed on the stack where a
/// call can be valid (at most [`MAX_GPUS`] of them), in a list of their own otherwise (for the
/// error that names their count).
pub(crate) fn with_infos<R>(
    outputs: &[&mut dyn DeviceTensorMut],
    f: impl FnOnce(&[BufferInfo]) -> R,
) -> R {
    if outputs.len() > MAX_GPUS {
        let infos: Vec<_> = outputs.iter().map(|o| info_of_dyn(&**o)).collect();
        return f(&infos);
    }
    let unused = BufferInfo {
        place: Place::default(),
        len: 0,
        dtype: crate::dtype::DType::U8,
    };
    let mut infos = [unused; MAX_GPUS];
    for (slot, o) in infos.iter_mut().zip(outputs) {
        *slot = info_of_dyn(&**o);
    }
    f(&infos[..outputs.len()])
}
