//! Graphs that own their buffers ([`Clique::capture_owned`]): the safe form for a training
//! step, where an input is rewritten and an output read between replays.
//!
//! A [`CliqueGraph`](super::CliqueGraph) borrows what it captured for its whole life, so no
//! buffer it uses can be written between replays without `unsafe`. An [`OwnedGraph`] holds
//! the buffers instead and lends them out between replays ([`OwnedGraph::buffers_mut`]).
//! What keeps that sound:
//! - before the capture, the graph notes where each of its buffers lies (device, context,
//!   address, length); a captured call may only use memory inside those buffers, or it is an
//!   error before the call queues anything, and the capture hands out no stream for work of one's
//!   own (which would touch memory nobody checks);
//! - every launch visits the buffers again, takes each one's cudarc guard (so the replay comes
//!   after the buffers' earlier work on any stream, and their later work and their frees come
//!   after it, as for an eager call), and refuses to launch, before anything is queued on the
//!   clique's or the buffers' streams, when a range a captured call used no longer lies inside
//!   a buffer (one was replaced by a smaller one, or moved, while lent out). A replacement
//!   that still covers every used range is used as it is: the graph then writes memory it owns.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::access;
use super::args::Place;
use super::graph::UncheckedCapture;
use super::{Clique, Core};
use crate::config::{BroadcastOptions, Route};
use crate::dtype::Element;
use crate::engine::GraphExec;
use crate::error::{Error, Result};
use crate::plan::FusedReport;
use crate::tensor::{DeviceTensor, DeviceTensorMut};

/// The device buffers an [`OwnedGraph`] holds. Implemented for `CudaSlice<T>` and for
/// vectors, arrays and tuples of implementors; implement it for a struct of your own by
/// visiting each of its buffers.
pub trait GraphBuffers {
    /// Calls `f` on every device buffer inside, each once.
    fn visit<'a>(&'a mut self, f: &mut dyn FnMut(&'a mut dyn DeviceTensorMut));
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

/// A range of device memory: its context (as an opaque id), first address and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub ctx: usize,
    pub start: u64,
    pub len: usize,
}

impl Span {
    /// Whether `inner` lies inside this range, in the same context.
    fn holds(&self, inner: &Span) -> bool {
        let end = |s: &Span| u128::from(s.start) + s.len as u128;
        self.ctx == inner.ctx && inner.start >= self.start && end(inner) <= end(self)
    }
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
    }
}

/// The argument of [`Clique::capture_owned`]'s closure: like [`super::Capture`], but every
/// buffer it is given must lie inside the buffers the graph owns
/// ([`Error::InvalidArgument`] otherwise, before anything is queued). It hands out no capture
/// stream: work of your own in the graph would touch memory the graph does not check.
pub struct OwnedCapture<'c> {
    inner: UncheckedCapture<'c>,
    core: &'c Core,
    owned: Vec<Span>,
    used: Vec<Span>,
}

impl<'c> OwnedCapture<'c> {
    /// The route a broadcast of `bytes` bytes queued in this capture takes with `options`.
    pub fn route(&self, bytes: usize, options: &BroadcastOptions) -> Result<Route> {
        self.inner.route(bytes, options)
    }

    /// Runs `call` (which may queue work into the graph) and notes `spans`, its buffers'
    /// ranges, as used by the graph whatever `call` returns: a call that fails may still have
    /// recorded some of its steps, and a caller may ignore its error and end the capture.
    fn queued<R>(
        &mut self,
        spans: Vec<Span>,
        call: impl FnOnce(&mut UncheckedCapture<'c>) -> Result<R>,
    ) -> Result<R> {
        let r = call(&mut self.inner);
        self.used.extend(spans);
        r
    }

    /// The ranges of a call's buffers (`(local rank, buffer)`), checked to lie inside the
    /// graph's buffers; the caller notes them in `used` ([`OwnedCapture::queued`]).
    fn admit<'t>(
        &self,
        tensors: impl IntoIterator<Item = (usize, &'t dyn DeviceTensor)>,
    ) -> Result<Vec<Span>> {
        let mut spans = Vec::new();
        for (local, t) in tensors {
            // A buffer for no rank fails the call's own validation, before anything is queued.
            if local < self.core.len() {
                spans.push(span_of(self.core, local, t));
            }
        }
        if let Some(i) = first_outside(&self.owned, &spans) {
            return Err(Error::InvalidArgument(format!(
                "a buffer of this call ({} bytes) is not inside the buffers the graph owns: \
                 pass the graph's own buffers (the closure's second argument)",
                spans[i].len
            )));
        }
        Ok(spans)
    }

    /// Captures [`Clique::broadcast`] of `input` into `outputs` (one per rank).
    pub fn broadcast<I: DeviceTensor, O: DeviceTensorMut>(
        &mut self,
        root: usize,
        input: &I,
        outputs: &mut [O],
    ) -> Result<()> {
        self.broadcast_with(root, input, outputs, &BroadcastOptions::default())
    }

    /// [`OwnedCapture::broadcast`] with per-call options.
    pub fn broadcast_with<I: DeviceTensor, O: DeviceTensorMut>(
        &mut self,
        root: usize,
        input: &I,
        outputs: &mut [O],
        options: &BroadcastOptions,
    ) -> Result<()> {
        // A clique's ranks are its local ranks; a root out of range fails validation.
        let outs = outputs
            .iter()
            .enumerate()
            .map(|(r, o)| (r, o as &dyn DeviceTensor));
        let spans = self.admit(std::iter::once((root, input as &dyn DeviceTensor)).chain(outs))?;
        self.queued(spans, |inner| {
            inner.broadcast_with(root, input, outputs, options)
        })
    }

    /// Captures [`Clique::broadcast_in_place`]: `buffers[root]` is the source.
    pub fn broadcast_in_place<B: DeviceTensorMut>(
        &mut self,
        root: usize,
        buffers: &mut [B],
    ) -> Result<()> {
        self.broadcast_in_place_with(root, buffers, &BroadcastOptions::default())
    }

    /// [`OwnedCapture::broadcast_in_place`] with per-call options.
    pub fn broadcast_in_place_with<B: DeviceTensorMut>(
        &mut self,
        root: usize,
        buffers: &mut [B],
        options: &BroadcastOptions,
    ) -> Result<()> {
        let spans = self.admit(
            buffers
                .iter()
                .enumerate()
                .map(|(r, b)| (r, b as &dyn DeviceTensor)),
        )?;
        self.queued(spans, |inner| {
            inner.broadcast_in_place_with(root, buffers, options)
        })
    }

    /// Captures [`Clique::broadcast_many`]: `outputs[rank][tensor]`.
    pub fn broadcast_many(
        &mut self,
        root: usize,
        inputs: &[&dyn DeviceTensor],
        outputs: &mut crate::clique::OutputLists<'_, '_>,
    ) -> Result<FusedReport> {
        self.broadcast_many_with(root, inputs, outputs, &BroadcastOptions::default())
    }

    /// Captures [`Clique::broadcast_many_with`].
    pub fn broadcast_many_with(
        &mut self,
        root: usize,
        inputs: &[&dyn DeviceTensor],
        outputs: &mut crate::clique::OutputLists<'_, '_>,
        options: &BroadcastOptions,
    ) -> Result<FusedReport> {
        let ins = inputs.iter().map(|t| (root, *t));
        let outs = outputs
            .iter()
            .enumerate()
            .flat_map(|(r, l)| l.iter().map(move |t| (r, &**t as &dyn DeviceTensor)));
        let spans = self.admit(ins.chain(outs))?;
        let report = self
            .inner
            .broadcast_many_with(root, inputs, outputs, options);
        // Kept even when the call failed: part of it may be in the graph (the capture then
        // fails as a whole, but the buffers stay counted until it has).
        self.used.extend(spans);
        let report = report?;
        Ok(report)
    }
}

/// A captured sequence of broadcasts that owns its buffers: one CUDA graph per GPU of a
/// clique, and `B`. Between replays, [`OwnedGraph::buffers_mut`] lends the buffers out, to
/// write an input or read an output on any stream; each launch orders the replay after that
/// work and before the work that follows, and refuses to run if a range a captured call uses
/// is no longer inside the buffers (a buffer was replaced by one elsewhere, or smaller).
///
/// ```no_run
/// let clique = gpucast::Clique::new(&[0, 1])?;
/// let input = clique.stream(0).alloc_zeros::<f32>(1 << 20).unwrap();
/// let outputs = clique.alloc_outputs::<f32>(1 << 20)?;
/// let mut graph = clique.capture_owned((input, outputs), |c, (input, outputs)| {
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
pub struct OwnedGraph<'c, B> {
    core: &'c Core,
    execs: Vec<GraphExec>,
    /// The ranges the captured calls use.
    used: Vec<Span>,
    buffers: B,
}

impl<B: GraphBuffers> OwnedGraph<'_, B> {
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
            let ranks = ranks_at(core, access::place_of(s));
            let Some(&first) = ranks.first() else {
                return Err(Error::InvalidArgument(
                    "a buffer of the graph is on no device (or context) of the clique".into(),
                ));
            };
            owned.push(span_of(core, first, &**t));
            buffers.extend(ranks.into_iter().map(|r| (r, s)));
        }
        // Checked before anything is queued on the clique's or the buffers' streams; the
        // buffers stay borrowed from here to the launch, so they are the ones checked.
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
        super::graph::replay(core, &self.execs, || buffers.iter().copied(), guards)
    }

    /// Uploads each graph to its device ahead of the first launch.
    pub fn upload(&self) -> Result<()> {
        self.core.engine.lock()?.upload_graphs(&self.execs)
    }
}

impl<B> OwnedGraph<'_, B> {
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
        let OwnedGraph { execs, buffers, .. } = self;
        drop(execs);
        buffers
    }
}

impl Clique {
    /// Captures, as [`Clique::capture`] does, the broadcasts that `f` queues, into a graph
    /// that owns `buffers` and lends them out between replays ([`OwnedGraph::buffers_mut`]):
    /// the safe form when an input is rewritten or an output read between replays. `f` gets
    /// the capture and the buffers; every buffer a captured call takes must lie inside them.
    pub fn capture_owned<'c, B, F>(&'c self, mut buffers: B, f: F) -> Result<OwnedGraph<'c, B>>
    where
        B: GraphBuffers,
        F: FnOnce(&mut OwnedCapture<'c>, &mut B) -> Result<()>,
    {
        let core = &self.core;
        let mut owned = Vec::new();
        let mut misplaced = false;
        buffers.visit(
            &mut |t| match ranks_at(core, access::place_of(t.stream())).first() {
                Some(&local) => owned.push(span_of(core, local, &*t)),
                None => misplaced = true,
            },
        );
        if misplaced {
            return Err(Error::InvalidArgument(
                "a buffer given to capture_owned is on no device (or context) of the clique".into(),
            ));
        }
        let mut cap = OwnedCapture {
            inner: UncheckedCapture::begin(core)?,
            core,
            owned,
            used: Vec::new(),
        };
        let body = f(&mut cap, &mut buffers);
        let execs = cap.inner.finish();
        body?;
        // The session's clique: the closure may have swapped `cap` with another clique's
        // capture (its calls, spans and all), and the graphs belong to the clique that
        // recorded them.
        Ok(OwnedGraph {
            core: cap.inner.core(),
            execs: execs?,
            used: cap.used,
            buffers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(ctx: usize, start: u64, len: usize) -> Span {
        Span { ctx, start, len }
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
