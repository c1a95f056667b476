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
}
