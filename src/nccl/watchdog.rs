//! The watchdog: one thread per engine with live NCCL communicators. NCCL kernels wait for
//! their peers without a bound, so a stalled or dead rank would leave every stream behind a
//! broadcast blocked forever, and with it any thread synchronising with those streams.
//!
//! Each NCCL broadcast (and each graph launch that holds one) is queued here with an event
//! before and after it on every local rank's stream: a call pays two event records per local
//! rank and two short uncontended locks, and nothing is formatted unless it is reported. The
//! thread sleeps while nothing is queued; otherwise it looks every [`POLL`], querying the
//! events of about one call however many are queued ([`look`]): when a broadcast has started on some local rank
//! (a start event passed: that rank's NCCL kernel waits for its peers) and has not finished
//! `timeout` later, or NCCL reports an asynchronous error, it keeps the error for the next
//! call, naming the calls whose outputs are undefined, then aborts the communicators
//! (`ncclCommAbort`: their kernels return, the streams move on). This is the P2P kernel's rule
//! too: a rank that waits longer than the timeout for a peer is a fault.
//!
//! NCCL's abort waits for the kernels already queued on the communicators (they see the abort
//! flag and return at once), so a local rank held back by work queued before the broadcast
//! delays the abort's end, never frees what a queued kernel still uses. It also waits for
//! every graph that captured the communicators to be destroyed, so it finishes on a thread of
//! its own (`Nccl::abort`): this thread goes on watching, and callers see the error at once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};

use super::Nccl;
use crate::error::{Error, Result};
use crate::wait::millis;

/// How often the thread looks at queued work: the detection delay beyond the timeout.
pub(crate) const POLL: Duration = Duration::from_millis(5);

/// How long the thread goes on looking every [`POLL`] with nothing queued before it waits for
/// the next call without a deadline. Calls that come closer together than this never pay for
/// a wake-up (a system call, and the thread then contending for the queue's lock).
const NAP: Duration = Duration::from_millis(200);

/// The most calls queued on the ranks' streams behind the oldest watched call that has not
/// finished. A stream takes about a thousand launches before a launch blocks in the driver;
/// an NCCL launch blocked there holds the NCCL communicators, which the abort that alone could
/// unblock it needs. Behind a broadcast whose peer never comes, a caller therefore waits
/// before queueing more ([`Watchdog::room`]), and the abort goes ahead. A call queues a few
/// launches per rank (the watchdog's events, the kernel or graph, orderings), so this leaves
/// the driver's queue far from full.
pub(crate) const MAX_BEHIND: u64 = 128;

/// What a watched call queued, described only when it is reported.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Watched {
    /// A grouped NCCL broadcast of `tensors` tensors, `bytes` bytes in all, from `root`.
    Broadcast {
        tensors: usize,
        bytes: usize,
        root: usize,
    },
    /// A graph launch that holds NCCL broadcasts.
    GraphLaunch,
}

impl std::fmt::Display for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Watched::Broadcast {
                tensors,
                bytes,
                root,
            } => write!(
                f,
                "NCCL broadcast of {tensors} tensor(s), {bytes} bytes, from rank {root}"
            ),
            Watched::GraphLaunch => f.write_str("a graph launch with NCCL broadcasts"),
        }
    }
}

/// One watched call, with its events (`E`: CUDA events; plain flags in the tests).
struct Pending<E = CudaEvent> {
    call: u64,
    what: Watched,
    /// The id of the communicators it was queued on.
    comms: u64,
    start: Vec<E>,
    end: Vec<E>,
    /// When the thread first saw a start event passed (the call's kernel waits for its peers
    /// on that rank from then on).
    started: Option<Instant>,
}

/// Start and end events of one call, for reuse.
type Pair<E> = (Vec<E>, Vec<E>);

#[derive(Default)]
struct Queue {
    pending: VecDeque<Pending>,
    /// Event pairs of finished calls, for reuse.
    spare: Vec<Pair<CudaEvent>>,
    /// The abort not yet reported to a caller.
    fault: Option<Error>,
    /// The communicators (by id) the last fault aborts, and why: a call on them queued here
    /// after the fault was decided is refused by [`Watchdog::watch`], naming itself.
    aborted: Option<(u64, String)>,
    stop: bool,
    /// The thread waits without a deadline (it found nothing queued for [`NAP`]): the next
    /// call wakes it.
    asleep: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// The number of the oldest call in the queue (`u64::MAX` while it is empty), written
    /// under the queue's lock whenever the front changes: [`Watchdog::room`] reads it without
    /// the lock.
    front: AtomicU64,
    /// Whether `Queue::fault` holds a fault not yet reported, written under the queue's lock:
    /// [`Watchdog::take_fault`] reads it without the lock.
    faulted: AtomicBool,
    wake: Condvar,
    nccl: Arc<Mutex<Nccl>>,
    timeout: Duration,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes `q`'s front and fault to the lock-free readers (called with the queue locked,
    /// after any change to either). Written only where they changed: every call reads both,
    /// and the thread's looks at an idle queue then leave the callers' cached copies alone.
    fn publish(&self, q: &Queue) {
        let front = q.pending.front().map_or(u64::MAX, |p| p.call);
        if self.front.load(Ordering::Relaxed) != front {
            self.front.store(front, Ordering::Release);
        }
        if self.faulted.load(Ordering::Relaxed) != q.fault.is_some() {
            self.faulted.store(q.fault.is_some(), Ordering::Release);
        }
    }
}

/// The handle an engine holds; dropping it stops the thread and joins it (within
/// [`JOIN_WITHIN`]).
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Disconnected when the thread ends (its sender is dropped with the thread's closure).
    /// (In a mutex only so that the handle is `Sync`; the drop alone reads it.)
    ended: Mutex<std::sync::mpsc::Receiver<()>>,
}

/// How long a drop waits for the thread to end. It ends within one [`POLL`] of being told to
/// stop (an abort it starts finishes on a thread of its own), unless a look at the NCCL
/// communicators' error waits for a lock held by a call stuck in the driver: then the drop
/// leaves it behind (it ends once it gets the lock) rather than wait.
const JOIN_WITHIN: Duration = Duration::from_secs(1);

impl Watchdog {
    /// Starts watching calls on `nccl` with `timeout`.
    pub(crate) fn start(nccl: Arc<Mutex<Nccl>>, timeout: Duration) -> Result<Watchdog> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            front: AtomicU64::new(u64::MAX),
            faulted: AtomicBool::new(false),
            wake: Condvar::new(),
            nccl,
            timeout,
        });
        let inner = shared.clone();
        let (on_end, ended) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("gpucast-watchdog".into())
            .spawn(move || {
                let _on_end = on_end;
                watch(&inner)
            })
            .map_err(|e| Error::InvalidArgument(format!("starting the watchdog thread: {e}")))?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
            ended: Mutex::new(ended),
        })
    }

    /// Records the start events of a call on `streams` (one per local rank). The caller queues
    /// the call, then hands the result to [`Watchdog::watch`].
    pub(crate) fn begin(&self, streams: &[&Arc<CudaStream>]) -> Result<Begun> {
        let spare = self.shared.queue().spare.pop();
        let (start, end) = match spare {
            Some(pair) => pair,
            None => {
                let make = || {
                    streams
                        .iter()
                        .map(|s| s.context().new_event(None))
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .map_err(Error::cuda("creating watchdog events"))
                };
                (make()?, make()?)
            }
        };
        for (e, s) in start.iter().zip(streams) {
            e.record(s)
                .map_err(Error::cuda("recording a watchdog event"))?;
        }
        Ok(Begun { start, end })
    }

    /// Takes back the events of a call that was not queued after all.
    pub(crate) fn reuse(&self, begun: Begun) {
        self.shared.queue().spare.push((begun.start, begun.end));
    }

    /// Records the end events of call number `call` (described by `what`), queued on the
    /// communicators with id `comms`, and queues it. Where those communicators are being
    /// aborted (the fault was decided before this call was queued here), the call is not
    /// queued: the error names it (its outputs are undefined).
    pub(crate) fn watch(
        &self,
        begun: Begun,
        streams: &[&Arc<CudaStream>],
        call: u64,
        what: Watched,
        comms: u64,
    ) -> Result<()> {
        for (e, s) in begun.end.iter().zip(streams) {
            e.record(s)
                .map_err(Error::cuda("recording a watchdog event"))?;
        }
        let mut q = self.shared.queue();
        if let Some(refused) = refused(&q.aborted, comms, call) {
            q.spare.push((begun.start, begun.end));
            return Err(refused);
        }
        // Unless the thread waits without a deadline, it looks again within POLL by itself, and
        // a wake-up would be wasted.
        let asleep = q.asleep;
        q.pending.push_back(Pending {
            call,
            what,
            comms,
            start: begun.start,
            end: begun.end,
            started: None,
        });
        self.shared.publish(&q);
        drop(q);
        if asleep {
            self.shared.wake.notify_one();
        }
        Ok(())
    }

    /// Waits until call number `call` may be queued: while fewer than [`MAX_BEHIND`] calls
    /// were queued since the oldest watched call still running, at once (one atomic
    /// read, no lock). Otherwise it polls the calls' events (without holding the NCCL communicators)
    /// until enough have finished, or the watchdog aborted them (they leave the queue: the
    /// caller then finds the fault), or `limit` passed ([`Error::StreamsBusy`], nothing of
    /// the call queued: the watchdog aborts a call that waits longer than the timeout for its
    /// peers, so with `limit` above the timeout this means the streams do not move for another
    /// reason, such as the caller's own work queued on them).
    ///
    /// Returns whether it had to wait (the caller then looks for a fault decided meanwhile).
    pub(crate) fn room(&self, call: u64, limit: Duration) -> Result<bool> {
        // The common case reads one atomic: no lock, no clock.
        if !behind(call, self.shared.front.load(Ordering::Acquire)) {
            return Ok(false);
        }
        let mut start: Option<Instant> = None;
        let mut backoff = crate::wait::Backoff::new();
        loop {
            {
                let mut q = self.shared.queue();
                let queue = &mut *q;
                let front = |p: &VecDeque<Pending>| p.front().map_or(u64::MAX, |p| p.call);
                if !behind(call, front(&queue.pending)) {
                    return Ok(start.is_some());
                }
                pop_finished(&mut queue.pending, &mut queue.spare, passed);
                self.shared.publish(queue);
                if !behind(call, front(&queue.pending)) {
                    return Ok(true);
                }
            }
            let waited = start.get_or_insert_with(Instant::now).elapsed();
            if waited > limit {
                // The streams did not move (the caller's own work, or the watchdog could not
                // abort): nothing of this call was queued.
                return Err(Error::StreamsBusy {
                    waited_ms: millis(waited),
                });
            }
            backoff.pause();
        }
    }

    /// The abort not reported yet, if any (reported once).
    pub(crate) fn take_fault(&self) -> Option<Error> {
        // Without the lock while there is none (every call asks).
        if !self.shared.faulted.load(Ordering::Acquire) {
            return None;
        }
        let mut q = self.shared.queue();
        let fault = q.fault.take();
        self.shared.publish(&q);
        fault
    }

    /// An abort of the communicators with id `comms` decided elsewhere (a failed enqueue, say),
    /// before it is carried out: every call queued here becomes undefined, as after a fault of
    /// the watchdog's own, and later calls on those communicators are refused by `watch`.
    pub(crate) fn fail_all(&self, reason: &str, comms: u64) {
        let mut q = self.shared.queue();
        fail_pending(&mut q, reason, comms);
        self.shared.publish(&q);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.queue().stop = true;
        self.shared.wake.notify_one();
        // Its sender goes with the thread: disconnected once it has ended.
        let ended = matches!(
            self.ended
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .recv_timeout(JOIN_WITHIN),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        );
        match self.thread.take() {
            Some(thread) if ended => {
                if thread.join().is_err() {
                    tracing::warn!("the NCCL watchdog thread panicked");
                }
            }
            // Left behind: it owns what it uses, and ends once it gets the lock it waits for.
            _ => tracing::warn!(
                "the NCCL watchdog thread did not end within {} ms of the drop",
                millis(JOIN_WITHIN)
            ),
        }
    }
}

/// Start events of a call being queued.
pub(crate) struct Begun {
    start: Vec<CudaEvent>,
    end: Vec<CudaEvent>,
}

/// Whether an event has passed. An error other than "not ready" (a context gone bad) counts
/// as passed: the work will not finish, and the next call reports the error itself.
fn passed(e: &CudaEvent) -> bool {
    e.try_is_complete().unwrap_or(true)
}

/// One look at the queue at `now` (`passed` says whether an event has passed, on each rank in
/// the order the events were queued): finished calls leave the front for `spare`, calls seen started for the first time get `now` as their start,
/// and the first call that started more than `timeout` ago is named, as the reason to abort.
///
/// On each rank's stream a call starts after the one before it ended, so the calls that
/// started are a prefix of the queue: the look stops at the first that has not, and costs one
/// query per call in flight that started (about one), not one per call queued.
fn look<E>(
    pending: &mut VecDeque<Pending<E>>,
    spare: &mut Vec<Pair<E>>,
    now: Instant,
    timeout: Duration,
    passed: impl Fn(&E) -> bool,
) -> Option<String> {
    pop_finished(pending, spare, &passed);
    let mut late = None;
    for p in pending.iter_mut() {
        let t = match p.started {
            Some(t) => t,
            None if p.start.iter().any(&passed) => *p.started.insert(now),
            None => break,
        };
        if late.is_none() && now.duration_since(t) > timeout {
            late = Some(format!(
                "call {} ({}) did not finish within {} ms of starting: a peer did not arrive",
                p.call,
                p.what,
                millis(timeout)
            ));
        }
    }
    late
}

/// Whether call number `call` is [`MAX_BEHIND`] calls or more behind the oldest queued call,
/// `front` (`u64::MAX`: none queued).
fn behind(call: u64, front: u64) -> bool {
    call.saturating_sub(front) >= MAX_BEHIND
}

/// Moves the finished calls at the front of `pending` to `spare`.
fn pop_finished<E>(
    pending: &mut VecDeque<Pending<E>>,
    spare: &mut Vec<Pair<E>>,
    passed: impl Fn(&E) -> bool,
) {
    let done = finished_prefix(pending, |p| p.end.iter().all(&passed));
    spare.extend(pending.drain(..done).map(|p| (p.start, p.end)));
}

/// How many calls at the front of `pending` have finished (`done`). Each rank's events pass in
/// stream order, so the finished calls are a prefix of the queue: when the last one finished,
/// all did (one query per rank for a whole batch); when the first did not, none did; else the
/// prefix is found by bisection (about log2 of the queue's length queries per rank, not one
/// per finished call).
fn finished_prefix<E>(pending: &VecDeque<Pending<E>>, done: impl Fn(&Pending<E>) -> bool) -> usize {
    let Some(last) = pending.back() else {
        return 0;
    };
    if done(last) {
        return pending.len();
    }
    if !pending.front().is_some_and(&done) {
        return 0;
    }
    // Calls before `lo` finished; the call at `hi` did not. (This rests on the order: the
    // events of every call are recorded, and its entry queued, under the engine's lock on the
    // same streams, and `passed` counts only a sticky context error as passed.)
    let (mut lo, mut hi) = (1, pending.len() - 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if done(&pending[mid]) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Makes every call queued in `q` undefined by a fault of the communicators with id `comms`
/// (`reason`), at once: see [`take_pending`] and [`publish_fault`].
fn fail_pending(q: &mut Queue, reason: &str, comms: u64) {
    let undefined = take_pending(&mut q.pending, &mut q.spare, &mut q.aborted, reason, comms);
    publish_fault(&mut q.fault, reason, undefined);
}

/// Takes every call out of `pending` (their events go to `spare`) for a fault of the
/// communicators with id `comms`, which count as aborted for calls queued later (`aborted`);
/// the calls taken, which the fault names (`E`: CUDA events; plain flags in the tests).
fn take_pending<E>(
    pending: &mut VecDeque<Pending<E>>,
    spare: &mut Vec<Pair<E>>,
    aborted: &mut Option<(u64, String)>,
    reason: &str,
    comms: u64,
) -> Vec<u64> {
    let undefined = pending.iter().map(|p| p.call).collect();
    spare.extend(pending.drain(..).map(|p| (p.start, p.end)));
    *aborted = Some((comms, reason.into()));
    undefined
}

/// Keeps the fault `reason` for the next caller, naming the calls `undefined` (with those of an
/// earlier fault not yet reported). A fault that leaves no call undefined, after none before,
/// is not kept: the caller that caused it has its own error.
fn publish_fault(fault: &mut Option<Error>, reason: &str, mut undefined: Vec<u64>) {
    let earlier = match fault.take() {
        Some(Error::CommunicatorsAborted {
            undefined_calls, ..
        }) => Some(undefined_calls),
        _ => None,
    };
    if earlier.is_none() && undefined.is_empty() {
        return;
    }
    let mut all = earlier.unwrap_or_default();
    all.append(&mut undefined);
    *fault = Some(Error::CommunicatorsAborted {
        reason: reason.into(),
        undefined_calls: all,
    });
}

/// The error for call `call` on the communicators with id `comms`, if an abort of them was
/// decided (`aborted`) before the call could be queued: the call is then undefined.
fn refused(aborted: &Option<(u64, String)>, comms: u64, call: u64) -> Option<Error> {
    match aborted {
        Some((id, reason)) if *id == comms => Some(Error::CommunicatorsAborted {
            reason: reason.clone(),
            undefined_calls: vec![call],
        }),
        _ => None,
    }
}

/// The thread's loop.
fn watch(shared: &Shared) {
    let mut q = shared.queue();
    let mut idle_since: Option<Instant> = None;
    loop {
        if q.pending.is_empty() {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= NAP {
                q.asleep = true;
                while q.pending.is_empty() && !q.stop {
                    q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                }
                q.asleep = false;
                // A call came: the nap starts again once the queue is empty again.
                idle_since = None;
            }
        } else {
            idle_since = None;
        }
        if q.stop {
            return;
        }
        let queue = &mut *q;
        let late = look(
            &mut queue.pending,
            &mut queue.spare,
            Instant::now(),
            shared.timeout,
            passed,
        );
        shared.publish(queue);
        let reason = match late {
            // Every queued call is on one set of communicators (a fault empties the queue).
            Some(r) => Some((r, q.pending.front().map_or(0, |p| p.comms))),
            None if !q.pending.is_empty() => {
                // Ask NCCL without holding the queue: a caller may be queueing meanwhile.
                drop(q);
                let error = match shared.nccl.try_lock() {
                    Ok(nccl) => match &*nccl {
                        Nccl::Live(comms) => comms.async_error().err().map(|e| (e, nccl.live_id())),
                        _ => None,
                    },
                    Err(_) => None,
                };
                q = shared.queue();
                // Only for the calls it was read for: not where the queue was emptied, or
                // refilled on other communicators, meanwhile.
                error
                    .filter(|(_, id)| q.pending.front().is_some_and(|p| p.comms == *id))
                    .map(|(e, id)| {
                        (
                            format!("NCCL reported an error while a broadcast ran: {e}"),
                            id,
                        )
                    })
            }
            None => None,
        };
        if let Some((reason, comms)) = reason {
            // Decided under the queue: the calls queued so far leave it (they are undefined),
            // and one queued later on these communicators is refused by `watch`, naming
            // itself. Then the abort, of these communicators only (not of ones `recover` built
            // meanwhile), and only then the error: a caller who sees it and recovers finds the
            // communicators aborted, and builds new ones.
            let queue = &mut *q;
            let undefined = take_pending(
                &mut queue.pending,
                &mut queue.spare,
                &mut queue.aborted,
                &reason,
                comms,
            );
            shared.publish(&q);
            drop(q);
            tracing::error!(%reason, ?undefined, "aborting NCCL");
            let mut nccl = shared.nccl.lock().unwrap_or_else(|e| e.into_inner());
            if nccl.live_id() == comms {
                nccl.abort(reason.clone());
            }
            q = shared.queue();
            publish_fault(&mut q.fault, &reason, undefined);
            shared.publish(&q);
            drop(nccl);
            continue;
        }
        let (guard, _) = shared
            .wake
            .wait_timeout(q, POLL)
            .unwrap_or_else(|e| e.into_inner());
        q = guard;
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    /// An event the test passes by hand.
    type Flag = Rc<Cell<bool>>;

    const TIMEOUT: Duration = Duration::from_millis(100);

    /// A queue of `calls` calls on `ranks` ranks; the flags of call `c`, rank `r`, are
    /// `flags[c].0[r]` (start) and `flags[c].1[r]` (end).
    fn queue(calls: usize, ranks: usize) -> (VecDeque<Pending<Flag>>, Vec<Pair<Flag>>) {
        let flags = || (0..ranks).map(|_| Flag::default()).collect::<Vec<_>>();
        let mut pending = VecDeque::new();
        let mut all = Vec::new();
        for call in 0..calls {
            let (start, end) = (flags(), flags());
            all.push((start.clone(), end.clone()));
            pending.push_back(Pending {
                call: call as u64,
                what: Watched::GraphLaunch,
                comms: 1,
                start,
                end,
                started: None,
            });
        }
        (pending, all)
    }

    fn pass(f: &Flag) {
        f.set(true);
    }

    #[test]
    fn the_finished_prefix_is_found_with_few_queries() {
        for len in [0usize, 1, 2, 3, 7, 128, 129] {
            for finished in 0..=len {
                let (pending, flags) = queue(len, 2);
                for (_, end) in &flags[..finished] {
                    end.iter().for_each(pass);
                }
                let queries = Cell::new(0usize);
                let found = finished_prefix(&pending, |p| {
                    queries.set(queries.get() + 1);
                    p.end.iter().all(|f| f.get())
                });
                assert_eq!(found, finished, "{finished} of {len} finished");
                // The last call, the first, then a bisection of the rest.
                let most = 2 + (usize::BITS - len.leading_zeros()) as usize;
                assert!(queries.get() <= most, "{} queries for {len}", queries.get());
            }
        }
    }

    #[test]
    fn room_is_short_only_behind_an_old_call() {
        assert!(!behind(5, u64::MAX));
        assert!(!behind(1 + MAX_BEHIND - 1, 1));
        assert!(behind(1 + MAX_BEHIND, 1));
        assert!(!behind(0, 7));
    }

    #[test]
    fn a_call_that_started_and_did_not_end_within_the_timeout_is_named() {
        let (mut pending, flags) = queue(2, 2);
        let mut spare = Vec::new();
        let t0 = Instant::now();
        let look_at = |p: &mut VecDeque<_>, s: &mut Vec<_>, ms: u64| {
            look(p, s, t0 + Duration::from_millis(ms), TIMEOUT, |f: &Flag| {
                f.get()
            })
        };
        assert_eq!(look_at(&mut pending, &mut spare, 0), None);
        // Rank 0 enters call 0; rank 1 never does.
        pass(&flags[0].0[0]);
        assert_eq!(look_at(&mut pending, &mut spare, 10), None);
        assert_eq!(look_at(&mut pending, &mut spare, 110), None);
        let late = look_at(&mut pending, &mut spare, 111).expect("late");
        assert!(late.starts_with("call 0 (a graph launch"), "{late}");
    }

    #[test]
    fn a_call_held_back_before_it_starts_is_never_late() {
        let (mut pending, _flags) = queue(3, 2);
        let mut spare = Vec::new();
        let t0 = Instant::now();
        for ms in [0, 1000, 100_000] {
            let now = t0 + Duration::from_millis(ms);
            assert_eq!(
                look(&mut pending, &mut spare, now, TIMEOUT, |f: &Flag| f.get()),
                None
            );
        }
    }

    #[test]
    fn finished_calls_leave_the_queue_for_reuse() {
        let (mut pending, flags) = queue(3, 2);
        let mut spare = Vec::new();
        for (start, end) in &flags[..2] {
            start.iter().chain(end).for_each(pass);
        }
        let now = Instant::now();
        assert_eq!(
            look(&mut pending, &mut spare, now, TIMEOUT, |f: &Flag| f.get()),
            None
        );
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].call, 2);
        assert_eq!(spare.len(), 2);
    }

    /// Rank 0 finishes call 0 and enters call 1 at once; rank 1 is held back and finishes call
    /// 0 only much later, then dies before call 1. Call 1 started when rank 0 entered it, so it
    /// is late one timeout after that, not one timeout after call 0 left the queue.
    #[test]
    fn a_later_call_is_timed_from_when_it_started_not_from_when_it_reached_the_front() {
        let (mut pending, flags) = queue(2, 2);
        let mut spare = Vec::new();
        let t0 = Instant::now();
        let look_at = |p: &mut VecDeque<_>, s: &mut Vec<_>, ms: u64| {
            look(p, s, t0 + Duration::from_millis(ms), TIMEOUT, |f: &Flag| {
                f.get()
            })
        };
        pass(&flags[0].0[0]);
        pass(&flags[0].1[0]);
        pass(&flags[1].0[0]);
        assert_eq!(look_at(&mut pending, &mut spare, 0), None);
        // Rank 1 runs call 0 at 90 ms (within its timeout), then never enters call 1.
        pass(&flags[0].0[1]);
        pass(&flags[0].1[1]);
        assert_eq!(look_at(&mut pending, &mut spare, 90), None);
        let late = look_at(&mut pending, &mut spare, 101).expect("call 1 is late");
        assert!(late.starts_with("call 1 "), "{late}");
    }

    /// A batch of finished calls leaves the queue for the price of the last one's events.
    #[test]
    fn finished_calls_cost_the_last_call_s_queries() {
        let (mut pending, flags) = queue(1000, 2);
        let mut spare = Vec::new();
        for (start, end) in &flags {
            start.iter().chain(end).for_each(pass);
        }
        let queries = Cell::new(0usize);
        look(
            &mut pending,
            &mut spare,
            Instant::now(),
            TIMEOUT,
            |f: &Flag| {
                queries.set(queries.get() + 1);
                f.get()
            },
        );
        assert!(pending.is_empty());
        assert_eq!(spare.len(), 1000);
        assert!(queries.get() <= 2, "{} queries", queries.get());
    }

    /// Each look queries the start events of the calls that have not started only up to the
    /// first of them: the cost does not grow with the calls queued behind.
    #[test]
    fn a_look_queries_no_event_behind_the_first_call_not_started() {
        let (mut pending, flags) = queue(1000, 2);
        let mut spare = Vec::new();
        pass(&flags[0].0[0]);
        let queries = Cell::new(0usize);
        let now = Instant::now();
        for _ in 0..10 {
            look(&mut pending, &mut spare, now, TIMEOUT, |f: &Flag| {
                queries.set(queries.get() + 1);
                f.get()
            });
        }
        // Per look: call 0's end events (2), call 1's start events (2); call 0's start was
        // seen once and is not asked again.
        assert!(queries.get() <= 10 * 4 + 1, "{} queries", queries.get());
    }

    /// A fault names every call queued (and those of an earlier fault not yet reported), and
    /// marks its communicators aborted: a later call on them is refused naming itself, one on
    /// communicators built since is not. A fault that leaves nothing undefined is not kept.
    #[test]
    fn a_fault_names_every_queued_call_and_refuses_later_ones_on_its_communicators() {
        let (mut pending, _flags) = queue(3, 2);
        let mut spare = Vec::new();
        let mut fault = Some(Error::CommunicatorsAborted {
            reason: "earlier".into(),
            undefined_calls: vec![7],
        });
        let mut aborted = None;
        let undefined = take_pending(&mut pending, &mut spare, &mut aborted, "late", 1);
        publish_fault(&mut fault, "late", undefined);
        assert!(pending.is_empty());
        assert_eq!(spare.len(), 3);
        match fault.take() {
            Some(Error::CommunicatorsAborted {
                reason,
                undefined_calls,
            }) => {
                assert_eq!(reason, "late");
                assert_eq!(undefined_calls, vec![7, 0, 1, 2]);
            }
            other => panic!("{other:?}"),
        }
        match refused(&aborted, 1, 9) {
            Some(Error::CommunicatorsAborted {
                undefined_calls, ..
            }) => assert_eq!(undefined_calls, vec![9]),
            other => panic!("{other:?}"),
        }
        assert!(refused(&aborted, 2, 10).is_none());
        assert!(refused(&None, 1, 11).is_none());
        // Nothing queued, nothing reported before: no fault for the next caller.
        let undefined = take_pending(&mut pending, &mut spare, &mut aborted, "again", 2);
        publish_fault(&mut fault, "again", undefined);
        assert!(fault.is_none());
        assert!(refused(&aborted, 2, 12).is_some());
    }
}
