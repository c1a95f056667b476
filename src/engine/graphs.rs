//! CUDA graphs of the engine: capturing every rank's stream (in parts, one per P2P step, where
//! ranks share a device), instantiating one graph per rank, and launching them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{result, CudaContext, CudaStream};

use super::{EngineGuard, Rank};
use crate::driver::make_current;
use crate::error::{Error, Result};
use crate::nccl::watchdog;

impl EngineGuard<'_> {
    /// Starts capturing every rank's stream into a graph (relaxed mode: the P2P launch threads
    /// enqueue on the streams being captured). On an error the ones begun are ended.
    pub(crate) fn begin_capture(&mut self) -> Result<()> {
        self.state.nccl.end_capture();
        self.state.ce.captured = false;
        self.state.p2p.end_capture();
        self.drop_segments();
        self.state.segments = (0..self.n()).map(|_| Vec::new()).collect();
        self.state.capture_failed = None;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        for (rank, r) in self.engine.ranks.iter().enumerate() {
            // cudarc's, which first reports an error it stored on the context.
            if let Err(e) = r.capture.get().begin_capture(mode) {
                self.abandon_capture(rank);
                return Err(Error::Cuda {
                    during: format!("beginning a graph capture on rank {rank}"),
                    source: e,
                });
            }
        }
        Ok(())
    }

    /// Puts rank `rank`'s capture stream in capture mode again, after a cut. Not through
    /// cudarc, which would take an error it stored on the context: `end_capture` reports that
    /// one as the capture's error.
    fn begin_capture_stream(&self, rank: usize) -> Result<()> {
        let r = &self.engine.ranks[rank];
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        make_current(&r.ctx)
            // SAFETY: a live stream of the rank's context, not capturing (just ended).
            .and_then(|()| unsafe {
                result::stream::begin_capture(r.capture.get().cu_stream(), mode)
            })
            .map_err(Error::cuda(format!(
                "beginning a graph capture on rank {rank}"
            )))
    }

    /// Where ranks share a device, inside a capture: ends every rank's graph after a P2P step
    /// and begins the next one. A replay then launches the ranks' graphs step by step, in
    /// turn (`launch_graphs`), as eager calls launch their kernels: in one graph per rank, a
    /// rank's next kernel, which waits for its previous one, would be queued ahead of the other
    /// ranks' previous kernels, and in a hardware queue shared by their streams would hold them
    /// back while the previous kernel waits for them (see [`EngineGuard::spinning`]).
    ///
    /// A cut that fails fails the capture: every rank's stream is put back in capture mode
    /// (so that work the caller queues there is captured and discarded, never run eagerly
    /// beside buffers the capture's guards no longer order), later steps return the error, and
    /// so does the capture's end.
    pub(super) fn cut_capture(&mut self) -> Result<()> {
        if !self.capturing() || !self.engine.shared_device {
            return Ok(());
        }
        let n = self.n();
        self.state.segments.resize_with(n, Vec::new);
        let mut cut = Ok(());
        for rank in 0..n {
            match self.end_capture_stream(rank) {
                Ok(graph) => self.state.segments[rank].push(Ended(graph)),
                Err(e) => {
                    cut = Err(e);
                    break;
                }
            }
        }
        if cut.is_ok() {
            cut = (0..n).try_for_each(|rank| self.begin_capture_stream(rank));
        }
        if let Err(e) = cut {
            // Best effort: end whatever still captures and capture again, to be discarded.
            self.abandon_capture(n);
            for rank in 0..n {
                if let Err(again) = self.begin_capture_stream(rank) {
                    tracing::warn!(rank, error = %again, "a failed capture left a stream eager");
                }
            }
            self.state.capture_failed = Some(e.clone());
            return Err(e);
        }
        Ok(())
    }

    /// The error of a failed cut of the capture in progress ([`EngineGuard::cut_capture`]).
    pub(super) fn capture_failed(&self) -> Result<()> {
        match &self.state.capture_failed {
            Some(e) if self.capturing() => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Ends rank `rank`'s capture: its graph (never null).
    fn end_capture_stream(&self, rank: usize) -> Result<sys::CUgraph> {
        let r = &self.engine.ranks[rank];
        let ended = make_current(&r.ctx)
            // SAFETY: a live stream of the rank's context (ending one that does not capture is
            // an error of the driver's, nothing more).
            .and_then(|()| unsafe { result::stream::end_capture(r.capture.get().cu_stream()) });
        match ended {
            Ok(g) if g.is_null() => Err(Error::Cuda {
                during: format!("ending the graph capture of rank {rank} (no graph)"),
                source: result::DriverError(
                    sys::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                ),
            }),
            Ok(g) => Ok(g),
            Err(e) => Err(Error::Cuda {
                during: format!("ending the graph capture of rank {rank}"),
                source: e,
            }),
        }
    }

    /// Destroys the graphs of earlier steps of the capture in progress.
    fn drop_segments(&mut self) {
        for (rank, graphs) in std::mem::take(&mut self.state.segments)
            .into_iter()
            .enumerate()
        {
            if graphs.is_empty() || make_current(&self.engine.ranks[rank].ctx).is_err() {
                continue;
            }
            for g in graphs {
                // SAFETY: a graph ended by `cut_capture`, used nowhere else.
                let _ = unsafe { result::graph::destroy(g.0) };
            }
        }
    }

    /// Ends the capture on the first `begun` ranks and discards what was captured, the parts
    /// ended before included.
    pub(crate) fn abandon_capture(&mut self, begun: usize) {
        self.drop_segments();
        for r in &self.engine.ranks[..begun] {
            if make_current(&r.ctx).is_ok() {
                // SAFETY: a live stream of the rank's context (ending one that does not capture
                // is an error of the driver's, nothing more).
                if let Ok(g) = unsafe { result::stream::end_capture(r.capture.get().cu_stream()) } {
                    if !g.is_null() {
                        // SAFETY: a graph just returned by end_capture, used nowhere else.
                        let _ = unsafe { result::graph::destroy(g) };
                    }
                }
            }
        }
    }

    /// Ends the capture on every rank and instantiates one graph per rank (of one or several
    /// parts: see `cut_capture`). A rank without a graph would leave its peers waiting at
    /// every replay, so that is an error; so is a failed cut (what was captured is
    /// discarded).
    pub(crate) fn end_capture(&mut self) -> Result<Vec<GraphExec>> {
        if let Some(e) = self.state.capture_failed.take() {
            self.abandon_capture(self.n());
            self.state.nccl.end_capture();
            self.state.ce.captured = false;
            self.state.p2p.end_capture();
            return Err(e);
        }
        let has_nccl = self.state.nccl.end_capture();
        // The communicators the graph's NCCL kernels use. Where they were aborted during the
        // capture (or cannot be read), the capture fails once every stream's capture ended: a
        // graph of aborted communicators never launches.
        let mut aborted = Ok(());
        let comms = if has_nccl {
            let id = match self.nccl() {
                Ok(n) => n.live_id(),
                Err(e) => {
                    aborted = Err(e);
                    0
                }
            };
            if id == 0 && aborted.is_ok() {
                aborted = Err(Error::CommunicatorsAborted {
                    reason: "the NCCL communicators were aborted during the capture".into(),
                    undefined_calls: Vec::new(),
                });
            }
            Some(id)
        } else {
            None
        };
        let has_ce = std::mem::take(&mut self.state.ce.captured);
        let holds = Holds {
            p2p: self.state.p2p.end_capture(),
            ce: has_ce.then_some(self.state.ce.gen),
            nccl: comms,
        };
        let mut execs = Vec::with_capacity(self.n());
        let mut status = Ok(());
        let mut segments = std::mem::take(&mut self.state.segments);
        segments.resize_with(self.n(), Vec::new);
        for (rank, graphs) in segments.into_iter().enumerate() {
            let mut graphs: Vec<sys::CUgraph> = graphs.into_iter().map(|g| g.0).collect();
            let r = &self.engine.ranks[rank];
            match self.end_capture_stream(rank) {
                Ok(graph) => {
                    // After the last P2P step of a cut capture the last part may hold nothing.
                    // SAFETY: a live graph just ended.
                    let counted = unsafe { crate::driver::graph::node_count(graph) };
                    if graphs.is_empty() || counted != Ok(0) {
                        graphs.push(graph);
                    } else {
                        // SAFETY: the graph just ended, empty, used nowhere else.
                        unsafe { GraphExec::destroy_graphs(&r.ctx, [graph]) };
                    }
                    // SAFETY: the rank's graphs, ended by this capture (its cut parts and the
                    // last one) in its context, which `end_capture_stream` made current, and
                    // used nowhere after this.
                    let exec = unsafe {
                        GraphExec::instantiate(
                            r.ctx.clone(),
                            graphs,
                            has_nccl.then(|| self.engine.nccl_graphs.clone()),
                            holds,
                        )
                    };
                    match exec {
                        Ok(exec) => execs.push(exec),
                        Err(e) => status = status.and(Err(e)),
                    }
                }
                Err(e) => {
                    // SAFETY: the rank's cut parts, owned here and used nowhere after this.
                    unsafe { GraphExec::destroy_graphs(&r.ctx, graphs) };
                    status = status.and(Err(e));
                }
            }
            // A cudarc operation that failed during the capture (a guard's wait on the capture
            // stream, say) left its error stored: it is this capture's error.
            if let Err(e) = r.ctx.check_err() {
                status = status.and(Err(Error::Cuda {
                    during: format!("a cudarc operation during the capture of rank {rank}"),
                    source: e,
                }));
            }
        }
        status.and(aborted).map(|()| execs)
    }

    /// Launches one graph per rank, on the ranks' streams ([`EngineGuard::spinning`]: on
    /// streams forked from them where ranks share a device). When a launch fails after others
    /// went out, the ranks launched could wait for the missing one: the copy-engine flags are
    /// released (P2P kernels time out by themselves) and the next call drains and resets.
    pub(crate) fn launch_graphs(&mut self, execs: &[GraphExec]) -> Result<()> {
        let launched = self.launch_graphs_once(execs);
        // A failure armed for a test and not reached by this launch never fires later.
        self.engine.fail_launch.store(0, Ordering::Relaxed);
        launched
    }

    fn launch_graphs_once(&mut self, execs: &[GraphExec]) -> Result<()> {
        // The id of the NCCL communicators the graph's broadcasts use (0: none). An abort
        // decided between the check below and the watch is caught by the watch, which then
        // refuses the call and names it (the communicators are not held across the launches: a
        // launch may wait in the driver for work that only the abort can end).
        let mut comms_id = 0;
        if let Some(holds) = execs.first().map(|g| g.holds) {
            if holds.p2p.is_some_and(|g| !self.state.p2p.holds_current(g)) {
                return Err(Error::P2pUnavailable(
                    "the P2P state this graph was captured with has closed since: capture it \
                     again"
                        .into(),
                ));
            }
            if let Some(comms) = holds.nccl {
                // Kernels of aborted communicators return at once, their outputs unwritten.
                if self.nccl()?.live_id() != comms || comms == 0 {
                    return Err(Error::CommunicatorsAborted {
                        reason: "the NCCL communicators this graph was captured with were \
                                 aborted since: capture it again"
                            .into(),
                        undefined_calls: Vec::new(),
                    });
                }
                comms_id = comms;
            }
            if holds.ce.is_some_and(|g| g != self.state.ce.gen) {
                return Err(Error::CopyEngineUnavailable(
                    "the copy-engine flags this graph was captured with were replaced after a \
                     reset that did not finish: capture it again"
                        .into(),
                ));
            }
        }
        let call = self.next_call();
        self.room_for(call)?;
        let watch = self
            .engine
            .watcher()
            .filter(|_| execs.first().is_some_and(GraphExec::has_nccl));
        let own: Vec<&Arc<CudaStream>> = self.engine.ranks.iter().map(|r| r.stream.get()).collect();
        let begun = watch.map(|w| w.begin(&own)).transpose()?;
        // Part `part` of rank `r`'s graph (nothing where it has fewer parts).
        let engine = self.engine;
        let launch = |rank: usize, r: &Rank, g: &GraphExec, part: usize, stream: CUstream| {
            let Some(&(_, exec)) = g.parts.get(part) else {
                return Ok(());
            };
            if engine.launch_fails(rank, part) {
                return Err(result::DriverError(
                    sys::cudaError_enum::CUDA_ERROR_LAUNCH_FAILED,
                ));
            }
            make_current(&r.ctx).and_then(|()| {
                // SAFETY: `exec` was instantiated from this rank's capture and is alive,
                // `stream` is a live stream of the rank's context; launches of one graph are
                // serialised by the engine's lock.
                unsafe { result::graph::launch(exec, stream) }
            })
        };
        let parts = execs.iter().map(|g| g.parts.len()).max().unwrap_or(0);
        // A graph whose copies wait on flags (stream memory operations) stalls its device's
        // command queue until a peer's graph writes them; a launch may then block the host
        // until that peer's graph runs. So such graphs go out from one thread per rank.
        let together = execs.first().is_some_and(GraphExec::has_ce) && execs.len() > 1;
        let ranks = &self.engine.ranks;
        // One result per rank launched (every rank when together, else up to the first
        // failure), and whether any graph, or part of one, went out.
        let spun: Result<(Vec<_>, bool)> = self.spinning(|_, streams| {
            let jobs = ranks.iter().zip(execs).zip(streams.iter().copied());
            Ok(if together {
                let results: Vec<_> = std::thread::scope(|s| {
                    // A stream handle moves to the launching thread as an address: driver
                    // handles may be used from any thread.
                    let handles: Vec<_> = jobs
                        .map(|((r, g), st)| (r, g, st as usize))
                        .enumerate()
                        .map(|(rank, (r, g, st))| {
                            s.spawn(move || {
                                (0..parts).try_for_each(|p| launch(rank, r, g, p, st as CUstream))
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| {
                            h.join().unwrap_or(Err(result::DriverError(
                                sys::cudaError_enum::CUDA_ERROR_UNKNOWN,
                            )))
                        })
                        .collect()
                });
                let went_out = results.iter().any(std::result::Result::is_ok);
                (results, went_out)
            } else {
                // Part by part, every rank in turn (several parts only where ranks share a
                // device: see `cut_capture`), up to the first failure.
                let jobs: Vec<_> = jobs.collect();
                in_turn(jobs.len(), parts, |p, rank| {
                    let ((r, g), st) = jobs[rank];
                    launch(rank, r, g, p, st)
                })
            })
        });
        // NCCL work that went out, even where the launch failed, is watched: where some ranks'
        // broadcasts wait for a rank that never launched, the watchdog ends them.
        let watched = |e: &EngineGuard<'_>, begun| match (watch, begun) {
            (Some(w), Some(begun)) => e.watch_nccl(
                w,
                begun,
                &own,
                call,
                watchdog::Watched::GraphLaunch,
                comms_id,
            ),
            _ => Ok(()),
        };
        let (results, went_out) = match spun {
            Ok(spun) => spun,
            Err(e) => {
                // A join of the second streams failed: the rank's stream no longer waits for
                // its graph, so events there cannot tell whether NCCL work it holds ended.
                drop(begun);
                if comms_id != 0 {
                    self.abort_comms(
                        format!("a graph launch with NCCL broadcasts failed: {e}"),
                        comms_id,
                    );
                }
                return Err(e);
            }
        };
        if let Some((rank, &Err(e))) = results.iter().enumerate().find(|(_, r)| r.is_err()) {
            // The ranks whose graphs (or parts of them) went out wait for this one.
            if went_out {
                let _ = watched(self, begun);
                self.state.desynced = true;
                if execs.first().is_some_and(GraphExec::has_ce) {
                    // Released, a launched rank's graph copies into the outputs of ranks whose
                    // graphs never ran: their streams (and through them the buffers' own) must
                    // first wait for every launched graph, or the caller, seeing the error,
                    // could free an output that is still being written.
                    self.join_ranks()?;
                    self.state.ce.release = true;
                    self.set_ce_flags(1)?;
                }
            }
            return Err(Error::Cuda {
                during: format!("launching the graph of rank {rank}"),
                source: e,
            });
        }
        watched(self, begun)
    }

    /// Uploads each graph to its device ahead of the first launch.
    pub(crate) fn upload_graphs(&mut self, execs: &[GraphExec]) -> Result<()> {
        for (r, g) in self.engine.ranks.iter().zip(execs) {
            r.ctx
                .bind_to_thread()
                .map_err(Error::cuda("binding a context"))?;
            for &(_, exec) in &g.parts {
                // SAFETY: as in `launch_graphs`.
                unsafe { result::graph::upload(exec, r.stream.get().cu_stream()) }
                    .map_err(Error::cuda("uploading a graph"))?;
            }
        }
        Ok(())
    }
}

/// Calls `launch(part, rank)` for every part of every one of `ranks` ranks, part by part and
/// every rank in turn, up to the first failure: one result per rank launched (every rank once
/// a part after the first has begun, the ones up to the failing one before), and whether
/// anything went out.
fn in_turn<E: Clone>(
    ranks: usize,
    parts: usize,
    mut launch: impl FnMut(usize, usize) -> std::result::Result<(), E>,
) -> (Vec<std::result::Result<(), E>>, bool) {
    let mut launched = vec![Ok(()); ranks];
    let mut went_out = false;
    for p in 0..parts {
        for rank in 0..ranks {
            launched[rank] = launch(p, rank);
            if launched[rank].is_err() {
                launched.truncate(if p == 0 { rank + 1 } else { ranks });
                return (launched, went_out);
            }
            went_out = true;
        }
    }
    (launched, went_out)
}

/// A graph ended by a capture, not yet instantiated.
pub(super) struct Ended(sys::CUgraph);

// SAFETY: a graph handle may be used from any thread as long as calls on it do not overlap; an
// `Ended` lives in the engine's state and is only touched under its lock.
unsafe impl Send for Ended {}

/// One instantiated graph of one rank.
pub(crate) struct GraphExec {
    ctx: Arc<CudaContext>,
    /// The graph and its executable, in parts launched in order: one part, or where ranks
    /// share a device one per P2P step and a last one (`EngineGuard::cut_capture`).
    parts: Vec<(sys::CUgraph, sys::CUgraphExec)>,
    /// Where it holds NCCL broadcasts, the engine's count of such graphs (one is this).
    nccl_count: Option<Arc<AtomicUsize>>,
    /// Which state's addresses the graph holds.
    holds: Holds,
}

/// The generations of the P2P state and of the copy-engine flags a graph was captured with,
/// and the NCCL communicators (`None`: it holds none of them). A graph whose state has been
/// closed or replaced since is never launched: its addresses point into memory that is freed
/// or leaked half reset, or its NCCL kernels would return without writing their outputs.
#[derive(Debug, Clone, Copy)]
struct Holds {
    p2p: Option<u64>,
    ce: Option<u64>,
    /// The id of the NCCL communicators it captured (`Comms`' id).
    nccl: Option<u64>,
}

// SAFETY: graph handles may be used from any thread as long as calls on one graph do not
// overlap; a `GraphExec` is only used through `&mut` or under the engine's lock.
unsafe impl Send for GraphExec {}
// SAFETY: as for `Send`: shared references only launch, which the engine's lock serialises.
unsafe impl Sync for GraphExec {}

impl GraphExec {
    /// The graph holds NCCL broadcasts: its launches are watched.
    fn has_nccl(&self) -> bool {
        self.nccl_count.is_some()
    }

    /// The graph holds copy-engine broadcasts: the ranks' graphs are launched together.
    fn has_ce(&self) -> bool {
        self.holds.ce.is_some()
    }

    /// Instantiates `graphs`, owning them from here on (destroyed on an error).
    ///
    /// # Safety
    /// `graphs` are live graphs ended by a capture in `ctx`, which is current, and owned by
    /// the caller, who hands them over (uses none of them again).
    unsafe fn instantiate(
        ctx: Arc<CudaContext>,
        graphs: Vec<sys::CUgraph>,
        nccl_count: Option<Arc<AtomicUsize>>,
        holds: Holds,
    ) -> Result<GraphExec> {
        let mut parts = Vec::with_capacity(graphs.len());
        let mut failed = None;
        for graph in graphs {
            if failed.is_some() {
                // SAFETY: handed over by the caller, not instantiated, used nowhere else.
                unsafe { GraphExec::destroy_graphs(&ctx, [graph]) };
                continue;
            }
            // SAFETY: `graph` is a live graph from end_capture in the current context.
            match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(exec) => parts.push((graph, exec)),
                Err(e) => {
                    // SAFETY: as above; its instantiation failed.
                    unsafe { GraphExec::destroy_graphs(&ctx, [graph]) };
                    failed = Some(e);
                }
            }
        }
        if let Some(count) = &nccl_count {
            count.fetch_add(1, Ordering::AcqRel);
        }
        // Dropped (its parts destroyed) on an error.
        let exec = GraphExec {
            ctx,
            parts,
            nccl_count,
            holds,
        };
        match failed {
            None => Ok(exec),
            Some(e) => Err(Error::Cuda {
                during: "instantiating a captured graph".into(),
                source: e,
            }),
        }
    }

    /// Destroys graphs that were never instantiated.
    ///
    /// # Safety
    /// `graphs` are live graphs of `ctx`, owned by the caller and used nowhere after this.
    unsafe fn destroy_graphs(
        ctx: &Arc<CudaContext>,
        graphs: impl IntoIterator<Item = sys::CUgraph>,
    ) {
        if make_current(ctx).is_ok() {
            for g in graphs {
                // SAFETY: an owned graph, not used again.
                let _ = unsafe { result::graph::destroy(g) };
            }
        }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        if let Some(count) = &self.nccl_count {
            count.fetch_sub(1, Ordering::AcqRel);
        }
        // Not `bind_to_thread`: it would take (and lose) an error cudarc stored from other
        // work on the context, which a later call must report, and leak the graph.
        if make_current(&self.ctx).is_ok() {
            for &(graph, exec) in &self.parts {
                // SAFETY: owned handles, not used again; an executable graph still running is
                // freed by the driver when it completes.
                unsafe {
                    let _ = result::graph::exec_destroy(exec);
                    let _ = result::graph::destroy(graph);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::in_turn;

    /// Launches in the order `in_turn` makes them, failing at `fail` (part, rank).
    fn run(
        ranks: usize,
        parts: usize,
        fail: Option<(usize, usize)>,
    ) -> (Vec<(usize, usize)>, Vec<bool>, bool) {
        let mut order = Vec::new();
        let (results, went_out) = in_turn(ranks, parts, |p, r| {
            order.push((p, r));
            if fail == Some((p, r)) {
                Err(())
            } else {
                Ok(())
            }
        });
        (order, results.iter().map(Result::is_ok).collect(), went_out)
    }

    #[test]
    fn parts_go_out_step_by_step_every_rank_in_turn() {
        let (order, ok, went_out) = run(2, 3, None);
        assert_eq!(order, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]);
        assert_eq!(ok, [true, true]);
        assert!(went_out);
    }

    #[test]
    fn a_failure_stops_the_launches_and_says_what_went_out() {
        // The first launch fails: nothing went out, one result.
        let (order, ok, went_out) = run(3, 2, Some((0, 0)));
        assert_eq!((order.len(), ok, went_out), (1, vec![false], false));
        // Rank 1's first part fails: rank 0's went out, rank 2 was never tried.
        let (order, ok, went_out) = run(3, 2, Some((0, 1)));
        assert_eq!((order.len(), ok, went_out), (2, vec![true, false], true));
        // A later part fails: every rank has a result, the failing one an error.
        let (order, ok, went_out) = run(3, 2, Some((1, 0)));
        assert_eq!(
            (order.len(), ok, went_out),
            (4, vec![false, true, true], true)
        );
    }
}
