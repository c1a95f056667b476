//! CUDA graph capture and replay of broadcasts.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::access;
use super::{Clique, Core};
use crate::config::{BroadcastOptions, Route, MAX_GPUS};
use crate::engine::{EngineGuard, GraphExec, Item};
use crate::error::Result;
use crate::plan::FusedReport;
use crate::tensor::{DeviceTensor, DeviceTensorMut};

/// The part of a capture that both capture forms share: the locked engine in capture mode.
struct Session<'c> {
    core: &'c Core,
    engine: EngineGuard<'c>,
    active: bool,
}

impl<'c> Session<'c> {
    fn begin(core: &'c Core) -> Result<Session<'c>> {
        let mut engine = core.engine.lock()?;
        engine.begin_capture()?;
        engine.set_capturing(true);
        Ok(Session {
            core,
            engine,
            active: true,
        })
    }

    /// Ends the capture: one instantiated graph per rank.
    fn finish(&mut self) -> Result<Vec<GraphExec>> {
        self.active = false;
        self.engine.set_capturing(false);
        self.engine.end_capture()
    }

    /// Validates and queues one call into the graphs being recorded.
    fn enqueue<'x, 'y>(
        &mut self,
        root: usize,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &mut [Vec<&'x mut (dyn DeviceTensorMut + 'y)>],
        options: &BroadcastOptions,
        single: bool,
    ) -> Result<FusedReport> {
        let core = self.core;
        let shapes = core.check_lists(root, inputs, outputs, single)?;
        let bytes: Vec<usize> = shapes.iter().map(|s| s.bytes).collect();
        let steps = core.plan(&bytes, options, true)?;
        let root_local = core.globals.iter().position(|&g| g == root);
        let report = FusedReport::of(&steps, &bytes);
        // Addresses are read through the side stream and the guards forgotten: inside a capture
        // cudarc's waits must not land on the capturing streams. Launches order the buffers.
        let mut items: Vec<Item> = shapes
            .iter()
            .map(|s| Item {
                src: 0,
                dsts: [0; MAX_GPUS],
                count: s.count,
                dtype: s.dtype,
            })
            .collect();
        for (local, list) in outputs.iter_mut().enumerate() {
            let side = core.engine.side_stream(local);
            for (t, out) in list.iter_mut().enumerate() {
                let (ptr, guard) = out.write_ptr(side);
                std::mem::forget(guard);
                items[t].dsts[local] = ptr;
            }
        }
        for (t, item) in items.iter_mut().enumerate() {
            item.src = match (inputs, root_local) {
                (Some(i), Some(local)) => {
                    let (ptr, guard) = i[t].read_ptr(core.engine.side_stream(local));
                    std::mem::forget(guard);
                    ptr
                }
                (None, Some(local)) => item.dsts[local],
                _ => 0,
            };
        }
        // SAFETY: validated against the clique; the capture's contract (borrowed for the
        // graph's life, or the unchecked form's caller) keeps the buffers alive for replays.
        // A call that fails here may have recorded some steps: its buffers are kept by the
        // safe forms all the same (`Capture::keep`, `OwnedCapture::queued`), and the engine
        // fails the whole capture, so no graph with such steps is ever launched.
        unsafe { self.engine.run(root, &items, &steps) }?;
        Ok(report)
    }
}

impl Drop for Session<'_> {
    /// A capture left by an error or a panic inside the closure is ended and discarded, so the
    /// streams leave capture mode.
    fn drop(&mut self) {
        if self.active {
            self.engine.set_capturing(false);
            self.engine.abandon_capture(self.core.len());
        }
    }
}

/// A capture in progress: the argument of the closure given to [`Clique::capture`]. Its
/// methods queue broadcasts into the graphs being recorded (nothing runs until
/// [`CliqueGraph::launch`]); the buffers they take stay borrowed for the graph's lifetime.
///
/// The capture holds the clique's lock: no other thread's broadcast lands in the graph, and a
/// call on the clique itself from inside the closure returns [`crate::Error::CaptureInProgress`].
pub struct Capture<'c, 'buf> {
    session: Session<'c>,
    reads: Vec<(usize, &'buf dyn DeviceTensor)>,
    writes: Vec<(usize, &'buf mut dyn DeviceTensorMut)>,
}

impl<'c, 'buf> Capture<'c, 'buf> {
    /// The stream that records local rank `local`'s part of the graph: work queued on it
    /// (kernels of your own) joins the graph, in order with the captured broadcasts. It is not
    /// [`Clique::stream`], which stays an ordinary stream while the capture runs. Work queued
    /// here must follow CUDA's capture rules: an allocation becomes the graph's own (valid
    /// only inside it), and cudarc's per-buffer waits on events recorded outside the capture
    /// fail. Where ranks share a device, each P2P broadcast ends a part of the graph and the
    /// next part begins (see the crate docs, "Threads"): work forked from this stream onto another
    /// must be joined back before the next broadcast, and an event recorded here before a
    /// broadcast cannot be waited for here after it.
    ///
    /// # Safety
    /// The graph does not keep what work queued here touches: every buffer it uses must stay
    /// allocated while any replay of the graph may run, and other work on it must be ordered
    /// with the replays (as for [`Clique::capture_unchecked`]). A buffer of a context whose
    /// cudarc tracks no events (a second `CudaContext` of the same device, say) is not stopped
    /// by CUDA's capture rules. Neither the stream nor a clone of it may be used once the
    /// capture's closure has returned: it records every later capture of the clique.
    pub unsafe fn stream(&self, local: usize) -> &'c Arc<CudaStream> {
        self.session.core.engine.capture_stream(local)
    }

    /// The route a broadcast of `bytes` bytes queued in this capture takes with `options`
    /// (the graph thresholds apply, which may differ from [`Clique::route`]'s eager ones).
    pub fn route(&self, bytes: usize, options: &BroadcastOptions) -> Result<Route> {
        self.session.core.route_in(bytes, options, true)
    }

    /// Captures [`Clique::broadcast`] of `input` into `outputs` (one per rank).
    pub fn broadcast<I: DeviceTensor, O: DeviceTensorMut>(
        &mut self,
        root: usize,
        input: &'buf I,
        outputs: &'buf mut [O],
    ) -> Result<()> {
        self.broadcast_with(root, input, outputs, &BroadcastOptions::default())
    }

    /// [`Capture::broadcast`] with per-call options.
    pub fn broadcast_with<I: DeviceTensor, O: DeviceTensorMut>(
        &mut self,
        root: usize,
        input: &'buf I,
        outputs: &'buf mut [O],
        options: &BroadcastOptions,
    ) -> Result<()> {
        let outs = outputs
            .iter_mut()
            .map(|o| vec![o as &'buf mut dyn DeviceTensorMut])
            .collect();
        self.keep(
            root,
            Some(vec![input as &'buf dyn DeviceTensor]),
            outs,
            options,
            true,
        )
        .map(|_| ())
    }

    /// Captures [`Clique::broadcast_in_place`]: `buffers[root]` is the source.
    pub fn broadcast_in_place<B: DeviceTensorMut>(
        &mut self,
        root: usize,
        buffers: &'buf mut [B],
    ) -> Result<()> {
        self.broadcast_in_place_with(root, buffers, &BroadcastOptions::default())
    }

    /// [`Capture::broadcast_in_place`] with per-call options.
    pub fn broadcast_in_place_with<B: DeviceTensorMut>(
        &mut self,
        root: usize,
        buffers: &'buf mut [B],
        options: &BroadcastOptions,
    ) -> Result<()> {
        let bufs = buffers
            .iter_mut()
            .map(|b| vec![b as &'buf mut dyn DeviceTensorMut])
            .collect();
        self.keep(root, None, bufs, options, true).map(|_| ())
    }

    /// Captures [`Clique::broadcast_many`]: `outputs[rank][tensor]`.
    pub fn broadcast_many(
        &mut self,
        root: usize,
        inputs: &[&'buf dyn DeviceTensor],
        outputs: Vec<Vec<&'buf mut dyn DeviceTensorMut>>,
    ) -> Result<FusedReport> {
        self.broadcast_many_with(root, inputs, outputs, &BroadcastOptions::default())
    }

    /// Captures [`Clique::broadcast_many_with`].
    pub fn broadcast_many_with(
        &mut self,
        root: usize,
        inputs: &[&'buf dyn DeviceTensor],
        outputs: Vec<Vec<&'buf mut dyn DeviceTensorMut>>,
        options: &BroadcastOptions,
    ) -> Result<FusedReport> {
        self.keep(root, Some(inputs.to_vec()), outputs, options, false)
    }

    /// Queues the call, then keeps its buffers for the graph's launches.
    fn keep(
        &mut self,
        root: usize,
        inputs: Option<Vec<&'buf dyn DeviceTensor>>,
        mut outputs: Vec<Vec<&'buf mut dyn DeviceTensorMut>>,
        options: &BroadcastOptions,
        single: bool,
    ) -> Result<FusedReport> {
        let report = self
            .session
            .enqueue(root, inputs.as_deref(), &mut outputs, options, single);
        // Kept even when the call failed: part of it may be in the graph (the capture then
        // fails as a whole, but the buffers stay borrowed until it has).
        let root_local = self.session.core.globals.iter().position(|&g| g == root);
        self.reads.extend(
            inputs
                .into_iter()
                .flatten()
                .map(|t| (root_local.unwrap_or(0), t)),
        );
        for (rank, list) in outputs.into_iter().enumerate() {
            self.writes.extend(list.into_iter().map(|b| (rank, b)));
        }
        report
    }
}

/// The argument of [`Clique::capture_unchecked`]'s closure: like [`Capture`], but it keeps no
/// borrow of the buffers (the caller's contract keeps them alive).
pub struct UncheckedCapture<'c> {
    session: Session<'c>,
}

impl<'c> UncheckedCapture<'c> {
    /// Begins a capture on `core`'s ranks.
    pub(crate) fn begin(core: &'c Core) -> Result<UncheckedCapture<'c>> {
        Ok(UncheckedCapture {
            session: Session::begin(core)?,
        })
    }

    /// Ends the capture: one instantiated graph per rank.
    pub(crate) fn finish(&mut self) -> Result<Vec<GraphExec>> {
        self.session.finish()
    }

    /// The core whose streams record this capture.
    pub(crate) fn core(&self) -> &'c Core {
        self.session.core
    }

    /// The stream that records local rank `local`'s part of the graph: work queued on it
    /// (kernels of your own) joins the graph, in order with the captured broadcasts. It is not
    /// [`Clique::stream`], which stays an ordinary stream while the capture runs. Work queued
    /// here must follow CUDA's capture rules: an allocation becomes the graph's own (valid
    /// only inside it), and cudarc's per-buffer waits on events recorded outside the capture
    /// fail. Where ranks share a device, each P2P broadcast ends a part of the graph and the
    /// next part begins (see the crate docs, "Threads"): work forked from this stream onto another
    /// must be joined back before the next broadcast, and an event recorded here before a
    /// broadcast cannot be waited for here after it.
    pub fn stream(&self, local: usize) -> &'c Arc<CudaStream> {
        self.session.core.engine.capture_stream(local)
    }

    /// The route a broadcast of `bytes` bytes queued in this capture takes with `options`
    /// (the graph thresholds apply, which may differ from [`Clique::route`]'s eager ones).
    pub fn route(&self, bytes: usize, options: &BroadcastOptions) -> Result<Route> {
        self.session.core.route_in(bytes, options, true)
    }

    /// Captures [`Clique::broadcast_with`] of `input` into `outputs` (one per rank).
    pub fn broadcast_with<I: DeviceTensor, O: DeviceTensorMut>(
        &mut self,
        root: usize,
        input: &I,
        outputs: &mut [O],
        options: &BroadcastOptions,
    ) -> Result<()> {
        let mut outs: Vec<Vec<&mut dyn DeviceTensorMut>> = outputs
            .iter_mut()
            .map(|o| vec![o as &mut dyn DeviceTensorMut])
            .collect();
        let ins = [input as &dyn DeviceTensor];
        self.session
            .enqueue(root, Some(&ins), &mut outs, options, true)
            .map(|_| ())
    }

    /// Captures [`Clique::broadcast_in_place_with`]: `buffers[root]` is the source.
    pub fn broadcast_in_place_with<B: DeviceTensorMut>(
        &mut self,
        root: usize,
        buffers: &mut [B],
        options: &BroadcastOptions,
    ) -> Result<()> {
        let mut bufs: Vec<Vec<&mut dyn DeviceTensorMut>> = buffers
            .iter_mut()
            .map(|b| vec![b as &mut dyn DeviceTensorMut])
            .collect();
        self.session
            .enqueue(root, None, &mut bufs, options, true)
            .map(|_| ())
    }

    /// Captures [`Clique::broadcast_many_with`].
    pub fn broadcast_many_with(
        &mut self,
        root: usize,
        inputs: &[&dyn DeviceTensor],
        outputs: &mut crate::clique::OutputLists<'_, '_>,
        options: &BroadcastOptions,
    ) -> Result<FusedReport> {
        self.session
            .enqueue(root, Some(inputs), outputs, options, false)
    }
}

/// A captured sequence of broadcasts: one CUDA graph per GPU of a clique. It borrows the
/// buffers it captured (`'buf`), so they cannot be dropped, moved or touched while it lives:
///
/// ```compile_fail
/// # fn main() -> Result<(), gpucast::Error> {
/// let clique = gpucast::Clique::new(&[0, 1])?;
/// let mut graph = {
///     let input = clique.stream(0).clone_htod(&[1.0f32; 16]).unwrap();
///     let mut outputs = clique.alloc_outputs::<f32>(16)?;
///     clique.capture(|c| c.broadcast(0, &input, &mut outputs))?
/// }; // `input` and `outputs` are dropped here while `graph` still uses them: rejected
/// graph.launch()?;
/// # Ok(()) }
/// ```
pub struct CliqueGraph<'c, 'buf> {
    core: &'c Core,
    execs: Vec<GraphExec>,
    reads: Vec<(usize, &'buf dyn DeviceTensor)>,
    writes: Vec<(usize, &'buf mut dyn DeviceTensorMut)>,
}

impl Clique {
    /// Captures the broadcasts that `f` queues through its [`Capture`] into one CUDA graph per
    /// GPU, to be replayed with [`CliqueGraph::launch`]. The P2P kernel keeps its counters on
    /// the device, so every replay runs the protocol afresh, and eager calls may be mixed with
    /// replays.
    ///
    /// ```no_run
    /// let clique = gpucast::Clique::new(&[0, 1])?;
    /// let input = clique.stream(0).clone_htod(&[1u8; 4096]).unwrap();
    /// let mut outputs = clique.alloc_outputs::<u8>(4096)?;
    /// let mut graph = clique.capture(|c| c.broadcast(0, &input, &mut outputs))?;
    /// for _ in 0..10 {
    ///     graph.launch()?;
    /// }
    /// drop(graph); // releases `input` and `outputs`
    /// clique.synchronize()?;
    /// # Ok::<(), gpucast::Error>(())
    /// ```
    pub fn capture<'c, 'buf, F>(&'c self, f: F) -> Result<CliqueGraph<'c, 'buf>>
    where
        F: FnOnce(&mut Capture<'c, 'buf>) -> Result<()>,
    {
        self.core.capture(f)
    }

    /// [`Clique::capture`] without tying the graph to the captured buffers, for buffers that
    /// the caller keeps alive and rewrites between replays (static graph inputs and outputs).
    /// Launches do no per-buffer ordering.
    ///
    /// # Safety
    /// Every buffer passed to the capture, or touched by work queued on its streams
    /// ([`UncheckedCapture::stream`]; neither a stream nor a clone of it may be used once the
    /// closure has returned, since it records every later capture of the clique), must stay
    /// allocated, and must not be freed (even by a stream-ordered free on another stream) while
    /// any replay of the graph may still run;
    /// work that produces its inputs or reads its outputs must be ordered with the clique's
    /// streams (run it on them, or use [`Clique::wait_for`] / [`Clique::record`]).
    pub unsafe fn capture_unchecked<'c, F>(&'c self, f: F) -> Result<CliqueGraph<'c, 'static>>
    where
        F: FnOnce(&mut UncheckedCapture<'c>) -> Result<()>,
    {
        // SAFETY: the same contract.
        unsafe { self.core.capture_unchecked(f) }
    }
}

impl Core {
    /// See [`Clique::capture`].
    pub(crate) fn capture<'c, 'buf, F>(&'c self, f: F) -> Result<CliqueGraph<'c, 'buf>>
    where
        F: FnOnce(&mut Capture<'c, 'buf>) -> Result<()>,
    {
        let mut cap = Capture {
            session: Session::begin(self)?,
            reads: Vec::new(),
            writes: Vec::new(),
        };
        let body = f(&mut cap);
        let execs = cap.session.finish();
        body?;
        // The session's clique, not `self`: the closure may have swapped `cap` with the capture
        // of another clique, and the graphs belong to the clique whose streams recorded them.
        Ok(CliqueGraph {
            core: cap.session.core,
            execs: execs?,
            reads: std::mem::take(&mut cap.reads),
            writes: std::mem::take(&mut cap.writes),
        })
    }

    /// See [`Clique::capture_unchecked`].
    ///
    /// # Safety
    /// As for `Clique::capture_unchecked`.
    pub(crate) unsafe fn capture_unchecked<'c, F>(
        &'c self,
        f: F,
    ) -> Result<CliqueGraph<'c, 'static>>
    where
        F: FnOnce(&mut UncheckedCapture<'c>) -> Result<()>,
    {
        let mut cap = UncheckedCapture {
            session: Session::begin(self)?,
        };
        let body = f(&mut cap);
        let execs = cap.session.finish();
        body?;
        // As in `capture`: the session's clique.
        Ok(CliqueGraph {
            core: cap.session.core,
            execs: execs?,
            reads: Vec::new(),
            writes: Vec::new(),
        })
    }
}

impl CliqueGraph<'_, '_> {
    /// Replays the captured broadcasts on every GPU (asynchronously, on the clique's streams),
    /// ordered after the captured buffers' earlier work and before their later work, as an
    /// eager call is.
    pub fn launch(&mut self) -> Result<()> {
        let read_streams: Vec<Arc<CudaStream>> =
            self.reads.iter().map(|(_, t)| t.stream().clone()).collect();
        let write_streams: Vec<Arc<CudaStream>> = self
            .writes
            .iter()
            .map(|(_, t)| t.stream().clone())
            .collect();
        let buffers: Vec<(usize, &Arc<CudaStream>)> = (self.reads.iter().map(|(local, _)| *local))
            .zip(&read_streams)
            .chain(
                self.writes
                    .iter()
                    .map(|(local, _)| *local)
                    .zip(&write_streams),
            )
            .collect();
        let (reads, writes) = (&self.reads, &mut self.writes);
        let (rs, ws) = (&read_streams, &write_streams);
        let guards = move || {
            // Moved out of the closure: the guards borrow the buffers for the whole launch.
            let writes = writes;
            let r: Vec<_> = reads
                .iter()
                .zip(rs)
                .map(|((_, t), s)| t.read_ptr(s).1)
                .collect();
            let w: Vec<_> = writes
                .iter_mut()
                .zip(ws)
                .map(|((_, t), s)| t.write_ptr(s).1)
                .collect();
            (r, w)
        };
        replay(self.core, &self.execs, || buffers.iter().copied(), guards)
    }

    /// Uploads each graph to its device ahead of the first launch.
    pub fn upload(&self) -> Result<()> {
        self.core.engine.lock()?.upload_graphs(&self.execs)
    }
}

/// Replays `execs` on `core`'s ranks in the ordering sequence of a call with buffers
/// ([`access::ordered`]: `buffers` names them, `guards` takes their guards), under the lock.
pub(crate) fn replay<'s, I, G>(
    core: &Core,
    execs: &[GraphExec],
    buffers: impl Fn() -> I,
    guards: impl FnOnce() -> G,
) -> Result<()>
where
    I: Iterator<Item = (usize, &'s Arc<CudaStream>)>,
{
    let mut engine = core.engine.lock()?;
    access::ordered(&mut engine, buffers, guards, |e, _| e.launch_graphs(execs))
}
