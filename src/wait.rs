//! Polling waits: spin briefly (most waits end within microseconds), then sleep with a growing
//! pause, so that a long wait costs no CPU and a short one no latency.

use std::time::Duration;

/// The pause between two polls.
pub(crate) struct Backoff {
    pause: Duration,
}

impl Backoff {
    /// Longest pause: the delay a long wait may add after its condition holds.
    pub(crate) const MAX: Duration = Duration::from_millis(1);
    /// Below this pause the thread yields instead of sleeping.
    const SPIN: Duration = Duration::from_micros(64);

    pub(crate) fn new() -> Backoff {
        Backoff {
            pause: Duration::from_micros(1),
        }
    }

    /// Waits before the next poll.
    pub(crate) fn pause(&mut self) {
        if self.pause < Self::SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.pause);
        }
        self.pause = (self.pause * 2).min(Self::MAX);
    }
}

/// Polls `done` with a [`Backoff`] until it holds or `limit` has passed; whether it held.
/// Where `done` holds at once (an uncontended lock, say), the clock is never read: a clock
/// read can cost a system call in a virtual machine, on every call.
pub(crate) fn until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    if done() {
        return true;
    }
    let start = std::time::Instant::now();
    let mut backoff = Backoff::new();
    loop {
        if done() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        backoff.pause();
    }
}

/// Runs `work` on a thread of its own named `name` and waits for it at most `limit`; whether it
/// ended (finished or panicked) within it. Past the limit it goes on in the background (its
/// results are dropped with it). Where no thread can be started, `work` runs on the calling
/// thread.
///
/// For releases that can wait on work that is not ours: freeing device memory (`cuMemFree`)
/// waits for every stream of the device, the caller's unrelated ones included.
pub(crate) fn detached_within(
    limit: Duration,
    name: &str,
    work: impl FnOnce() + Send + 'static,
) -> bool {
    let (done, finished) = std::sync::mpsc::sync_channel::<()>(1);
    let work = std::sync::Arc::new(std::sync::Mutex::new(Some(work)));
    let run = {
        let work = std::sync::Arc::clone(&work);
        move || {
            let job = work.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(job) = job {
                job();
            }
            // The receiver may be gone (the wait ended): nothing to tell then.
            let _ = done.try_send(());
        }
    };
    match std::thread::Builder::new().name(name.into()).spawn(run) {
        // A panic of `work` ends its thread without a word: over too, not in the background.
        Ok(_) => !matches!(
            finished.recv_timeout(limit),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        ),
        Err(_) => {
            // No thread: the work, still here, runs now.
            let job = work.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(job) = job {
                job();
            }
            true
        }
    }
}

/// Whole milliseconds of `d`, saturating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_grow_to_the_cap() {
        let mut b = Backoff::new();
        for _ in 0..20 {
            b.pause();
        }
        assert_eq!(b.pause, Backoff::MAX);
    }

    #[test]
    fn detached_work_is_waited_for_within_its_limit_only() {
        let (tx, rx) = std::sync::mpsc::channel();
        assert!(detached_within(
            Duration::from_secs(10),
            "quick",
            move || {
                tx.send(1).unwrap();
            }
        ));
        assert_eq!(rx.try_recv(), Ok(1), "done when the wait returned");

        let (tx, rx) = std::sync::mpsc::channel();
        let start = std::time::Instant::now();
        let finished = detached_within(Duration::from_millis(50), "slow", move || {
            std::thread::sleep(Duration::from_millis(500));
            tx.send(2).unwrap();
        });
        assert!(!finished);
        assert!(
            start.elapsed() < Duration::from_millis(400),
            "waited past its limit"
        );
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)),
            Ok(2),
            "the work goes on in the background"
        );
    }
}
