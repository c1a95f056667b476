//! CUDA graph capture and replay of broadcasts: the graph owns its buffers and lends them out
//! between replays ([`Clique::capture`]), or the caller keeps them alive
//! ([`Clique::capture_unchecked`]).
//!
//! What keeps the safe form sound, where an input is rewritten and an output read between
//! replays:
//! - before the capture, the graph notes where each of its buffers lies (device, context,
//!   address, length); a captured call may only use memory inside those buffers, or it is an
//!   error before the call queues anything; work of one's own on a capture stream is `unsafe`
//!   ([`Capture::stream`]), since it would touch memory nobody checks;
//! - every launch visits the buffers again, takes each one's cudarc guard (so the replay comes
//!   after the buffers' earlier work on any stream, and their later work and their frees come
//!   after it, as for an eager call), and refuses to launch, before anything is queued on the
//!   clique's or the buffers' streams, when a range a captured call used no longer lies inside
//!   a buffer (one was replaced by a smaller one, or moved, while lent out). A replacement
//!   that still covers every used range is used as it is: the graph then writes memory it owns.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::access;
use super::args::Place;
use super::broadcast::{CliqueBroadcast, RankBroadcast};
use super::sealed::Queue;
use super::{Clique, Communicator, Core};
use crate::config::{BroadcastOptions, Route, MAX_GPUS};
use crate::dtype::Element;
use crate::engine::{EngineGuard, GraphExec, Item};
use crate::error::{Error, Result};
use crate::plan::FusedReport;
use crate::ranks::{Local, Root};
use crate::tensor::{DeviceTensor, DeviceTensorMut};

/// The locked engine in capture mode.
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
        root: Root,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &mut [Vec<&'x mut (dyn DeviceTensorMut + 'y)>],
        options: &BroadcastOptions,
        single: bool,
    ) -> Result<FusedReport> {
        let core = self.core;
        let shapes = core.check_lists(root, inputs, outputs, single)?;
        let bytes: Vec<usize> = shapes.iter().map(|s| s.bytes).collect();
        let steps = core.plan(&bytes, &core.call_settings(options, true))?;
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
            item.src = match (inputs, root.local) {
                (Some(i), Some(Local(local))) => {
                    let (ptr, guard) = i[t].read_ptr(core.engine.side_stream(local));
                    std::mem::forget(guard);
                    ptr
                }
                (None, Some(Local(local))) => item.dsts[local],
                _ => 0,
            };
        }
        // SAFETY: validated against the clique; the buffers stay alive for replays because the
        // safe form's graph owns them or is lent them for its life and checks every used range
        // against them at each launch, and the unchecked form's caller promises it.
        // A call that fails here may have recorded some steps: its buffers' ranges are noted
        // all the same (`Capture::queue`), and the engine
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

/// A capture in progress: the argument of the closure given to [`Clique::capture`] (or
/// [`Communicator::capture`], and their unchecked forms). Its broadcast methods
/// ([`CliqueBroadcast`] for a clique's, [`RankBroadcast`] for a communicator's) queue calls into
/// the graphs being recorded; nothing runs until [`CliqueGraph::launch`]. In the safe form every
/// buffer a call takes must lie inside the buffers the graph owns ([`Error::InvalidArgument`]
/// otherwise, before anything is queued).
///
/// The capture holds the clique's lock: no other thread's broadcast lands in the graph, and a
/// call on the clique itself from inside the closure returns [`crate::error::Error::CaptureInProgress`].
pub struct Capture<'c, F> {
    core: &'c Core,
    session: RefCell<Session<'c>>,
    /// The ranges of the graph's buffers; `None` in the unchecked form (the caller's contract
    /// keeps the buffers alive).
    owned: Option<Vec<Span>>,
    /// The ranges the captured calls use.
    used: RefCell<Vec<Span>>,
    _front: PhantomData<fn() -> F>,
}

impl<'c, F> Capture<'c, F> {
    fn begin(core: &'c Core, owned: Option<Vec<Span>>) -> Result<Capture<'c, F>> {
        Ok(Capture {
            core,
            session: RefCell::new(Session::begin(core)?),
            owned,
            used: RefCell::new(Vec::new()),
            _front: PhantomData,
        })
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
    ///
    /// # Safety
    /// The graph does not keep or check what work queued here touches: every buffer it uses
    /// must stay allocated while any replay of the graph may run, and other work on it must be
    /// ordered with the replays (as for [`Clique::capture_unchecked`]). A buffer of a context
    /// whose cudarc tracks no events (a second `CudaContext` of the same device, say) is not
    /// stopped by CUDA's capture rules. Neither the stream nor a clone of it may be used once
    /// the capture's closure has returned: it records every later capture of the clique.
    pub unsafe fn stream(&self, local: usize) -> &'c Arc<CudaStream> {
        self.core.engine.capture_stream(local)
    }

    /// The route a broadcast of `bytes` bytes queued in this capture takes with `options`
    /// (the graph thresholds apply, which may differ from [`Clique::route`]'s eager ones).
    pub fn route(&self, bytes: usize, options: &BroadcastOptions) -> Result<Route> {
        (self.core).route_of(bytes, &self.core.call_settings(options, true))
    }

    /// The ranges of a call's buffers (`(local rank, buffer)`), checked to lie inside the
    /// graph's buffers; none in the unchecked form.
    fn admit<'t>(
        &self,
        tensors: impl IntoIterator<Item = (usize, &'t dyn DeviceTensor)>,
    ) -> Result<Vec<Span>> {
        let Some(owned) = &self.owned else {
            return Ok(Vec::new());
        };
        let mut spans = Vec::new();
        for (local, t) in tensors {
            // A buffer for no rank fails the call's own validation, before anything is queued.
            if local < self.core.len() {
                spans.push(span_of(self.core, local, t));
            }
        }
        if let Some(i) = first_outside(owned, &spans) {
            return Err(Error::InvalidArgument(format!(
                "a buffer of this call ({} bytes) is not inside the buffers the graph owns: \
                 pass the graph's own buffers (the closure's second argument)",
                spans[i].len
            )));
        }
        Ok(spans)
    }

    /// Checks a call's buffers against the graph's, queues it, and notes their ranges as used
    /// by the graph whatever the call returns: a call that fails may still have recorded some
    /// of its steps, and a caller may ignore its error and end the capture (the capture then
    /// fails as a whole).
    fn queue<'a, 'b>(
        &self,
        root: usize,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &mut [Vec<&'a mut (dyn DeviceTensorMut + 'b)>],
        options: Option<&BroadcastOptions>,
        single: bool,
    ) -> Result<FusedReport> {
        let root = self.core.ranks().root(root);
        let ins = (root.local)
            .into_iter()
            .flat_map(|Local(l)| inputs.unwrap_or_default().iter().map(move |t| (l, *t)));
        let outs = outputs
            .iter()
            .enumerate()
            .flat_map(|(r, l)| l.iter().map(move |t| (r, &**t as &dyn DeviceTensor)));
        let spans = self.admit(ins.chain(outs))?;
        let default = BroadcastOptions::default();
        let options = options.unwrap_or(&default);
        let report = self
            .session
            .borrow_mut()
            .enqueue(root, inputs, outputs, options, single);
        self.used.borrow_mut().extend(spans);
        report
    }
}

impl<F> Queue for Capture<'_, F> {
    fn queue_one(
        &self,
        root: usize,
        input: Option<&dyn DeviceTensor>,
        outputs: &mut [&mut dyn DeviceTensorMut],
        options: Option<&BroadcastOptions>,
    ) -> Result<()> {
        let mut lists: Vec<Vec<&mut dyn DeviceTensorMut>> =
            outputs.iter_mut().map(|o| vec![&mut **o]).collect();
        let inputs = input.as_ref().map(std::slice::from_ref);
        self.queue(root, inputs, &mut lists, options, true)
            .map(|_| ())
    }

    fn queue_many<'a, 'b>(
        &self,
        root: usize,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &mut [Vec<&'a mut (dyn DeviceTensorMut + 'b)>],
        options: Option<&BroadcastOptions>,
    ) -> Result<FusedReport> {
        self.queue(root, inputs, outputs, options, false)
    }
}

impl CliqueBroadcast for Capture<'_, Clique> {}
impl RankBroadcast for Capture<'_, Communicator> {}

/// A captured sequence of broadcasts: one CUDA graph per GPU of a clique (or this rank's
/// GPU), and the buffers `B` it owns (`()` in the unchecked form). Between replays,
/// [`CliqueGraph::buffers_mut`] lends the buffers out, to write an input or read an output on
/// any stream; each launch orders the replay after that work and before the work that
/// follows, and refuses to run if a range a captured call uses is no longer inside the
/// buffers (a buffer was replaced by one elsewhere, or smaller).
///
/// ```no_run
/// use gpucast::prelude::*;
/// let clique = gpucast::Clique::new(&[0, 1])?;
/// let input = clique.stream(0).alloc_zeros::<f32>(1 << 20).unwrap();
/// let outputs = clique.alloc_outputs::<f32>(1 << 20)?;
/// let mut graph = clique.capture((input, outputs), |c, (input, outputs)| {
///     c.broadcast(0, input, outputs)
/// })?;
/// for step in 0..10 {
///     let (input, _) = graph.buffers_mut();
///     clique.stream(0).memcpy_htod(&vec![step as f32; 1 << 20], input).unwrap();
///     graph.launch()?;
/// }
/// let (_, outputs) = graph.into_buffers();
/// # Ok::<(), gpucast::Error>(())
/// ```
///
/// Buffers lent (`&mut`) rather than given stay borrowed for the graph's life, so they cannot
/// be dropped, moved or touched while it lives:
///
/// ```compile_fail
/// # fn main() -> Result<(), gpucast::Error> {
/// use gpucast::prelude::*;
/// let clique = gpucast::Clique::new(&[0, 1])?;
/// let mut graph = {
///     let mut input = clique.stream(0).clone_htod(&[1.0f32; 16]).unwrap();
///     let mut outputs = clique.alloc_outputs::<f32>(16)?;
///     clique.capture((&mut input, &mut outputs), |c, (i, o)| c.broadcast(0, i, o))?
/// }; // `input` and `outputs` are dropped here while `graph` still uses them: rejected
/// graph.launch()?;
/// # Ok(()) }
/// ```
pub struct CliqueGraph<'c, B = ()> {
    core: &'c Core,
    execs: Vec<GraphExec>,
    /// The ranges the captured calls use.
    used: Vec<Span>,
    buffers: B,
}

impl<B: GraphBuffers> CliqueGraph<'_, B> {
    /// Replays the captured broadcasts on every GPU (asynchronously, on the clique's streams),
    /// ordered after the buffers' earlier work and before their later work, as an eager call
    /// is. [`Error::InvalidArgument`], with nothing queued, when a range a captured call uses
    /// no longer lies inside the graph's buffers.
    pub fn launch(&mut self) -> Result<()> {
        let core = self.core;
        // Visited before the lock is taken: a `visit` of the caller's own may call the clique.
        let mut tensors: Vec<&mut dyn DeviceTensorMut> = Vec::new();
        self.buffers.visit(&mut |t| tensors.push(t));
        let streams: Vec<Arc<CudaStream>> = tensors.iter().map(|t| t.stream().clone()).collect();
        let mut buffers: Vec<(usize, &Arc<CudaStream>)> = Vec::new();
        let mut owned = Vec::with_capacity(tensors.len());
        for (t, s) in tensors.iter().zip(&streams) {
            let Some(&first) = ranks_at(core, access::place_of(s)).first() else {
                return Err(Error::InvalidArgument(
                    "a buffer of the graph is on no device (or context) of the clique".into(),
                ));
            };
            let span = span_of(core, first, &**t);
            // Ordered with the ranks whose captured calls use it, as an eager call orders a
            // buffer with its own rank only (where ranks share a device, the others' streams
            // never wait for this buffer's stream); a buffer no call uses, with the first
            // rank of its device.
            let users = users_of(&span, &self.used);
            buffers.extend(
                users
                    .iter()
                    .copied()
                    .chain((users.is_empty()).then_some(first))
                    .map(|r| (r, s)),
            );
            owned.push(span);
        }
        // Checked before anything is queued on the clique's or the buffers' streams; the
        // buffers stay borrowed from here to the launch, so they are the ones checked. (The
        // unchecked form notes no ranges.)
        if let Some(i) = first_outside(&owned, &self.used) {
            return Err(Error::InvalidArgument(format!(
                "a range that the graph's calls use ({} bytes) is no longer inside its \
                 buffers: one was replaced while lent out; capture again",
                self.used[i].len
            )));
        }
        let ss = &streams;
        let guards = move || {
            let tensors = tensors;
            tensors
                .into_iter()
                .zip(ss)
                .map(|(t, s)| t.write_ptr(s).1)
                .collect::<Vec<_>>()
        };
        replay(core, &self.execs, || buffers.iter().copied(), guards)
    }

    /// Uploads each graph to its device ahead of the first launch.
    pub fn upload(&self) -> Result<()> {
        self.core.engine.lock()?.upload_graphs(&self.execs)
    }
}

impl<B> CliqueGraph<'_, B> {
    /// The buffers.
    pub fn buffers(&self) -> &B {
        &self.buffers
    }

    /// The buffers, to write an input or read an output between replays (on any stream: the
    /// next launch is ordered after it). Replacing a buffer so that a range the graph's calls
    /// use is no longer inside the buffers makes the next launch an error.
    pub fn buffers_mut(&mut self) -> &mut B {
        &mut self.buffers
    }

    /// Drops the graphs and hands the buffers back (replays still running are ordered before
    /// the buffers' later work and frees, as after an eager call).
    pub fn into_buffers(self) -> B {
        let CliqueGraph { execs, buffers, .. } = self;
        drop(execs);
        buffers
    }
}

impl Core {
    /// Captures what `f` queues into a graph that owns `buffers`; see [`Clique::capture`].
    pub(crate) fn capture<'c, Fr, B, F>(
        &'c self,
        mut buffers: B,
        f: F,
    ) -> Result<CliqueGraph<'c, B>>
    where
        B: GraphBuffers,
        F: FnOnce(&mut Capture<'c, Fr>, &mut B) -> Result<()>,
    {
        let mut owned = Vec::new();
        let mut misplaced = false;
        buffers.visit(
            &mut |t| match ranks_at(self, access::place_of(t.stream())).first() {
                Some(&local) => owned.push(span_of(self, local, &*t)),
                None => misplaced = true,
            },
        );
        if misplaced {
            return Err(Error::InvalidArgument(
                "a buffer given to capture is on no device (or context) of the clique".into(),
            ));
        }
        let mut cap = Capture::begin(self, Some(owned))?;
        let body = f(&mut cap, &mut buffers);
        cap.finish(body, buffers)
    }

    /// See [`Clique::capture_unchecked`].
    ///
    /// # Safety
    /// As for `Clique::capture_unchecked`.
    pub(crate) unsafe fn capture_unchecked<'c, Fr, F>(&'c self, f: F) -> Result<CliqueGraph<'c>>
    where
        F: FnOnce(&mut Capture<'c, Fr>) -> Result<()>,
    {
        let mut cap = Capture::begin(self, None)?;
        let body = f(&mut cap);
        cap.finish(body, ())
    }
}

impl<'c, F> Capture<'c, F> {
    /// Ends the capture (whatever the closure returned: the streams leave capture mode), then
    /// the graph, or the closure's error.
    fn finish<B>(self, body: Result<()>, buffers: B) -> Result<CliqueGraph<'c, B>> {
        let execs = self.session.borrow_mut().finish();
        body?;
        // The capture's own clique: the closure may have swapped `cap` with another clique's
        // capture (its calls, spans and all), and the graphs belong to the clique whose
        // streams recorded them.
        Ok(CliqueGraph {
            core: self.core,
            execs: execs?,
            used: self.used.into_inner(),
            buffers,
        })
    }
}

/// The device buffers a [`CliqueGraph`] holds, owned or lent (`&mut`) for the graph's life
/// (`()` for none: [`Clique::capture_unchecked`]). Implemented for `CudaSlice<T>` and for
/// vectors, arrays and tuples of implementors; implement it for a struct of your own by
/// visiting each of its buffers.
pub trait GraphBuffers {
    /// Calls `f` on every device buffer inside, each once.
    fn visit<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut dyn DeviceTensorMut));
}

/// Buffers lent to the graph for its life (they stay borrowed until it is dropped).
impl<B: GraphBuffers + ?Sized> GraphBuffers for &mut B {
    fn visit<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut dyn DeviceTensorMut)) {
        (**self).visit(f);
    }
}

impl GraphBuffers for () {
    fn visit<'a>(&'a mut self, _: &mut dyn FnMut(&'a mut dyn DeviceTensorMut)) {}
}

impl<T: Element> GraphBuffers for CudaSlice<T> {
    fn visit<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut dyn DeviceTensorMut)) {
        f(self);
    }
}

impl<B: GraphBuffers> GraphBuffers for Vec<B> {
    fn visit<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut dyn DeviceTensorMut)) {
        for b in self {
            b.visit(f);
        }
    }
}

impl<B: GraphBuffers, const N: usize> GraphBuffers for [B; N] {
    fn visit<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut dyn DeviceTensorMut)) {
        for b in self {
            b.visit(f);
        }
    }
}

impl<A: GraphBuffers, B: GraphBuffers> GraphBuffers for (A, B) {
    fn visit<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut dyn DeviceTensorMut)) {
        self.0.visit(f);
        self.1.visit(f);
    }
}

impl<A: GraphBuffers, B: GraphBuffers, C: GraphBuffers> GraphBuffers for (A, B, C) {
    fn visit<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut dyn DeviceTensorMut)) {
        self.0.visit(f);
        self.1.visit(f);
        self.2.visit(f);
    }
}

/// A range of device memory: its context (as an opaque id), first address and length, and the
/// local rank it was read for (a captured call's rank that uses it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub ctx: usize,
    pub start: u64,
    pub len: usize,
    pub rank: usize,
}

impl Span {
    /// Whether `inner` lies inside this range, in the same context.
    fn holds(&self, inner: &Span) -> bool {
        let end = |s: &Span| u128::from(s.start) + s.len as u128;
        self.ctx == inner.ctx && inner.start >= self.start && end(inner) <= end(self)
    }
}

/// The local ranks (ascending, each once) of the ranges of `used` that `buffer` holds.
fn users_of(buffer: &Span, used: &[Span]) -> Vec<usize> {
    let mut ranks: Vec<usize> = used
        .iter()
        .filter(|u| buffer.holds(u))
        .map(|u| u.rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// The first of `used` that no range of `owned` holds, if any.
pub(crate) fn first_outside(owned: &[Span], used: &[Span]) -> Option<usize> {
    used.iter().position(|u| !owned.iter().any(|o| o.holds(u)))
}

/// The local ranks of `core` whose device and context are `place`'s.
fn ranks_at(core: &Core, place: Place) -> Vec<usize> {
    (0..core.len())
        .filter(|&r| core.places[r] == place)
        .collect()
}

/// Where `t` lies, its address read through the side stream of `local`: cudarc's wait for the
/// buffer's earlier work lands there (never on a stream that records a capture, nor on the
/// clique's or the buffer's streams), and the guard's record is dropped.
fn span_of(core: &Core, local: usize, t: &dyn DeviceTensor) -> Span {
    let (start, guard) = t.read_ptr(core.engine.side_stream(local));
    std::mem::forget(guard);
    Span {
        ctx: t.stream().context().cu_ctx() as usize,
        start,
        len: t.num_bytes(),
        rank: local,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn span(ctx: usize, start: u64, len: usize) -> Span {
        Span {
            ctx,
            start,
            len,
            rank: 0,
        }
    }

    #[test]
    fn a_buffer_is_ordered_with_the_ranks_whose_calls_use_it() {
        let at = |rank, start, len| Span {
            rank,
            ..span(1, start, len)
        };
        let buffer = span(1, 0x1000, 256);
        // Two ranks of one device: the root's input read by rank 0 only, twice.
        let used = [at(0, 0x1000, 64), at(1, 0x8000, 64), at(0, 0x1040, 64)];
        assert_eq!(users_of(&buffer, &used), vec![0]);
        // A buffer that holds ranges of ranks 2 and 1.
        let used = [at(2, 0x1000, 8), at(1, 0x1010, 8), at(2, 0x1020, 8)];
        assert_eq!(users_of(&buffer, &used), vec![1, 2]);
        // Another context's range at the same address, and no range: no user.
        assert!(users_of(
            &buffer,
            &[Span {
                ctx: 2,
                ..at(3, 0x1000, 8)
            }]
        )
        .is_empty());
        assert!(users_of(&buffer, &[]).is_empty());
    }

    #[test]
    fn a_range_inside_an_owned_buffer_is_held() {
        let owned = [span(1, 0x1000, 256), span(1, 0x8000, 64)];
        assert_eq!(first_outside(&owned, &[span(1, 0x1000, 256)]), None);
        assert_eq!(
            first_outside(&owned, &[span(1, 0x1080, 16), span(1, 0x8000, 64)]),
            None
        );
        assert_eq!(first_outside(&owned, &[]), None);
    }

    #[test]
    fn a_range_past_a_buffer_or_in_another_context_is_not() {
        let owned = [span(1, 0x1000, 256)];
        // One byte past the end.
        assert_eq!(first_outside(&owned, &[span(1, 0x1001, 256)]), Some(0));
        // Before the start.
        assert_eq!(first_outside(&owned, &[span(1, 0xfff, 2)]), Some(0));
        // The same addresses in another context.
        assert_eq!(first_outside(&owned, &[span(2, 0x1000, 256)]), Some(0));
        // The second of two.
        assert_eq!(
            first_outside(&owned, &[span(1, 0x1000, 8), span(1, 0x2000, 8)]),
            Some(1)
        );
        // A buffer replaced by a shorter one at the same address.
        assert_eq!(first_outside(&[span(1, 0x1000, 128)], &owned), Some(0));
    }

    #[test]
    fn ranges_at_the_top_of_the_address_space_do_not_wrap() {
        let owned = [span(1, u64::MAX - 15, 16)];
        assert_eq!(first_outside(&owned, &[span(1, u64::MAX - 15, 16)]), None);
        assert_eq!(
            first_outside(&owned, &[span(1, u64::MAX - 15, 17)]),
            Some(0)
        );
    }
}
