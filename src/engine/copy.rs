//! The copy-engine route: no kernel, no SM. Each rank copies the message from the rank before
//! it in a chain that starts at the root ([`plan::chain`]), chunk by chunk
//! ([`plan::chunks`]), with `cuMemcpyAsync` on its own stream, so every link carries the
//! message once whatever the number of ranks, and a rank forwards chunk k while it receives
//! chunk k + 1.
//!
//! Ordering between ranks:
//! - eager calls use one event per rank: rank `chain[i]` waits for the event its predecessor
//!   recorded after copying the same chunk (the calls are queued chunk by chunk, so the event's
//!   latest record is always that chunk's), and at the end every rank waits for its successor,
//!   so no rank's stream moves past the call while another still reads its buffer;
//! - captured calls cannot wait on events of another rank's capture (each rank has a graph of
//!   its own), so they use stream memory operations on [`Flags`] in device memory: the same
//!   hand-offs as flags set to 1 by the writer and reset to 0 by the reader, which replay
//!   identically at every launch.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{result, CudaContext};

use super::{EngineGuard, Item};
use crate::error::{Error, Result};
use crate::plan::{self, Chunk};

/// Chunks of one captured hand-off window: one arrival flag each.
const WINDOW: usize = 64;
/// Index of the "successor done" flag after the arrival flags.
const DONE: usize = WINDOW;
/// Bytes of one rank's flag area.
const FLAG_BYTES: usize = (WINDOW + 1) * 4;

/// One flag area per rank in device memory (`cuMemAlloc`, reachable by every peer through
/// peer access), all zero between calls.
pub(crate) struct Flags {
    areas: Vec<(Arc<CudaContext>, u64)>,
}

impl Flags {
    pub(crate) fn new(ctxs: &[Arc<CudaContext>]) -> Result<Flags> {
        let mut flags = Flags { areas: Vec::new() };
        for ctx in ctxs {
            ctx.bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: a plain allocation in the current context, freed in Drop.
            let ptr = unsafe { result::malloc_sync(FLAG_BYTES) }
                .map_err(Error::cuda("allocating copy-engine flags"))?;
            flags.areas.push((ctx.clone(), ptr));
        }
        flags.set(0)?;
        Ok(flags)
    }

    fn arrive(&self, rank: usize, k: usize) -> u64 {
        self.areas[rank].1 + 4 * k as u64
    }

    fn done(&self, rank: usize) -> u64 {
        self.arrive(rank, DONE)
    }

    /// Sets every flag of every rank to `value`, from the host. With 0 after the streams are
    /// drained: the reset before the next call. With 1 while streams may wait: releases every
    /// wait, so that graphs launched on only some ranks cannot hang (their data is undefined).
    pub(crate) fn set(&self, value: u32) -> Result<()> {
        for (ctx, ptr) in &self.areas {
            ctx.bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            // SAFETY: `ptr` is this context's live allocation of FLAG_BYTES bytes.
            unsafe { sys::cuMemsetD32_v2(*ptr, value, FLAG_BYTES / 4).result() }
                .map_err(Error::cuda("setting copy-engine flags"))?;
        }
        Ok(())
    }
}

impl Drop for Flags {
    fn drop(&mut self) {
        for (ctx, ptr) in &self.areas {
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated in `new`, not used again (the engine drops the flags only
                // when its streams are idle, and leaks them otherwise).
                let _ = unsafe { result::free_sync(*ptr) };
            }
        }
    }
}

impl EngineGuard<'_> {
    /// Enqueues the copy-engine broadcast of `tensors` of `items` from job rank `root` (a rank
    /// of this process), including the root's own output when out of place.
    ///
    /// # Safety
    /// As for [`EngineGuard::run`].
    pub(super) unsafe fn copy_engine(
        &mut self,
        root: usize,
        items: &[Item],
        tensors: &[usize],
    ) -> Result<()> {
        let n = self.n();
        let root = self
            .engine
            .ranks
            .iter()
            .position(|r| r.global == root)
            .ok_or_else(|| {
                Error::CopyEngineUnavailable("the root is not a rank of this process".into())
            })?;
        let bytes: Vec<usize> = items.iter().map(Item::bytes).collect();
        let total = tensors.iter().map(|&t| bytes[t]).sum();
        let chunks = plan::chunks(tensors, &bytes, plan::chunk_bytes(total, n));
        let order = plan::chain(root, n);
        for &t in tensors {
            let it = &items[t];
            if it.dsts[root] != it.src {
                // SAFETY: per this function's contract.
                unsafe { self.copy(root, it.dsts[root], it.src, it.bytes()) }?;
            }
        }
        if n == 1 || chunks.is_empty() {
            return Ok(());
        }
        // SAFETY: per this function's contract.
        unsafe {
            if self
                .engine
                .capturing
                .load(std::sync::atomic::Ordering::Acquire)
            {
                self.chain_captured(&order, items, &chunks)
            } else {
                self.chain_eager(&order, items, &chunks)
            }
        }
    }

    /// The source of `chunk` for rank `order[i]`: its predecessor's output, or the root's input.
    fn source(order: &[usize], i: usize, items: &[Item], c: &Chunk) -> u64 {
        let it = &items[c.tensor];
        let pred = order[i - 1];
        let base = if i == 1 { it.src } else { it.dsts[pred] };
        base + c.offset as u64
    }

    /// # Safety
    /// `dst` and `src` hold `len` bytes reachable from `rank`'s device, valid until its stream
    /// passes this point.
    unsafe fn copy(&self, rank: usize, dst: u64, src: u64, len: usize) -> Result<()> {
        let r = &self.engine.ranks[rank];
        r.ctx
            .bind_to_thread()
            .map_err(Error::cuda("binding a context"))?;
        // SAFETY: per this function's contract; unified addressing lets the driver find both
        // devices from the addresses.
        unsafe { sys::cuMemcpyAsync(dst, src, len, r.stream.get().cu_stream()).result() }.map_err(
            Error::cuda(format!("copy-engine copy on rank {}", r.global)),
        )
    }

    fn raw_stream(&self, rank: usize) -> CUstream {
        self.engine.ranks[rank].stream.get().cu_stream()
    }

    /// Records rank `rank`'s copy-engine event on its stream.
    fn signal_event(&self, rank: usize) -> Result<()> {
        let event = self.state.ce_events[rank].cu_event();
        // SAFETY: the event belongs to the rank's context, the stream too.
        unsafe { result::event::record(event, self.raw_stream(rank)) }
            .map_err(Error::cuda("recording a copy-engine event"))
    }

    /// Makes `rank`'s stream wait for the latest record of `of`'s copy-engine event.
    fn wait_event(&self, rank: usize, of: usize) -> Result<()> {
        let event = self.state.ce_events[of].cu_event();
        // SAFETY: live stream and event; events of another device may be waited on.
        unsafe {
            result::stream::wait_event(
                self.raw_stream(rank),
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(Error::cuda("ordering copy-engine ranks"))
    }

    /// # Safety
    /// As for [`EngineGuard::run`].
    unsafe fn chain_eager(
        &mut self,
        order: &[usize],
        items: &[Item],
        chunks: &[Chunk],
    ) -> Result<()> {
        let n = order.len();
        self.signal_event(order[0])?;
        for (k, c) in chunks.iter().enumerate() {
            for i in 1..n {
                let me = order[i];
                // The root's event was recorded once, before the first chunk.
                if i > 1 || k == 0 {
                    self.wait_event(me, order[i - 1])?;
                }
                let dst = items[c.tensor].dsts[me] + c.offset as u64;
                // SAFETY: per this function's contract.
                unsafe { self.copy(me, dst, Self::source(order, i, items, c), c.len) }?;
                if i + 1 < n {
                    self.signal_event(me)?;
                }
            }
        }
        // Every rank but the last waits until its successor has read all of its buffer (the
        // latest record of each event but the last rank's is after its last copy).
        self.signal_event(order[n - 1])?;
        for i in 1..n {
            self.wait_event(order[i - 1], order[i])?;
        }
        Ok(())
    }

    /// Queues a wait on the stream of `rank` until the flag at `addr` is at least 1.
    fn wait_flag(&self, rank: usize, addr: u64) -> Result<()> {
        let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: `addr` is a live flag of the engine's areas, reachable from this device.
        unsafe { sys::cuStreamWaitValue32_v2(self.raw_stream(rank), addr, 1, flags).result() }
            .map_err(Error::cuda("queueing a copy-engine flag wait"))
    }

    /// Queues a write of `value` to the flag at `addr` on the stream of `rank`, after the work
    /// before it (with a memory barrier: the copies it follows are visible first).
    fn write_flag(&self, rank: usize, addr: u64, value: u32) -> Result<()> {
        let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        // SAFETY: as in `wait_flag`.
        unsafe { sys::cuStreamWriteValue32_v2(self.raw_stream(rank), addr, value, flags).result() }
            .map_err(Error::cuda("queueing a copy-engine flag write"))
    }

    /// # Safety
    /// As for [`EngineGuard::run`].
    unsafe fn chain_captured(
        &mut self,
        order: &[usize],
        items: &[Item],
        chunks: &[Chunk],
    ) -> Result<()> {
        let n = order.len();
        if self.state.ce_flags.is_none() {
            let ctxs: Vec<_> = self.engine.ranks.iter().map(|r| r.ctx.clone()).collect();
            self.state.ce_flags = Some(Flags::new(&ctxs)?);
        }
        let flags = self.state.ce_flags.as_ref().expect("created above");
        for window in chunks.chunks(WINDOW) {
            self.write_flag(order[0], flags.arrive(order[1], 0), 1)?;
            for (k, c) in window.iter().enumerate() {
                for i in 1..n {
                    let me = order[i];
                    if i > 1 || k == 0 {
                        self.wait_flag(me, flags.arrive(me, k))?;
                    }
                    let dst = items[c.tensor].dsts[me] + c.offset as u64;
                    // SAFETY: per this function's contract.
                    unsafe { self.copy(me, dst, Self::source(order, i, items, c), c.len) }?;
                    if i + 1 < n {
                        self.write_flag(me, flags.arrive(order[i + 1], k), 1)?;
                    }
                }
            }
            for i in 1..n {
                let me = order[i];
                for k in 0..window.len() {
                    self.write_flag(me, flags.arrive(me, k), 0)?;
                }
                self.write_flag(me, flags.done(order[i - 1]), 1)?;
            }
            for &me in &order[..n - 1] {
                self.wait_flag(me, flags.done(me))?;
                self.write_flag(me, flags.done(me), 0)?;
            }
        }
        Ok(())
    }
}
