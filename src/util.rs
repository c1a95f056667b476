//! Small helpers the P2P path and the communicators share: far deadlines, random bytes,
//! constant-time comparison, and a throttle for log lines that strangers can provoke.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `timeout` from now, or far in the future when that is beyond what an `Instant` holds (a
/// caller may pass `Duration::MAX` for "no limit").
pub(crate) fn later(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// `N` bytes from the operating system's random source.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N], getrandom::Error> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)?;
    Ok(bytes)
}

/// Equality of two byte strings in time that depends on their lengths only.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// Lets the first few of a kind of event be logged, then one in 1024, so that strangers who
/// make the same mistake (or attack) many times cannot flood the log.
#[derive(Default)]
pub(crate) struct Throttle(AtomicU64);

impl Throttle {
    /// A throttle that has seen nothing yet.
    pub(crate) const fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// Whether this occurrence is to be logged, and how many came before it.
    pub(crate) fn allow(&self) -> Option<u64> {
        let n = self.0.fetch_add(1, Ordering::Relaxed);
        (n < 8 || n.is_multiple_of(1024)).then_some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_throttle_lets_the_first_few_through_then_one_in_1024() {
        let t = Throttle::new();
        let allowed = (0..5000).filter(|_| t.allow().is_some()).count();
        assert_eq!(allowed, 8 + 4, "0..8, then 1024, 2048, 3072, 4096");
    }

    #[test]
    fn far_deadlines_do_not_overflow() {
        let far = later(Duration::MAX);
        assert!(far > Instant::now() + Duration::from_secs(3600 * 24 * 365));
        let near = later(Duration::from_millis(5));
        assert!(near <= Instant::now() + Duration::from_millis(5));
    }

    #[test]
    fn random_bytes_differ_and_equality_is_exact() {
        assert_ne!(random_bytes::<16>().unwrap(), random_bytes::<16>().unwrap());
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"ab"));
    }
}
