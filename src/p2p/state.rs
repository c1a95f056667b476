//! What an engine keeps of its P2P path, in one place: the path (or why it cannot run), its
//! availability as routes read it without the engine's lock, whether the capture in progress
//! holds a P2P step, and the generation a captured graph holds. The path closes only through
//! [`State::close`], which updates the availability with it: the two never disagree.

use std::sync::{Arc, Mutex};

use super::P2p;
use crate::error::{Error, Result};

/// Whether the P2P path can run, or why not: readable without the engine's lock.
#[derive(Debug)]
pub(crate) struct Status(Mutex<std::result::Result<(), Error>>);

impl Status {
    /// Runs `f` with whether the path can run (or why not), without copying the reason.
    pub(crate) fn with<R>(&self, f: impl FnOnce(std::result::Result<(), &Error>) -> R) -> R {
        f(self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|_| ()))
    }

    fn set(&self, status: std::result::Result<(), Error>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = status;
    }
}

/// The engine's P2P path (kept under the engine's lock).
pub(crate) struct State {
    path: std::result::Result<P2p, Error>,
    status: Arc<Status>,
    /// Bumped whenever the path closes: a graph captured before holds its addresses.
    gen: u64,
    /// The generation when the capture in progress queued its first P2P step, if it did.
    captured: Option<u64>,
}

impl State {
    /// The state of `path` (or the reason there is none), and its availability.
    pub(crate) fn new(path: std::result::Result<P2p, Error>) -> (State, Arc<Status>) {
        let status = Arc::new(Status(Mutex::new(
            path.as_ref().map(|_| ()).map_err(Clone::clone),
        )));
        let state = State {
            path,
            status: status.clone(),
            gen: 0,
            captured: None,
        };
        (state, status)
    }

    /// The path, or the error a forced P2P call returns.
    pub(crate) fn get(&mut self) -> Result<&mut P2p> {
        self.path.as_mut().map_err(|e| e.clone())
    }

    /// The path, where it can run.
    pub(crate) fn live(&self) -> Option<&P2p> {
        self.path.as_ref().ok()
    }

    /// The path, where it can run, to change it.
    pub(crate) fn live_mut(&mut self) -> Option<&mut P2p> {
        self.path.as_mut().ok()
    }

    /// The first timeout a kernel reported, if any (none where the path is closed).
    pub(crate) fn first_error(&self) -> Option<Error> {
        self.live().and_then(P2p::first_error)
    }

    /// Whether the path runs across processes.
    pub(crate) fn across_processes(&self) -> bool {
        self.live().is_some_and(P2p::across_processes)
    }

    /// Closes the path for good with `why`; its memory is dropped, or leaked (`leak`) where
    /// a reset may still write it.
    pub(crate) fn close(&mut self, why: Error, leak: bool) {
        self.status.set(Err(why.clone()));
        let old = std::mem::replace(&mut self.path, Err(why));
        self.gen += 1;
        if let (Ok(p2p), true) = (old, leak) {
            p2p.abandon();
        }
    }

    /// Runs `f` (a reset of the signal areas, the streams drained) on the path, if it can
    /// run: when `f` does not finish (`StreamsBusy`, a memset still pending), the path
    /// closes with `what` in the reason and its memory is leaked.
    pub(crate) fn reset_with(
        &mut self,
        what: &str,
        f: impl FnOnce(&P2p) -> Result<()>,
    ) -> Result<()> {
        let Some(p2p) = self.live() else {
            return Ok(());
        };
        let reset = f(p2p);
        if let Err(e @ Error::StreamsBusy { .. }) = &reset {
            let why =
                Error::P2pUnavailable(format!("the P2P path closed: {what} did not finish ({e})"));
            self.close(why, true);
        }
        reset
    }

    /// Notes a P2P step queued while `capturing`.
    pub(crate) fn note_step(&mut self, capturing: bool) {
        if capturing && self.captured.is_none() {
            self.captured = Some(self.gen);
        }
    }

    /// Ends the capture in progress: the generation its graph holds, if it holds a P2P step
    /// (the one of its first step: where the path closed during the capture, the graph holds
    /// addresses of the closed state and never launches).
    pub(crate) fn end_capture(&mut self) -> Option<u64> {
        self.captured.take()
    }

    /// Whether a graph that holds generation `gen` may still launch.
    pub(crate) fn holds_current(&self, gen: u64) -> bool {
        gen == self.gen
    }

    /// Lets go of the path when its engine is dropped: handed back to be freed where the
    /// streams are `idle`, leaked otherwise (a kernel may still use its memory).
    pub(crate) fn take_path(&mut self, idle: bool) -> Option<P2p> {
        let old = std::mem::replace(&mut self.path, Err(Error::P2pUnavailable("dropped".into())));
        if !idle {
            if let Ok(p2p) = old {
                p2p.leak();
            }
            return None;
        }
        old.ok()
    }
}
