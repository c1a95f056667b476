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
use crate::plan::{self, ChainOp, Chunk, Flag, WINDOW};

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

    /// The device address of `rank`'s flag `flag`.
    fn addr(&self, rank: usize, flag: Flag) -> u64 {
        let index = match flag {
            Flag::Arrive(k) => k,
            Flag::Done => DONE,
        };
        self.areas[rank].1 + 4 * index as u64
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
        let capturing = self
            .engine
            .capturing
            .load(std::sync::atomic::Ordering::Acquire);
        self.state.captured_ce |= capturing;
        let ops = if capturing {
            plan::captured_ops(&order, chunks.len())
        } else {
            plan::eager_ops(&order, chunks.len())
        };
        // The root announces its input (the first operation) before it copies its own output,
        // so that the peers' copies overlap that local one instead of waiting for it.
        let split = ops.len().min(1);
        // SAFETY: per this function's contract.
        unsafe { self.queue(root, items, &chunks, &ops[..split]) }?;
        for &t in tensors {
            let it = &items[t];
            if it.dsts[root] != it.src {
                // SAFETY: per this function's contract.
                unsafe { self.copy(root, it.dsts[root], it.src, it.bytes()) }?;
            }
        }
        // SAFETY: per this function's contract.
        unsafe { self.queue(root, items, &chunks, &ops[split..]) }
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

    /// Queues `ops` (from [`plan::eager_ops`] or [`plan::captured_ops`]) over `chunks` of
    /// `items`, `root` being the chain's first rank.
    ///
    /// # Safety
    /// As for [`EngineGuard::run`].
    unsafe fn queue(
        &mut self,
        root: usize,
        items: &[Item],
        chunks: &[Chunk],
        ops: &[ChainOp],
    ) -> Result<()> {
        if ops
            .iter()
            .any(|o| matches!(o, ChainOp::WaitFlag { .. } | ChainOp::WriteFlag { .. }))
            && self.state.ce_flags.is_none()
        {
            let ctxs: Vec<_> = self.engine.ranks.iter().map(|r| r.ctx.clone()).collect();
            self.state.ce_flags = Some(Flags::new(&ctxs)?);
        }
        for op in ops {
            match *op {
                ChainOp::Record { rank } => {
                    let event = self.state.ce_events[rank].cu_event();
                    // SAFETY: the event and the stream belong to the rank's context.
                    unsafe { result::event::record(event, self.raw_stream(rank)) }
                        .map_err(Error::cuda("recording a copy-engine event"))?;
                }
                ChainOp::Wait { rank, of } => {
                    let event = self.state.ce_events[of].cu_event();
                    // SAFETY: live stream and event; events of another device may be waited on.
                    unsafe {
                        result::stream::wait_event(
                            self.raw_stream(rank),
                            event,
                            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                        )
                    }
                    .map_err(Error::cuda("ordering copy-engine ranks"))?;
                }
                ChainOp::Copy { rank, from, chunk } => {
                    let c = &chunks[chunk];
                    let it = &items[c.tensor];
                    let base = if from == root { it.src } else { it.dsts[from] };
                    let off = c.offset as u64;
                    // SAFETY: per this function's contract: both buffers hold the tensor, and
                    // the chunk lies inside it.
                    unsafe { self.copy(rank, it.dsts[rank] + off, base + off, c.len) }?;
                }
                ChainOp::WaitFlag { rank, flag } => {
                    let addr = self.flags().addr(rank, flag);
                    let mode = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
                    // SAFETY: `addr` is a live flag of the engine's areas, reachable from this
                    // device (peer access between every pair).
                    unsafe { sys::cuStreamWaitValue32_v2(self.raw_stream(rank), addr, 1, mode) }
                        .result()
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
                    // SAFETY: as for the wait.
                    unsafe {
                        sys::cuStreamWriteValue32_v2(self.raw_stream(rank), addr, value, mode)
                    }
                    .result()
                    .map_err(Error::cuda("queueing a copy-engine flag write"))?;
                }
            }
        }
        Ok(())
    }

    fn flags(&self) -> &Flags {
        self.state
            .ce_flags
            .as_ref()
            .expect("made before the first flag operation")
    }
}
