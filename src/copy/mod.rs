//! The copy-engine route: no kernel, no SM. Each rank pushes the message into the rank after
//! it in a chain that starts at the root ([`schedule::chain`]), chunk by chunk
//! ([`schedule::chunks`]), with `cuMemcpyAsync` on its own stream (its own copy engine), so every
//! link carries the message once whatever the number of ranks, and a rank forwards chunk k
//! while it receives chunk k + 1. Out of place, the root copies its own output on a second
//! stream, forked from its stream and joined back, so that copy runs beside the chain's.
//!
//! Pushing rather than pulling keeps every buffer's reads on its own stream. A probe of bare
//! driver calls on 2 H200 (2026-11-30, before 0a231a8; no committed file, so no figure here)
//! found a peer's pull from pool memory slowed by the root's own local copy, and the root's
//! push nearly not.
//!
//! Ordering between ranks:
//! - eager calls use one event per rank ([`schedule::eager_ops`]): a rank copies into its
//!   successor after the successor's stream reached the call, forwards chunk k after its
//!   predecessor's copy of chunk k, and leaves the call after the last copy into it;
//! - captured calls cannot wait on events of another rank's capture (each rank has a graph of
//!   its own), so they use stream memory operations on [`Flags`] in device memory: the same
//!   hand-offs as flags set to 1 by the writer and reset to 0 by the reader, which replay
//!   identically at every launch ([`schedule::captured_ops`]).

use std::sync::Arc;

use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{result, CudaContext, CudaEvent};

use crate::driver;
use crate::error::{Error, Result};
use crate::item::Item;
use crate::topology::Topology;
use schedule::{ChainOp, Chunk, Flag, WINDOW};

pub(crate) mod schedule;

/// Index of the "successor free" flag after the arrival flags.
const FREE: usize = WINDOW;
/// Event waits of the chain: plain.
const WAIT: sys::CUevent_wait_flags = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;

/// Bytes of one rank's flag area.
const FLAG_BYTES: usize = (WINDOW + 1) * 4;

/// `Ok` where the copy engines can run the broadcast of a clique of `topology`: every pair
/// has peer access, so that each rank's copy engine writes its successor's buffer directly;
/// otherwise the reason, as the error a forced call returns.
pub(crate) fn support(topology: &Topology) -> std::result::Result<(), Error> {
    match topology.missing_peer_access() {
        Some(why) => Err(Error::CopyEngineUnavailable(why)),
        None => Ok(()),
    }
}

/// Why the copy engines cannot run inside a capture, if they cannot: where two ranks share a
/// device (`shared_device`). A captured copy-engine broadcast waits on flags that another
/// rank's graph writes (stream memory operations, which have no timeout), and the streams of
/// one device share its few hardware queues: a graph waiting there holds back, for good, a
/// graph queued behind it that would write its flag.
pub(crate) fn graph_support(shared_device: bool) -> std::result::Result<(), Error> {
    if shared_device {
        return Err(Error::CopyEngineUnavailable(
            "the copy engines cannot run in a graph where ranks share a device: each \
             rank's graph waits on flags another rank's graph writes, without a timeout, \
             and two streams of one device can share a hardware queue, where such a wait \
             holds back the graph that would write its flag (use P2P or Auto)"
                .into(),
        ));
    }
    Ok(())
}

/// What the copy-engine path keeps between calls, under the engine's lock.
pub(crate) struct State {
    /// One event per rank for the chain of eager calls.
    events: Vec<CudaEvent>,
    /// The flags of captured calls, made at the first one.
    flags: Option<Flags>,
    /// Bumped whenever the flags are replaced (leaked): a graph captured before holds the
    /// old ones' addresses.
    pub(crate) gen: u64,
    /// A copy-engine step was queued inside the capture in progress.
    pub(crate) captured: bool,
    /// A graph launch reached some ranks and not others: their flag waits must be released
    /// (set to 1) until the streams drain.
    pub(crate) release: bool,
}

impl State {
    /// The path's state with its events (one per rank).
    pub(crate) fn new(events: Vec<CudaEvent>) -> State {
        State {
            events,
            flags: None,
            gen: 0,
            captured: false,
            release: false,
        }
    }

    /// Sets every flag to `value` ([`Flags::set`]), if any were made. Flags whose memset did
    /// not finish are leaked (a memset may still write them) and made anew when next needed.
    pub(crate) fn set_flags(&mut self, value: u32) -> Result<()> {
        let Some(flags) = &self.flags else {
            return Ok(());
        };
        match flags.set(value) {
            Err(e @ Error::StreamsBusy { .. }) => {
                tracing::warn!("a reset of the copy-engine flags did not finish: they are leaked");
                self.leak_flags();
                Err(e)
            }
            r => r,
        }
    }

    /// Leaks the flags (work that may still write them is queued), never to be reused.
    pub(crate) fn leak_flags(&mut self) {
        if let Some(flags) = self.flags.take() {
            std::mem::forget(flags);
            self.gen += 1;
        }
    }
}

/// The mode of a copy-engine flag wait: until the flag is at least the value waited for. The
/// flag announces copies a peer's copy engine wrote into this device, so where the device can
/// (`can_flush`: `CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES`), the wait also flushes them
/// before the work after it.
fn flag_wait_mode(can_flush: bool) -> u32 {
    let flush = if can_flush {
        sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_FLUSH as u32
    } else {
        0
    };
    sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32 | flush
}

/// One flag area per rank in device memory (`cuMemAlloc`, reachable by every peer through
/// peer access), all zero between calls.
pub(crate) struct Flags {
    areas: Vec<(Arc<CudaContext>, u64)>,
    /// Per rank: its device can flush remote writes at a stream wait.
    flush: Vec<bool>,
}

impl Flags {
    pub(crate) fn new(ctxs: &[Arc<CudaContext>]) -> Result<Flags> {
        let mut flags = Flags {
            areas: Vec::new(),
            flush: Vec::new(),
        };
        for ctx in ctxs {
            ctx.bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES;
            // SAFETY: a query of a live device handle.
            let can = unsafe { result::device::get_attribute(ctx.cu_device(), attr) };
            flags.flush.push(can.is_ok_and(|v| v != 0));
            // SAFETY: a plain allocation in the current context, freed in Drop.
            let ptr = unsafe { result::malloc_sync(FLAG_BYTES) }
                .map_err(Error::cuda("allocating copy-engine flags"))?;
            flags.areas.push((ctx.clone(), ptr));
        }
        if let Err(e) = flags.set(0) {
            // A memset may still write them: leaked, never freed.
            std::mem::forget(flags);
            return Err(e);
        }
        Ok(flags)
    }

    /// The device address of `rank`'s flag `flag`.
    fn addr(&self, rank: usize, flag: Flag) -> u64 {
        let index = match flag {
            Flag::Arrive(k) => k,
            Flag::Free => FREE,
        };
        self.areas[rank].1 + 4 * index as u64
    }

    /// Sets every flag of every rank to `value`, from the host, and waits for it (bounded,
    /// see [`driver::memset_now`]; on [`Error::StreamsBusy`] the caller leaks the flags). With
    /// 0 after the streams are drained: the reset before the next call. With 1 while streams
    /// may wait: releases every wait, so that graphs launched on only some ranks cannot hang
    /// (their data is undefined).
    pub(crate) fn set(&self, value: u32) -> Result<()> {
        for (ctx, ptr) in &self.areas {
            // SAFETY: `ptr` is this context's live allocation of FLAG_BYTES bytes, leaked by
            // the caller on StreamsBusy.
            unsafe { driver::memset_now(ctx, *ptr, value, FLAG_BYTES / 4) }?;
        }
        Ok(())
    }
}

impl Drop for Flags {
    fn drop(&mut self) {
        for (ctx, ptr) in &self.areas {
            // Not cudarc's bind_to_thread: an error it stored would skip the free (a leak).
            if driver::make_current(ctx).is_ok() {
                // SAFETY: allocated in `new`, not used again (the engine drops the flags only
                // when its streams are idle, and leaks them otherwise).
                let _ = unsafe { result::free_sync(*ptr) };
            }
        }
    }
}

/// One rank as a copy-engine call sees it.
pub(crate) struct Lane<'a> {
    /// Its device's primary context.
    pub ctx: &'a Arc<CudaContext>,
    /// The stream its work goes to now (its capture stream while a capture records).
    pub stream: CUstream,
    /// Its rank in the job, for errors.
    pub global: usize,
}

/// The operations of one call: its chunks and what each rank's stream does with them.
pub(crate) struct Call {
    chunks: Vec<Chunk>,
    ops: Vec<ChainOp>,
}

impl Call {
    /// The broadcast of `tensors` of `items` from local rank `root` over `n` ranks, chained
    /// from the root ([`schedule::chain`]); ordered by flags when `captured`, else by events.
    pub(crate) fn plan(
        root: usize,
        n: usize,
        items: &[Item],
        tensors: &[usize],
        captured: bool,
    ) -> Call {
        let bytes: Vec<usize> = items.iter().map(Item::bytes).collect();
        let total = tensors.iter().map(|&t| bytes[t]).sum();
        let chunks = schedule::chunks(tensors, &bytes, schedule::chunk_bytes(total, n));
        let order = schedule::chain(root, n);
        let ops = if captured {
            schedule::captured_ops(&order, chunks.len())
        } else {
            schedule::eager_ops(&order, chunks.len())
        };
        Call { chunks, ops }
    }
}

/// Copies `len` bytes from `src` to `dst` on `stream`, a stream of `lane`'s context, with its
/// copy engine.
///
/// # Safety
/// `dst` and `src` hold `len` bytes reachable from the lane's device, valid until `stream`
/// passes this point; `stream` is a live stream of the lane's context.
pub(crate) unsafe fn copy_on(
    lane: &Lane<'_>,
    stream: CUstream,
    dst: u64,
    src: u64,
    len: usize,
) -> Result<()> {
    lane.ctx
        .bind_to_thread()
        .map_err(Error::cuda("binding a context"))?;
    // SAFETY: per this function's contract, `stream` being a stream of the lane's context,
    // made current just above; unified addressing lets the driver find both devices from the
    // addresses.
    unsafe { driver::memory::copy_async(dst, src, len, stream) }.map_err(Error::cuda(format!(
        "copy-engine copy on rank {}",
        lane.global
    )))
}

/// The root's second stream, for its own copy out of place: forked from the root's stream
/// after everything queued there before the call, joined back before anything after it (the
/// engine's stream and events, used under its lock).
pub(crate) struct Beside<'a> {
    /// The root's context.
    pub ctx: &'a CudaContext,
    /// The stream the root's part of the call runs on.
    pub main: CUstream,
    /// The second stream.
    pub aux: CUstream,
    /// The event of the fork, the root's own.
    pub fork: sys::CUevent,
    /// The event of the join, the root's own.
    pub join: sys::CUevent,
    /// The root's job rank, for errors.
    pub global: usize,
}

impl State {
    /// The copy-engine broadcast of `tensors` of `items` from local rank `root`: the root's own
    /// copies (where out of place) on `beside`'s second stream, between its fork and its join,
    /// beside the chain ([`State::queue`]) on every lane.
    ///
    /// # Safety
    /// As for [`State::queue`]; `beside` holds live streams of the root's context and events of
    /// it that nothing else records meanwhile.
    pub(crate) unsafe fn broadcast(
        &mut self,
        lanes: &[Lane<'_>],
        root: usize,
        items: &[Item],
        tensors: &[usize],
        call: &Call,
        beside: &Beside<'_>,
    ) -> Result<()> {
        let own: Vec<&Item> = tensors
            .iter()
            .map(|&t| &items[t])
            .filter(|it| it.dsts[root] != it.src)
            .collect();
        if own.is_empty() {
            // SAFETY: per this function's contract.
            return unsafe { self.queue(lanes, root, items, call) };
        }
        let g = beside.global;
        // SAFETY: the fork's event is the root's, both streams of its context (contract).
        unsafe { driver::stream::order(beside.ctx, beside.fork, beside.main, beside.aux) }
            .map_err(Error::cuda(format!("forking rank {g}'s second stream")))?;
        let mut queued = Ok(());
        for it in own {
            // SAFETY: per this function's contract: the root's input and output hold the
            // tensor, and `aux`, a stream of the root's context, runs after the root's stream
            // reached the call (the fork).
            queued =
                unsafe { copy_on(&lanes[root], beside.aux, it.dsts[root], it.src, it.bytes()) };
            if queued.is_err() {
                break;
            }
        }
        if queued.is_ok() {
            // SAFETY: per this function's contract.
            queued = unsafe { self.queue(lanes, root, items, call) };
        }
        // Joined whatever failed above, so the root's stream never moves past work still
        // queued on the side.
        // SAFETY: as for the fork.
        let joined =
            unsafe { driver::stream::order(beside.ctx, beside.join, beside.aux, beside.main) }
                .map_err(Error::cuda(format!("joining rank {g}'s second stream")));
        queued.and(joined)
    }

    /// Queues `call` over `items` on `lanes` (one per local rank, in order), `root` being the
    /// chain's first rank.
    ///
    /// # Safety
    /// `lanes` are this state's ranks, in order (the contexts its events and flags were made
    /// on); every lane's stream is a live stream of its context; and each of `items` holds, on every
    /// rank, buffers of its size that stay valid until that rank's stream passes this call
    /// (the root's input at `src`, each rank's output at `dsts[rank]`), reachable from every
    /// device (peer access between every pair).
    pub(crate) unsafe fn queue(
        &mut self,
        lanes: &[Lane<'_>],
        root: usize,
        items: &[Item],
        call: &Call,
    ) -> Result<()> {
        if call
            .ops
            .iter()
            .any(|o| matches!(o, ChainOp::WaitFlag { .. } | ChainOp::WriteFlag { .. }))
            && self.flags.is_none()
        {
            let ctxs: Vec<_> = lanes.iter().map(|l| l.ctx.clone()).collect();
            self.flags = Some(Flags::new(&ctxs)?);
        }
        // After a failure the copies stop but every record and wait still goes out: each
        // rank's stream then waits for whatever copies into its buffers did go out, so no
        // stream moves past a copy still writing a buffer its caller may free.
        let mut failed: Option<Error> = None;
        for op in &call.ops {
            if failed.is_some() && !op.after_failure() {
                continue;
            }
            // SAFETY: per this function's contract.
            if let Err(e) = unsafe { self.queue_op(lanes, root, items, &call.chunks, op) } {
                failed.get_or_insert(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Queues one operation of [`State::queue`].
    ///
    /// # Safety
    /// As for [`State::queue`].
    unsafe fn queue_op(
        &self,
        lanes: &[Lane<'_>],
        root: usize,
        items: &[Item],
        chunks: &[Chunk],
        op: &ChainOp,
    ) -> Result<()> {
        match *op {
            ChainOp::Record { rank } => {
                let event = self.events[rank].cu_event();
                // SAFETY: the event and the stream belong to the rank's context.
                unsafe { result::event::record(event, lanes[rank].stream) }
                    .map_err(Error::cuda("recording a copy-engine event"))?;
            }
            ChainOp::Wait { rank, of } => {
                let event = self.events[of].cu_event();
                // SAFETY: live stream and event; events of another device may be waited on.
                unsafe { result::stream::wait_event(lanes[rank].stream, event, WAIT) }
                    .map_err(Error::cuda("ordering copy-engine ranks"))?;
            }
            ChainOp::Copy {
                rank,
                into,
                from,
                chunk,
            } => {
                let c = &chunks[chunk];
                let it = &items[c.tensor];
                let base = if from == root { it.src } else { it.dsts[from] };
                let off = c.offset as u64;
                let lane = &lanes[rank];
                // SAFETY: per this function's contract: both buffers hold the tensor, and
                // the chunk lies inside it.
                unsafe { copy_on(lane, lane.stream, it.dsts[into] + off, base + off, c.len) }?;
            }
            ChainOp::WaitFlag { rank, flag } => {
                let addr = self.flags().addr(rank, flag);
                let mode = flag_wait_mode(self.flags().flush[rank]);
                // SAFETY: the rank's stream is live (this function's contract); `addr` is a
                // live flag of this state's areas, reachable from this device (peer access
                // between every pair).
                unsafe { driver::stream::wait_value_32(lanes[rank].stream, addr, 1, mode) }
                    .map_err(Error::cuda("queueing a copy-engine flag wait"))?;
            }
            ChainOp::WriteFlag {
                rank,
                owner,
                flag,
                value,
            } => {
                let addr = self.flags().addr(owner, flag);
                // The default write follows the work before it with a memory barrier: the
                // copies it announces are visible first.
                let mode = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
                // SAFETY: as for the wait; the flags are this state's own, written only by the
                // engine's streams.
                unsafe { driver::stream::write_value_32(lanes[rank].stream, addr, value, mode) }
                    .map_err(Error::cuda("queueing a copy-engine flag write"))?;
            }
        }
        Ok(())
    }

    fn flags(&self) -> &Flags {
        self.flags
            .as_ref()
            .expect("made before the first flag operation")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_wait_flushes_remote_writes_where_the_device_can() {
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        let flush = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_FLUSH as u32;
        assert_eq!(flag_wait_mode(true), geq | flush);
        assert_eq!(flag_wait_mode(false), geq);
    }
}
