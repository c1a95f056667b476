//! The broadcast family, written once per argument shape.
//!
//! Every receiver (a [`Clique`], a [`Communicator`](super::Communicator), a
//! [`Capture`](super::Capture) of either, and the [`WithOptions`] view of any of them) queues a
//! call through one hidden method of its own (`Queue`); the public methods are default methods
//! of one trait per argument shape, as rsmpi writes each collective once for every
//! communicator:
//!
//! - [`CliqueBroadcast`]: the process drives every rank of the call and passes every rank's
//!   buffers (`outputs[rank]`), a clique and its captures;
//! - [`RankBroadcast`]: the process is one rank and passes its own buffer, a communicator and
//!   its captures.
//!
//! Options are given one way: `receiver.with(&options)` is a receiver that carries them.

use super::{Clique, Core};
use crate::config::BroadcastOptions;
use crate::error::Result;
use crate::plan::FusedReport;
use crate::tensor::{DeviceTensor, DeviceTensorMut};
use sealed::Queue;

/// Broadcasts of a process that drives every rank of the call: each method takes one buffer
/// (or one list of buffers) per rank, in rank order. Implemented by [`super::Clique`], by the
/// [`super::Capture`] of a clique, and by their [`WithOptions`] views. Bring it into scope
/// with `use gpucast::prelude::*`.
///
/// Every call checks its arguments before anything is queued and runs asynchronously on the
/// ranks' streams (or is recorded into the graph, in a capture); every buffer may be dropped
/// or reused as soon as it returns (the crate docs, "Ordering"). `root` is a rank of the
/// clique (an index into [`super::Clique::ordinals`]), not a device ordinal.
pub trait CliqueBroadcast: Queue {
    /// Broadcasts `input` (on the root's GPU) into `outputs[rank]` on every rank, the root's
    /// own output included. `outputs` holds one buffer per rank, each of `input`'s element
    /// type and length; a zero-length broadcast does nothing.
    fn broadcast<I: DeviceTensor, O: DeviceTensorMut>(
        &self,
        root: usize,
        input: &I,
        outputs: &mut [O],
    ) -> Result<()> {
        let mut outs: Vec<&mut dyn DeviceTensorMut> = outputs
            .iter_mut()
            .map(|o| o as &mut dyn DeviceTensorMut)
            .collect();
        self.queue_one(root, Some(input), &mut outs, None)
    }

    /// In place: `buffers[root]` is the source and every other rank's buffer receives it. One
    /// buffer per rank, all of one type and length.
    fn broadcast_in_place<B: DeviceTensorMut>(&self, root: usize, buffers: &mut [B]) -> Result<()> {
        let mut bufs: Vec<&mut dyn DeviceTensorMut> = buffers
            .iter_mut()
            .map(|b| b as &mut dyn DeviceTensorMut)
            .collect();
        self.queue_one(root, None, &mut bufs, None)
    }

    /// Many tensors in one fused call: `inputs[t]` is tensor `t` on the root's GPU,
    /// `outputs[rank][t]` its destination on rank `rank` (the root's own included). Tensors may
    /// differ in element type and length; each tensor's outputs match its input.
    ///
    /// With [`crate::config::BroadcastPath::Auto`] each tensor takes the path a single broadcast of its
    /// size would take; P2P tensors are copied by one kernel launch per 120 tensors (no staging
    /// copy), NCCL tensors are broadcast in groups.
    fn broadcast_many<'a, 'b>(
        &self,
        root: usize,
        inputs: &[&dyn DeviceTensor],
        outputs: &mut [Vec<&'a mut (dyn DeviceTensorMut + 'b)>],
    ) -> Result<FusedReport> {
        self.queue_many(root, Some(inputs), outputs, None)
    }

    /// [`CliqueBroadcast::broadcast_many`] in place: `buffers[root][t]` is tensor `t`'s source;
    /// every other rank's `buffers[rank][t]` receives it.
    fn broadcast_many_in_place<'a, 'b>(
        &self,
        root: usize,
        buffers: &mut [Vec<&'a mut (dyn DeviceTensorMut + 'b)>],
    ) -> Result<FusedReport> {
        self.queue_many(root, None, buffers, None)
    }

    /// This receiver with per-call `options` (path, thresholds): every broadcast through the
    /// view uses them, as in `clique.with(&options).broadcast(0, &input, &mut outputs)`.
    fn with<'o>(&'o self, options: &'o BroadcastOptions) -> WithOptions<'o, Self>
    where
        Self: Sized,
    {
        WithOptions {
            inner: self,
            options,
        }
    }
}

/// Broadcasts of one rank of a job (one process per GPU): each rank passes its own buffer, and
/// only the root an input. Implemented by [`super::Communicator`], by the [`super::Capture`] of
/// a communicator, and by their [`WithOptions`] views. Every rank makes the same calls, in the
/// same order, with buffers of the same types and lengths (checked between the ranks of one
/// host: [`crate::error::Error::CallMismatch`]).
pub trait RankBroadcast: Queue {
    /// Out of place: the root passes `Some(input)` and receives a copy in `output` too; every
    /// other rank passes `None` and receives into `output`. (`None` on the root broadcasts its
    /// `output` in place.)
    fn broadcast<I: DeviceTensor, O: DeviceTensorMut>(
        &self,
        root: usize,
        input: Option<&I>,
        output: &mut O,
    ) -> Result<()> {
        let mut outs = [output as &mut dyn DeviceTensorMut];
        self.queue_one(root, input.map(|i| i as &dyn DeviceTensor), &mut outs, None)
    }

    /// In place, like `torch.distributed.broadcast`: rank `root`'s `buffer` into every other
    /// rank's `buffer`.
    fn broadcast_in_place<B: DeviceTensorMut>(&self, root: usize, buffer: &mut B) -> Result<()> {
        let mut bufs = [buffer as &mut dyn DeviceTensorMut];
        self.queue_one(root, None, &mut bufs, None)
    }

    /// Many tensors out of place in one call: the root passes `Some(inputs)` (tensor `t` is
    /// `inputs[t]`), every other rank `None`; every rank receives tensor `t` into `outputs[t]`.
    fn broadcast_many<'a, 'b>(
        &self,
        root: usize,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: Vec<&'a mut (dyn DeviceTensorMut + 'b)>,
    ) -> Result<FusedReport> {
        self.queue_many(root, inputs, &mut [outputs], None)
    }

    /// Many tensors in place in one call: `buffers[t]` is tensor `t` (the root's are the
    /// sources).
    fn broadcast_many_in_place<'a, 'b>(
        &self,
        root: usize,
        buffers: Vec<&'a mut (dyn DeviceTensorMut + 'b)>,
    ) -> Result<FusedReport> {
        self.queue_many(root, None, &mut [buffers], None)
    }

    /// This receiver with per-call `options` (see [`CliqueBroadcast::with`]).
    fn with<'o>(&'o self, options: &'o BroadcastOptions) -> WithOptions<'o, Self>
    where
        Self: Sized,
    {
        WithOptions {
            inner: self,
            options,
        }
    }
}

/// A receiver with per-call options: what [`CliqueBroadcast::with`] and
/// [`RankBroadcast::with`] return. It has the receiver's broadcast methods; in a chain
/// (`a.with(&x).with(&y)`) the last options given apply.
#[derive(Debug)]
pub struct WithOptions<'o, R> {
    inner: &'o R,
    options: &'o BroadcastOptions,
}

impl<R: Queue> Queue for WithOptions<'_, R> {
    fn queue_one(
        &self,
        root: usize,
        input: Option<&dyn DeviceTensor>,
        outputs: &mut [&mut dyn DeviceTensorMut],
        options: Option<&BroadcastOptions>,
    ) -> Result<()> {
        let options = options.unwrap_or(self.options);
        self.inner.queue_one(root, input, outputs, Some(options))
    }

    fn queue_many<'a, 'b>(
        &self,
        root: usize,
        inputs: Option<&[&dyn DeviceTensor]>,
        outputs: &mut [Vec<&'a mut (dyn DeviceTensorMut + 'b)>],
        options: Option<&BroadcastOptions>,
    ) -> Result<FusedReport> {
        let options = options.unwrap_or(self.options);
        self.inner.queue_many(root, inputs, outputs, Some(options))
    }
}

impl<R: CliqueBroadcast> CliqueBroadcast for WithOptions<'_, R> {}
impl<R: RankBroadcast> RankBroadcast for WithOptions<'_, R> {}

/// The one hidden door of every broadcast receiver: the public methods of
/// [`CliqueBroadcast`] and [`RankBroadcast`] are default methods over it.
pub(super) mod sealed {
    use crate::config::BroadcastOptions;
    use crate::error::Result;
    use crate::plan::FusedReport;
    use crate::tensor::{DeviceTensor, DeviceTensorMut};

    /// A receiver that queues its calls eagerly on a core of its own (a clique, a
    /// communicator): its [`Queue`] is the core's.
    pub trait Eager {
        /// The core whose ranks run the calls.
        fn core(&self) -> &super::Core;
    }

    impl<E: Eager> Queue for E {
        fn queue_one(
            &self,
            root: usize,
            input: Option<&dyn DeviceTensor>,
            outputs: &mut [&mut dyn DeviceTensorMut],
            options: Option<&BroadcastOptions>,
        ) -> Result<()> {
            self.core().broadcast(root, input, outputs, options)
        }

        fn queue_many<'a, 'b>(
            &self,
            root: usize,
            inputs: Option<&[&dyn DeviceTensor]>,
            outputs: &mut [Vec<&'a mut (dyn DeviceTensorMut + 'b)>],
            options: Option<&BroadcastOptions>,
        ) -> Result<FusedReport> {
            self.core().many(root, inputs, outputs, options)
        }
    }

    /// Queues one call: a single broadcast (`outputs[local rank]`) or a fused one
    /// (`outputs[local rank][tensor]`); `input`/`inputs` is `None` in place or where this
    /// process does not hold the root; `options` is `None` for the receiver's defaults.
    pub trait Queue {
        /// A single broadcast.
        fn queue_one(
            &self,
            root: usize,
            input: Option<&dyn DeviceTensor>,
            outputs: &mut [&mut dyn DeviceTensorMut],
            options: Option<&BroadcastOptions>,
        ) -> Result<()>;

        /// A fused broadcast of many tensors.
        fn queue_many<'a, 'b>(
            &self,
            root: usize,
            inputs: Option<&[&dyn DeviceTensor]>,
            outputs: &mut [Vec<&'a mut (dyn DeviceTensorMut + 'b)>],
            options: Option<&BroadcastOptions>,
        ) -> Result<FusedReport>;
    }
}

impl sealed::Eager for Clique {
    fn core(&self) -> &Core {
        &self.core
    }
}

impl CliqueBroadcast for Clique {}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::config::BroadcastPath;

    /// What a call passed: root, whether an input, how many outputs (lists), options.
    type Call = (usize, bool, usize, Option<BroadcastOptions>);

    /// A receiver that notes what each call passed.
    #[derive(Default)]
    struct Noted(RefCell<Vec<Call>>);

    impl Queue for Noted {
        fn queue_one(
            &self,
            root: usize,
            input: Option<&dyn DeviceTensor>,
            outputs: &mut [&mut dyn DeviceTensorMut],
            options: Option<&BroadcastOptions>,
        ) -> Result<()> {
            let call = (root, input.is_some(), outputs.len(), options.copied());
            self.0.borrow_mut().push(call);
            Ok(())
        }

        fn queue_many<'a, 'b>(
            &self,
            root: usize,
            inputs: Option<&[&dyn DeviceTensor]>,
            outputs: &mut [Vec<&'a mut (dyn DeviceTensorMut + 'b)>],
            options: Option<&BroadcastOptions>,
        ) -> Result<FusedReport> {
            let call = (root, inputs.is_some(), outputs.len(), options.copied());
            self.0.borrow_mut().push(call);
            Ok(FusedReport::default())
        }
    }

    impl CliqueBroadcast for Noted {}
    impl RankBroadcast for Noted {}

    #[test]
    fn every_method_reaches_the_one_queue_with_the_options_of_the_last_view() {
        let r = Noted::default();
        let nccl = BroadcastOptions::path(BroadcastPath::Nccl);
        let p2p = BroadcastOptions::path(BroadcastPath::P2p);
        CliqueBroadcast::broadcast_many_in_place(&r, 1, &mut [Vec::new(), Vec::new()]).unwrap();
        let view = CliqueBroadcast::with(&r, &nccl);
        CliqueBroadcast::broadcast_many(&view, 0, &[], &mut [Vec::new()]).unwrap();
        let last = CliqueBroadcast::with(&view, &p2p);
        CliqueBroadcast::broadcast_many_in_place(&last, 2, &mut []).unwrap();
        let rank = RankBroadcast::with(&r, &p2p);
        RankBroadcast::broadcast_many(&rank, 3, None, Vec::new()).unwrap();
        assert_eq!(
            *r.0.borrow(),
            vec![
                (1, false, 2, None),
                (0, true, 1, Some(nccl)),
                (2, false, 0, Some(p2p)),
                (3, false, 1, Some(p2p)),
            ]
        );
    }
}
