//! What a clique and a one-rank-per-process communicator share: an engine over the ranks this
//! process drives, where those ranks sit in the job, and the broadcasts themselves.

use std::borrow::Cow;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, SyncOnDrop};

use super::access::{self, Foreign};
use super::args::{self, Place, Ranks};
use crate::config::{Available, BroadcastOptions, BroadcastPath, CallSettings, Route, MAX_GPUS};
use crate::dtype::Element;
use crate::engine::{Engine, Item};
use crate::error::{Error, Result};
use crate::plan::{self, FusedReport, Step};
use crate::ranks::{JobRank, Local, Root};
use crate::tensor::{DeviceTensor, DeviceTensorMut};

use super::RawBroadcast;

/// The engine of the local ranks and their place in the job.
pub struct Core {
    pub(crate) engine: Engine,
    /// Device and context of each local rank.
    pub(crate) places: Vec<Place>,
    /// The job rank of each local rank.
    pub(crate) globals: Vec<JobRank>,
    /// Ranks in the job.
    pub(crate) world: usize,
    /// Whether the copy-engine route can run, or the error a forced call returns.
    pub(crate) copy_engine: std::result::Result<(), Error>,
    /// The same inside a capture ([`Engine::copy_engine_in_graph`] too).
    pub(crate) copy_engine_in_graph: std::result::Result<(), Error>,
    /// Whether NCCL runs here (off where a device holds several ranks).
    pub(crate) nccl_on: bool,
    /// See [`Placement::calls`].
    pub(crate) calls: Option<super::calls::Log>,
    /// Whether this process drives every rank of the job. Then P2P tensors of one call may
    /// share a launch and the P2P kernel may chain; across processes peers read the root's
    /// tensors from a staging buffer, one at a time.
    pub(crate) one_process: bool,
}

/// Where a `Core`'s local ranks sit in the job, and what can run there: what a front (a
/// `Clique` or a `Communicator`) finds out while it sets up, before the one way of building a
/// `Core` ([`Core::new`]).
pub(crate) struct Placement {
    /// The job rank of each local rank.
    pub(crate) globals: Vec<JobRank>,
    /// Ranks in the job.
    pub(crate) world: usize,
    /// Whether the copy-engine route can run, or the error a forced call returns.
    pub(crate) copy_engine: std::result::Result<(), Error>,
    /// Whether NCCL runs here.
    pub(crate) nccl_on: bool,
    /// The log that checks this rank's calls against its peers' on the host (across
    /// processes; a clique checks all its ranks' buffers in one call instead).
    pub(crate) calls: Option<super::calls::Log>,
}

impl Core {
    /// The core of `engine`'s local ranks, placed in the job by `job`.
    pub(crate) fn new(engine: Engine, job: Placement) -> Core {
        let places = (0..engine.len())
            .map(|r| access::place_of(engine.stream(r)))
            .collect();
        let copy_engine_in_graph = job
            .copy_engine
            .clone()
            .and_then(|()| engine.copy_engine_in_graph());
        Core {
            one_process: job.globals.len() == job.world,
            copy_engine_in_graph,
            engine,
            places,
            globals: job.globals,
            world: job.world,
            copy_engine: job.copy_engine,
            nccl_on: job.nccl_on,
            calls: job.calls,
        }
    }

    pub(crate) fn ranks(&self) -> Ranks<'_> {
        Ranks {
            places: &self.places,
            globals: &self.globals,
            world: self.world,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.places.len()
    }

    pub(crate) fn stream(&self, local: usize) -> &std::sync::Arc<CudaStream> {
        self.engine.stream(local)
    }

    pub(crate) fn path(&self) -> BroadcastPath {
        self.engine.settings().path
    }

    /// `Ok` if the P2P kernel can run now, otherwise the error a forced P2P call returns.
    pub(crate) fn p2p_available(&self) -> Result<()> {
        self.engine.p2p_status()
    }

    /// Runs `f` with which routes can run here now, eager or inside a capture (`in_graph`).
    fn with_available<R>(&self, in_graph: bool, f: impl FnOnce(Available<'_>) -> R) -> R {
        let copy_engine = if in_graph {
            &self.copy_engine_in_graph
        } else {
            &self.copy_engine
        };
        // The status's lock is held while `f` chooses (pure work): a path that cannot run
        // costs no copy of its reason on every call.
        self.engine.with_p2p_status(|p2p| {
            f(Available {
                p2p,
                copy_engine: copy_engine.as_ref().map(|_| ()),
                nccl: self.nccl_on,
                p2p_chain: self.one_process,
            })
        })
    }

    /// What a call with `options` runs with, eager or queued inside a capture (`in_graph`: the
    /// graph thresholds apply): resolved once per call, for every route it plans.
    pub(crate) fn call_settings(&self, options: &BroadcastOptions, in_graph: bool) -> CallSettings {
        self.engine.settings().for_call(options, in_graph)
    }

    /// The route of one eager broadcast of `bytes` bytes with `options`.
    pub(crate) fn route(&self, bytes: usize, options: &BroadcastOptions) -> Result<Route> {
        self.route_of(bytes, &self.call_settings(options, false))
    }

    /// The route of one broadcast of `bytes` bytes of a call that runs with `call`.
    pub(crate) fn route_of(&self, bytes: usize, call: &CallSettings) -> Result<Route> {
        self.with_available(call.in_graph, |available| {
            crate::config::choose(call.path, bytes, available, &call.thresholds)
        })
    }

    /// `step`, planned before the engine's lock was taken, or planned again if it takes the
    /// P2P path and that path closed meanwhile (another thread's call found it broken): `Auto`
    /// then takes another path, a call forced onto P2P gets the closed path's error, before
    /// anything is queued.
    fn replan_single(&self, step: Step, bytes: usize, call: &CallSettings) -> Result<Step> {
        if step.is_p2p() && self.p2p_available().is_err() {
            Ok(self.single_step(bytes, call)?.unwrap_or(step))
        } else {
            Ok(step)
        }
    }

    /// The stream a buffer of local rank `local` on `stream` is guarded on: the rank's own
    /// stream, borrowed, where it is that one (the common case: no reference count to touch);
    /// otherwise a clone, which the guards borrow while the buffers are borrowed mutably.
    fn stream_for<'a>(
        &'a self,
        local: usize,
        stream: &Arc<CudaStream>,
    ) -> Cow<'a, Arc<CudaStream>> {
        match self.stream(local) {
            own if Arc::ptr_eq(own, stream) => Cow::Borrowed(own),
            _ => Cow::Owned(stream.clone()),
        }
    }

    /// The launch step of a single broadcast, `None` for nothing to do.
    fn single_step(&self, bytes: usize, call: &CallSettings) -> Result<Option<Step>> {
        Ok(plan::single(0, self.route_of(bytes, call)?))
    }

    /// The launch plan of tensors of `bytes[i]` bytes of a call that runs with `call`.
    pub(crate) fn plan(&self, bytes: &[usize], call: &CallSettings) -> Result<Vec<Step>> {
        self.with_available(call.in_graph, |available| {
            plan::plan(
                bytes,
                call.path,
                available,
                &call.thresholds,
                self.world,
                self.one_process,
            )
        })
    }

    /// One broadcast: `input` is the root's source when the root is a local rank and the call
    /// is out of place, `None` in place (the root's entry of `outputs` is the source) or on a
    /// process without the root; `outputs` holds one buffer per local rank; `options` is
    /// `None` for the defaults.
    pub(crate) fn broadcast(
        &self,
        root: usize,
        input: Option<&dyn DeviceTensor>,
        outputs: &mut [&mut dyn DeviceTensorMut],
        options: Option<&BroadcastOptions>,
    ) -> Result<()> {
        let call = self.call_settings(options.unwrap_or(&BroadcastOptions::default()), false);
        let root = self.ranks().root(root);
        let input_info = input.map(access::info_of_dyn);
        let checked = access::with_infos(outputs, |infos| {
            args::check_broadcast(&self.ranks(), root, input_info, infos, None)
        })
        .and_then(|shape| Ok((self.route_of(shape.bytes, &call)?, shape)));
        let (route, shape) = self.failed_call_posted(checked)?;
        self.post_call(root.job, [(shape.bytes, shape.dtype, route)])?;
        let Some(step) = plan::single(0, route) else {
            return Ok(());
        };
        let mut engine = self.engine.lock()?;
        let step = self.replan_single(step, shape.bytes, &call)?;
        // Validated: an input only where the root is local, one output per local rank.
        let in_stream = input
            .zip(root.local)
            .map(|(i, Local(l))| self.stream_for(l, i.stream()));
        let mut out_streams: [Option<Cow<'_, Arc<CudaStream>>>; MAX_GPUS] = Default::default();
        for ((local, o), slot) in outputs.iter().enumerate().zip(&mut out_streams) {
            *slot = Some(self.stream_for(local, o.stream()));
        }
        let buffers = || {
            let input = (root.local).and_then(|Local(l)| in_stream.as_deref().map(|s| (l, s)));
            let outputs = out_streams.iter().map_while(Option::as_deref).enumerate();
            input.into_iter().chain(outputs)
        };
        let n = self.len();
        let (count, dtype) = (shape.count, shape.dtype);
        let (in_stream, out_streams) = (&in_stream, &out_streams);
        let guards = move || {
            // Moved out of the closure: the guards borrow the outputs for the whole call.
            let outputs = outputs;
            let read = match (input, in_stream) {
                (Some(i), Some(s)) => Some(i.read_ptr(s)),
                _ => None,
            };
            let mut dsts = [0u64; MAX_GPUS];
            let mut writes: [Option<SyncOnDrop<'_>>; MAX_GPUS] = Default::default();
            let streams = out_streams.iter().map_while(Option::as_deref);
            for (local, (out, s)) in outputs.iter_mut().zip(streams).enumerate() {
                let (ptr, w) = out.write_ptr(s);
                dsts[local] = ptr;
                writes[local] = Some(w);
            }
            let src = match (&read, root.local) {
                (Some((ptr, _)), _) => *ptr,
                (None, Some(Local(local))) => dsts[local],
                (None, None) => 0,
            };
            let item = Item::new(src, &dsts[..n], count, dtype);
            (item, read, writes)
        };
        // SAFETY: validation proved every buffer is on its rank's device and context and
        // `count` long; the borrows keep them alive until this returns, and the ordering
        // (`access::ordered`: foreign streams and the guards, dropped after the work is queued)
        // keeps them alive for the queued work, whether the work returns, fails or panics
        // halfway (`Foreign::around` orders the foreign streams after whatever was queued
        // before the guards record, during the unwinding too). In place, the root's buffer is
        // both source and destination, which every path handles.
        access::ordered(&mut engine, buffers, guards, |e, (item, _, _)| unsafe {
            e.run(
                root,
                std::slice::from_ref(item),
                std::slice::from_ref(&step),
            )
        })
    }

    /// See [`super::Clique::broadcast_raw`].
    ///
    /// # Safety
    /// As for `Clique::broadcast_raw`.
    pub(crate) unsafe fn broadcast_raw(
        &self,
        b: &RawBroadcast<'_>,
        options: &BroadcastOptions,
    ) -> Result<()> {
        let n = self.len();
        if b.root >= self.world {
            return Err(Error::RootOutOfRange {
                root: b.root,
                size: self.world,
            });
        }
        let root = self.ranks().root(b.root);
        for (what, got) in [("destinations", b.dsts.len()), ("streams", b.streams.len())] {
            if got != n {
                return Err(Error::OutputCount {
                    what,
                    expected: n,
                    got,
                });
            }
        }
        let bytes = b
            .count
            .checked_mul(b.dtype.size())
            .filter(|&x| isize::try_from(x).is_ok())
            .ok_or_else(|| Error::TooLarge {
                what: "raw broadcast".into(),
                elements: b.count,
                element_size: b.dtype.size(),
            })?;
        for (local, &s) in b.streams.iter().enumerate() {
            // SAFETY: the caller guarantees a live stream.
            let ctx = unsafe { crate::driver::stream::context(s) }.map_err(Error::cuda(
                format!("reading the context of stream {local}"),
            ))?;
            if ctx as usize != self.places[local].ctx {
                return Err(Error::ForeignContext {
                    what: format!("stream {local}"),
                    rank: self.globals[local].0,
                    ordinal: self.places[local].ordinal,
                });
            }
        }
        let call = self.call_settings(options, false);
        let Some(step) = self.single_step(bytes, &call)? else {
            return Ok(());
        };
        let mut engine = self.engine.lock()?;
        let step = self.replan_single(step, bytes, &call)?;
        let mut foreign = Foreign::default();
        for (local, &s) in b.streams.iter().enumerate() {
            // SAFETY: the caller guarantees live streams until the broadcast is queued (this
            // function's contract), their contexts were checked above, and `foreign` is
            // dropped before this returns.
            unsafe { foreign.note_raw(local, s, self.stream(local)) };
        }
        let item = Item::new(b.src, b.dsts, b.count, b.dtype);
        // SAFETY: per this function's contract.
        foreign.around(&mut engine, |e| unsafe {
            e.run(root, &[item], std::slice::from_ref(&step))
        })
    }

    /// A fused call; see [`crate::clique::CliqueBroadcast::broadcast_many`]. `inputs` is `None` in place or on a
    /// process without the root.
    pub(crate) fn many(
        &self,
        root: usize,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &mut [Vec<&mut (dyn DeviceTensorMut + '_)>],
        options: Option<&BroadcastOptions>,
    ) -> Result<FusedReport> {
        let call = self.call_settings(options.unwrap_or(&BroadcastOptions::default()), false);
        let root = self.ranks().root(root);
        let shapes = self.failed_call_posted(self.check_lists(root, inputs, outputs, false))?;
        let bytes: Vec<usize> = shapes.iter().map(|s| s.bytes).collect();
        if self.calls.is_some() {
            let routes = shapes
                .iter()
                .map(|s| Ok((s.bytes, s.dtype, self.route_of(s.bytes, &call)?)))
                .collect::<Result<Vec<_>>>();
            self.post_call(root.job, self.failed_call_posted(routes)?)?;
        }
        let mut steps = self.plan(&bytes, &call)?;
        let mut report = FusedReport::of(&steps, &bytes);
        if steps.is_empty() {
            return Ok(report);
        }
        let mut engine = self.engine.lock()?;
        // As in `replan_single`: the P2P path may have closed while this call waited.
        if steps.iter().any(Step::is_p2p) && self.p2p_available().is_err() {
            steps = self.plan(&bytes, &call)?;
            report = FusedReport::of(&steps, &bytes);
        }
        let in_streams: Vec<_> = inputs
            .unwrap_or_default()
            .iter()
            .map(|t| t.stream().clone())
            .collect();
        let out_streams: Vec<Vec<_>> = outputs
            .iter()
            .map(|l| l.iter().map(|t| t.stream().clone()).collect())
            .collect();
        let buffers = || {
            let inputs = (root.local)
                .into_iter()
                .flat_map(|Local(l)| in_streams.iter().map(move |s| (l, s)));
            let outputs = out_streams
                .iter()
                .enumerate()
                .flat_map(|(local, list)| list.iter().map(move |s| (local, s)));
            inputs.chain(outputs)
        };
        let count = shapes.len();
        let n = self.len();
        let (in_streams, out_streams, shapes) = (&in_streams, &out_streams, &shapes);
        let guards = move || {
            // Moved out of the closure: the guards borrow the outputs for the whole call.
            let outputs = outputs;
            let mut srcs = vec![0u64; count];
            let mut reads = Vec::with_capacity(in_streams.len());
            for (t, (input, s)) in inputs
                .unwrap_or_default()
                .iter()
                .zip(in_streams)
                .enumerate()
            {
                let (ptr, g) = input.read_ptr(s);
                srcs[t] = ptr;
                reads.push(g);
            }
            let mut dsts = vec![[0u64; MAX_GPUS]; count];
            let mut writes = Vec::with_capacity(count * n);
            for (local, (list, streams)) in outputs.iter_mut().zip(out_streams).enumerate() {
                for (t, (out, s)) in list.iter_mut().zip(streams).enumerate() {
                    let (ptr, g) = out.write_ptr(s);
                    dsts[t][local] = ptr;
                    writes.push(g);
                }
            }
            let items: Vec<Item> = (0..count)
                .map(|t| Item {
                    src: match (inputs.is_some(), root.local) {
                        (true, _) => srcs[t],
                        (false, Some(Local(local))) => dsts[t][local],
                        (false, None) => 0,
                    },
                    dsts: dsts[t],
                    count: shapes[t].count,
                    dtype: shapes[t].dtype,
                })
                .collect();
            (items, reads, writes)
        };
        // SAFETY: validated against the ranks; the borrows and the ordering (`access::ordered`,
        // which also runs when the work fails or panics halfway) keep every buffer alive and
        // ordered for the queued work.
        access::ordered(&mut engine, buffers, guards, |e, (items, _, _)| unsafe {
            e.run(root, items, &steps)
        })?;
        Ok(report)
    }

    /// The shapes of a fused call's tensors, after checking the lists against the ranks
    /// (`single`: one tensor of a single-broadcast call, named as such in errors).
    pub(crate) fn check_lists(
        &self,
        root: Root,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &[Vec<&mut (dyn DeviceTensorMut + '_)>],
        single: bool,
    ) -> Result<Vec<args::Shape>> {
        let in_infos: Option<Vec<_>> =
            inputs.map(|i| i.iter().map(|t| access::info_of_dyn(*t)).collect());
        let out_infos: Vec<Vec<_>> = outputs
            .iter()
            .map(|l| l.iter().map(|t| access::info_of_dyn(&**t)).collect())
            .collect();
        args::check_many(&self.ranks(), root, in_infos.as_deref(), &out_infos, single)
    }

    /// Blocks until every broadcast queued so far has finished on every local GPU.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let done = self.engine.lock().and_then(|mut e| e.synchronize());
        // A call that differed from a peer's explains a failure better than its timeout. After
        // a failure the peers' cards are read as they are (a dead peer never posts); after
        // success the peers get up to the timeout to post this rank's calls.
        let within = match done {
            Ok(()) => self.engine.settings().timeouts.wait,
            Err(_) => std::time::Duration::ZERO,
        };
        match self.calls.as_ref().map(|log| log.check(within)) {
            Some(Err(mismatch)) => Err(mismatch),
            _ => done,
        }
    }

    /// `checked`, a call's own checks; when they failed, the call still takes its number in
    /// the log (a card that matches no peer's), so that the peers, which queued it, get
    /// [`Error::CallMismatch`] and this rank's later calls keep their numbers.
    fn failed_call_posted<T>(&self, checked: Result<T>) -> Result<T> {
        if checked.is_err() {
            self.post_failed_call();
        }
        checked
    }

    /// Posts the card of a call that failed on this rank before it reached the core (see
    /// [`Core::failed_call_posted`]).
    pub(crate) fn post_failed_call(&self) {
        if let Some(log) = &self.calls {
            let _ = log.post(super::calls::Card::failed());
        }
    }

    /// Calls posted to the log so far (0 without a log).
    pub(crate) fn calls_posted(&self) -> u64 {
        self.calls.as_ref().map_or(0, super::calls::Log::posted)
    }

    /// Posts a call's card to the log (across processes): [`Error::CallMismatch`], before
    /// anything is queued, when a peer's card of the same call differs.
    fn post_call(
        &self,
        root: JobRank,
        tensors: impl IntoIterator<Item = (usize, crate::dtype::DType, Route)>,
    ) -> Result<()> {
        match &self.calls {
            Some(log) => log.post(super::calls::Card::of(root.0, tensors)),
            None => Ok(()),
        }
    }

    pub(crate) fn wait_for(&self, streams: &[&CudaStream]) -> Result<()> {
        self.check_streams(streams)?;
        let mut engine = self.engine.lock()?;
        for (local, s) in streams.iter().enumerate() {
            if s.cu_stream() != self.stream(local).cu_stream() {
                // SAFETY: `s` is borrowed, so live, and `check_streams` checked that it is a
                // stream of this rank's context.
                unsafe { engine.stream_waits_for(local, s.cu_stream()) }?;
            }
        }
        Ok(())
    }

    pub(crate) fn record(&self) -> Result<Vec<CudaEvent>> {
        let _engine = self.engine.lock()?;
        (0..self.len())
            .map(|local| {
                self.stream(local)
                    .record_event(None)
                    .map_err(Error::cuda(format!(
                        "recording an event on rank {}",
                        self.globals[local].0
                    )))
            })
            .collect()
    }

    fn check_streams(&self, streams: &[&CudaStream]) -> Result<()> {
        if streams.len() != self.len() {
            return Err(Error::OutputCount {
                what: "streams",
                expected: self.len(),
                got: streams.len(),
            });
        }
        for (local, s) in streams.iter().enumerate() {
            args::check_place(
                || format!("stream {local}"),
                self.globals[local].0,
                self.places[local],
                access::place_of(s),
            )?;
        }
        Ok(())
    }

    pub(crate) fn alloc_outputs<T: Element>(&self, len: usize) -> Result<Vec<CudaSlice<T>>> {
        (0..self.len())
            .map(|local| {
                self.stream(local)
                    .alloc_zeros::<T>(len)
                    .map_err(Error::cuda(format!(
                        "allocating an output on rank {}",
                        self.globals[local].0
                    )))
            })
            .collect()
    }
}
