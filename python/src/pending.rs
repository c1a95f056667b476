//! Tensors kept alive until the GPU work of the calls they were given to has run.
//!
//! A call returns while its work is still queued. Its tensors' memory must outlive that work
//! whatever the caller does (drop the tensor at once, so that its allocator hands the memory
//! to a tensor on another stream): each call hands its tensors' owners here, and they are
//! dropped only once a *fence* recorded after the call's work has completed.
//!
//! Fences are batched: a call's owners join the batch of unfenced owners, and a fence (one
//! event on every stream a call may queue work on) is recorded only when the batch has
//! [`FENCE_EVERY`] calls, [`FENCE_OWNERS`] owners or [`FENCE_BYTES`] bytes of tensors, and
//! before the clique or communicator synchronizes or goes ([`Pending::fence`]). Work on each stream runs in the order it was
//! queued, so a fence recorded after a batch's last call covers every call of the batch.
//! Completion is polled (`cuEventQuery`, oldest fence first, stopping at the first not done)
//! when a fence is recorded, at every call while a batch of `FENCE_BYTES` or more waits, and
//! at `synchronize`, never waited for here, so keeping costs no
//! wait; the owners of the batches whose fences have completed are dropped then.
//!
//! Memory: a call's owners are held until the fence of its batch has completed and a later
//! poll has seen it: with the work done, at most `2 * FENCE_EVERY - 1` calls after the call
//! (fewer for calls of many tensors or large ones), where one event per call polled at every
//! call held them until the next call. Beyond what that held, the added hold is at most the
//! unfenced batch and one completed batch not yet polled: each under `FENCE_BYTES` of tensors
//! plus its last call's, `FENCE_OWNERS` owners plus its last call's (a call of tensors of
//! `FENCE_BYTES` or more is fenced at once, and its batch polled at every later call until it
//! is released: such tensors go at the first call after their work ran, as before). Nothing
//! else is held:
//! the lists hold only batches not yet seen complete.
//!
//! Owners whose call's end cannot be known (a fence that could not be recorded on every
//! stream) and owners whose fence has not completed when the `Pending` goes are never
//! released: leaked, not freed early.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use gpucast::cudarc::driver::sys::CUevent_flags;
use gpucast::cudarc::driver::{CudaEvent, CudaStream};
use pyo3::prelude::*;

/// Calls per fence (at most): a fence is recorded when a batch has this many calls.
pub(crate) const FENCE_EVERY: usize = 8;

/// Owners per fence (at least): a batch with this many owners is fenced at once, whatever its
/// number of calls (calls with many tensors).
pub(crate) const FENCE_OWNERS: usize = 64;

/// Bytes per fence (at least): a batch whose tensors hold this many bytes is fenced at once
/// (bounds the memory batching holds; such calls run long enough that an event each is cheap).
pub(crate) const FENCE_BYTES: usize = 64 << 20;

/// The mark, after some queued work, that tells when that work has run.
pub(crate) trait Fence {
    /// Whether the work before the fence has run; `false` when that cannot be told (an error
    /// querying it: then it is never released, as if never done).
    fn done(&self) -> bool;
}

/// The batching of owners behind fences, apart from the driver (tests use a fake fence).
///
/// Owners given to [`Batches::add`] wait in the unfenced batch; [`Batches::fenced`] closes the
/// batch behind a fence recorded after all of its calls' work; [`Batches::take_done`] hands
/// out the batches of completed fences, oldest first.
pub(crate) struct Batches<F, O> {
    /// Owners of calls after the last fence.
    unfenced: Vec<O>,
    /// Calls in `unfenced`.
    calls: usize,
    /// Bytes of the tensors of `unfenced`.
    bytes: usize,
    /// Fenced batches, oldest first (fences recorded in this order).
    fenced: VecDeque<(F, Vec<O>)>,
    /// Whether each fenced batch (in `fenced`'s order) holds [`FENCE_BYTES`] or more: such a
    /// batch is polled at every call until released (see [`Batches::large_pending`]).
    large: VecDeque<bool>,
}

impl<F: Fence, O> Batches<F, O> {
    pub(crate) fn new() -> Batches<F, O> {
        Batches {
            unfenced: Vec::new(),
            calls: 0,
            bytes: 0,
            fenced: VecDeque::new(),
            large: VecDeque::new(),
        }
    }

    /// Adds the owners of one call whose work has been queued, which `push` pushes, returning
    /// the bytes of their tensors (a call without owners counts for nothing); returns whether
    /// the batch is due a fence.
    pub(crate) fn add_with(&mut self, push: impl FnOnce(&mut Vec<O>) -> usize) -> bool {
        let before = self.unfenced.len();
        let bytes = push(&mut self.unfenced);
        if self.unfenced.len() > before {
            self.calls += 1;
            self.bytes = self.bytes.saturating_add(bytes);
        }
        self.calls >= FENCE_EVERY
            || self.unfenced.len() >= FENCE_OWNERS
            || self.bytes >= FENCE_BYTES
    }

    /// Whether some owners wait for a fence.
    pub(crate) fn has_unfenced(&self) -> bool {
        !self.unfenced.is_empty()
    }

    /// Closes the unfenced batch behind `fence`, recorded after the work of every call added
    /// so far. `None` (no fence could be recorded): nothing will ever tell when that work has
    /// run, so the batch's owners are returned to be leaked.
    #[must_use = "the owners of an unfenced batch must be leaked"]
    pub(crate) fn fenced(&mut self, fence: Option<F>) -> Vec<O> {
        self.calls = 0;
        let large = std::mem::take(&mut self.bytes) >= FENCE_BYTES;
        // The next batch starts with room for as many owners as this one: calls of a steady
        // shape fill it without growing it.
        let room = self.unfenced.len().min(FENCE_OWNERS);
        let owners = std::mem::replace(&mut self.unfenced, Vec::with_capacity(room));
        match fence {
            Some(f) => {
                if !owners.is_empty() {
                    self.fenced.push_back((f, owners));
                    self.large.push_back(large);
                }
                Vec::new()
            }
            None => owners,
        }
    }

    /// The batches whose fences have completed, oldest first (a fence is queried only when
    /// every older one has completed), with their fences for reuse.
    pub(crate) fn take_done(&mut self) -> Vec<(F, Vec<O>)> {
        let mut done = Vec::new();
        while self.fenced.front().is_some_and(|(f, _)| f.done()) {
            done.extend(self.fenced.pop_front());
            self.large.pop_front();
        }
        done
    }

    /// Whether a fenced batch of [`FENCE_BYTES`] or more waits for release: then every call
    /// polls ([`Batches::take_done`]), so that a large tensor is released at the first call
    /// after its work ran, as without batching, not up to [`FENCE_EVERY`] calls later.
    pub(crate) fn large_pending(&self) -> bool {
        self.large.iter().any(|&l| l)
    }

    /// At the end: the owners that may be released (their fences completed) and those that
    /// must be leaked (fences not completed, and owners never fenced).
    pub(crate) fn finish(self) -> (Vec<O>, Vec<O>) {
        let (mut release, mut leak) = (Vec::new(), self.unfenced);
        for (f, owners) in self.fenced {
            if f.done() {
                release.extend(owners);
            } else {
                leak.extend(owners);
            }
        }
        (release, leak)
    }
}

/// A fence of the driver: one event after the work queued on each stream.
struct Events(Vec<CudaEvent>);

impl Fence for Events {
    fn done(&self) -> bool {
        self.0.iter().all(|e| e.try_is_complete().unwrap_or(false))
    }
}

/// What the lock guards.
struct State {
    batches: Batches<Events, Py<PyAny>>,
    /// Completed events for reuse, one list per stream (an event records only on a stream of
    /// its own context).
    free: Vec<Vec<CudaEvent>>,
}

/// The owners of calls in flight on a clique's or a communicator's streams.
pub(crate) struct Pending {
    streams: Vec<Arc<CudaStream>>,
    state: Mutex<State>,
}

impl Pending {
    /// Calls on `streams` (every stream a call may queue work on).
    pub(crate) fn new(streams: Vec<Arc<CudaStream>>) -> Pending {
        let free = streams.iter().map(|_| Vec::new()).collect();
        Pending {
            streams,
            state: Mutex::new(State {
                batches: Batches::new(),
                free,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps the owners `push` pushes until the work queued so far on every stream has run;
    /// when their batch is due a fence, drops the owners of batches whose fences have
    /// completed and records it. `push` returns the bytes of their tensors; it runs under this
    /// type's lock, so it must run no Python code.
    pub(crate) fn keep(&self, push: impl FnOnce(&mut Vec<Py<PyAny>>) -> usize) {
        let mut done = Vec::new();
        let leaked = {
            let mut state = self.state();
            let due = state.batches.add_with(push);
            if due || state.batches.large_pending() {
                Self::take_done(&mut state, &mut done);
            }
            if due {
                self.fence_locked(&mut state)
            } else {
                Vec::new()
            }
        };
        // Nothing marks the end of these calls' work: their tensors are leaked, never freed
        // early.
        std::mem::forget(leaked);
        // Dropped with the lock released (see `prune`).
        drop(done);
    }

    /// Records a fence after the work queued so far, for the owners not yet fenced (before a
    /// wait for that work: `synchronize`, or the drop of the clique or communicator).
    pub(crate) fn fence(&self) {
        let leaked = {
            let mut state = self.state();
            if state.batches.has_unfenced() {
                self.fence_locked(&mut state)
            } else {
                Vec::new()
            }
        };
        std::mem::forget(leaked);
    }

    /// Closes the unfenced batch behind one event per stream; returns the owners to leak when
    /// an event could not be recorded.
    fn fence_locked(&self, state: &mut State) -> Vec<Py<PyAny>> {
        let mut events = Vec::with_capacity(self.streams.len());
        let mut recorded = true;
        for (i, stream) in self.streams.iter().enumerate() {
            let event = match state.free[i].pop() {
                Some(e) => Ok(e),
                None => stream
                    .context()
                    .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)),
            };
            match event.and_then(|e| e.record(stream).map(|()| e)) {
                Ok(e) => events.push(e),
                Err(_) => {
                    recorded = false;
                    break;
                }
            }
        }
        state.batches.fenced(recorded.then_some(Events(events)))
    }

    /// Moves the owners of the batches whose fences have completed to `owners`, and their
    /// events to the free lists.
    fn take_done(state: &mut State, owners: &mut Vec<Vec<Py<PyAny>>>) {
        for (fence, batch) in state.batches.take_done() {
            for (i, e) in fence.0.into_iter().enumerate() {
                state.free[i].push(e);
            }
            owners.push(batch);
        }
    }

    /// Drops the owners of every batch whose fence has completed.
    ///
    /// The owners are dropped after the lock here is released: dropping a tensor can run
    /// Python code, which lets another thread take the GIL and then wait for this lock.
    pub(crate) fn prune(&self) {
        let mut owners = Vec::new();
        Self::take_done(&mut self.state(), &mut owners);
        drop(owners);
    }
}

impl Drop for Pending {
    /// Owners of calls whose work may still run (the clique or communicator could not wait
    /// for it, or never knew its end) are leaked rather than released.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let batches = std::mem::replace(&mut state.batches, Batches::new());
        let (release, leak) = batches.finish();
        std::mem::forget(leak);
        drop(release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A fence that completes when the test says so.
    struct FakeFence(Rc<Cell<bool>>);

    impl Fence for FakeFence {
        fn done(&self) -> bool {
            self.0.get()
        }
    }

    /// An owner that counts its drops (its release).
    struct Owner(Rc<Cell<usize>>);

    impl Drop for Owner {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }

    fn fence() -> (FakeFence, Rc<Cell<bool>>) {
        let flag = Rc::new(Cell::new(false));
        (FakeFence(flag.clone()), flag)
    }

    impl Batches<FakeFence, Owner> {
        fn add(&mut self, owners: impl IntoIterator<Item = Owner>) -> bool {
            self.add_with(|out| {
                out.extend(owners);
                1
            })
        }
    }

    /// Releases what `take_done` hands out, as `Pending::prune` does.
    fn prune(b: &mut Batches<FakeFence, Owner>) {
        drop(b.take_done());
    }

    #[test]
    fn owners_are_released_only_after_a_fence_after_their_call_has_completed() {
        let released = Rc::new(Cell::new(0));
        let mut b = Batches::new();
        // Two calls before the first fence, one after it.
        assert!(!b.add([Owner(released.clone())]));
        assert!(!b.add([Owner(released.clone()), Owner(released.clone())]));
        let (f1, done1) = fence();
        assert!(b.fenced(Some(f1)).is_empty());
        assert!(!b.add([Owner(released.clone())]));
        prune(&mut b);
        assert_eq!(released.get(), 0, "released before the fence completed");
        // The first fence completes: the three owners before it go, the one after stays
        // (no fence after its call yet).
        done1.set(true);
        prune(&mut b);
        assert_eq!(released.get(), 3);
        prune(&mut b);
        assert_eq!(released.get(), 3, "an unfenced owner was released");
        let (f2, done2) = fence();
        assert!(b.fenced(Some(f2)).is_empty());
        prune(&mut b);
        assert_eq!(released.get(), 3, "released before its fence completed");
        done2.set(true);
        prune(&mut b);
        assert_eq!(released.get(), 4);
    }

    #[test]
    fn fences_are_polled_oldest_first_and_a_later_one_waits_for_the_older() {
        let released = Rc::new(Cell::new(0));
        let mut b = Batches::new();
        b.add([Owner(released.clone())]);
        let (f1, done1) = fence();
        let _ = b.fenced(Some(f1));
        b.add([Owner(released.clone())]);
        let (f2, done2) = fence();
        let _ = b.fenced(Some(f2));
        // A later fence seen complete first (it cannot be, streams run in order; polling
        // stops at the oldest anyway).
        done2.set(true);
        prune(&mut b);
        assert_eq!(released.get(), 0);
        done1.set(true);
        prune(&mut b);
        assert_eq!(released.get(), 2);
    }

    #[test]
    fn a_fence_is_due_after_enough_calls_or_enough_owners() {
        let released = Rc::new(Cell::new(0));
        let mut b: Batches<FakeFence, Owner> = Batches::new();
        for i in 1..FENCE_EVERY {
            assert!(!b.add([Owner(released.clone())]), "call {i}");
        }
        assert!(b.add([Owner(released.clone())]));
        let (f, _) = fence();
        let _ = b.fenced(Some(f));
        assert!(!b.has_unfenced());
        let many = (0..FENCE_OWNERS).map(|_| Owner(released.clone()));
        assert!(b.add(many), "one call of many owners");
        let (f, _) = fence();
        let _ = b.fenced(Some(f));
        assert!(!b.add_with(|out| {
            out.push(Owner(released.clone()));
            FENCE_BYTES / 2
        }));
        assert!(
            b.add_with(|out| {
                out.push(Owner(released.clone()));
                FENCE_BYTES / 2
            }),
            "two calls of half the bytes"
        );
        let (f, _) = fence();
        let _ = b.fenced(Some(f));
        assert!(!b.add_with(|_| FENCE_BYTES), "a call without owners");
    }

    #[test]
    fn a_large_batch_is_polled_at_every_call_until_released() {
        let released = Rc::new(Cell::new(0));
        let mut b = Batches::new();
        // A call of FENCE_BYTES: due a fence at once; its batch is large.
        assert!(b.add_with(|out| {
            out.push(Owner(released.clone()));
            FENCE_BYTES
        }));
        let (f, done) = fence();
        let _ = b.fenced(Some(f));
        assert!(b.large_pending());
        // Small calls after it: not due a fence, yet the large batch asks to be polled.
        assert!(!b.add([Owner(released.clone())]));
        assert!(b.large_pending());
        done.set(true);
        prune(&mut b);
        assert_eq!(
            released.get(),
            1,
            "the large batch went at the first poll after its work"
        );
        assert!(!b.large_pending());
        // Small batches never ask for a poll of their own.
        let (f, _) = fence();
        let _ = b.fenced(Some(f));
        assert!(!b.large_pending());
    }

    #[test]
    fn owners_of_a_batch_whose_fence_failed_or_never_completed_are_leaked() {
        let released = Rc::new(Cell::new(0));
        let mut b = Batches::new();
        b.add([Owner(released.clone()), Owner(released.clone())]);
        let leaked = b.fenced(None);
        assert_eq!(leaked.len(), 2);
        std::mem::forget(leaked);
        prune(&mut b);
        assert_eq!(released.get(), 0);
        // At the end: a completed fence's owners are released, a pending fence's and the
        // unfenced owners are handed back to leak.
        b.add([Owner(released.clone())]);
        let (f1, done1) = fence();
        let _ = b.fenced(Some(f1));
        done1.set(true);
        b.add([Owner(released.clone())]);
        let (f2, _) = fence();
        let _ = b.fenced(Some(f2));
        b.add([Owner(released.clone())]);
        let (release, leak) = b.finish();
        assert_eq!((release.len(), leak.len()), (1, 2));
        drop(release);
        std::mem::forget(leak);
        assert_eq!(released.get(), 1);
    }
}
