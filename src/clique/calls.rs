//! The call log of a job's ranks on one host: every rank must make the same calls, with the
//! same lengths, types, root and paths; one that does not would otherwise leave its peers
//! waiting on flags that never come (a timeout) or, worse, reading a message of another size.
//!
//! Each rank posts a card of every call (its root, tensor count, bytes, and a digest of each
//! tensor's length, type and route) into a ring of its own in host memory that its peers on
//! the host have mapped read-only (a sealed `memfd`, handed over once at initialisation like
//! the P2P path's descriptors), then reads its peers' cards of the same call number. Posting
//! and reading are ordered by sequentially consistent fences on both sides, so of two ranks
//! that post call `k` at the same time at least one sees the other's card: a call that differs
//! is caught, before its GPU work is queued, by whichever rank posts it second; the first rank
//! finds it at its next call or at `synchronize`, whose error then names the difference instead
//! of a bare timeout. A peer's card not yet posted is checked again later; a peer more than
//! [`SLOTS`] calls ahead has overwritten its card and that call goes unchecked. Posting costs a
//! few atomic operations per peer: no message, no wait.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::config::Route;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::p2p::ipc;
use gpucast_rendezvous::Exchange;

/// Cards each rank keeps: a peer this many calls behind or ahead is not checked.
pub(crate) const SLOTS: usize = 1024;
/// Words of one slot: the sequence word, then the card.
const WORDS: usize = 4;
/// Bytes of one rank's ring.
const RING_BYTES: usize = SLOTS * WORDS * 8;

/// What every rank of one call must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Card {
    root: u32,
    tensors: u32,
    bytes: u64,
    /// FNV-1a over each tensor's byte length, element type and route.
    digest: u64,
}

fn route_code(route: Route) -> u64 {
    match route {
        Route::Empty => 0,
        Route::Nccl => 1,
        Route::P2pPacket => 2,
        Route::P2pPull => 3,
        Route::P2pChain => 4,
        Route::CopyEngine => 5,
    }
}

fn dtype_code(dtype: DType) -> u64 {
    DType::ALL
        .iter()
        .position(|&d| d == dtype)
        .unwrap_or(usize::MAX) as u64
}

impl Card {
    /// The card of a call from `root` of tensors of `(bytes, type, route)`.
    pub(crate) fn of(
        root: usize,
        tensors: impl IntoIterator<Item = (usize, DType, Route)>,
    ) -> Card {
        let mut digest: u64 = 0xcbf2_9ce4_8422_2325;
        let (mut count, mut total) = (0u32, 0u64);
        for (bytes, dtype, route) in tensors {
            count = count.saturating_add(1);
            total = total.saturating_add(bytes as u64);
            for word in [bytes as u64, dtype_code(dtype), route_code(route)] {
                for b in word.to_le_bytes() {
                    digest = (digest ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                }
            }
        }
        Card {
            root: u32::try_from(root).unwrap_or(u32::MAX),
            tensors: count,
            bytes: total,
            digest,
        }
    }

    /// The card of a call that failed its own checks on this rank (it matches no call that
    /// passed them, and a failed call on every rank matches).
    pub(crate) fn failed() -> Card {
        Card {
            root: u32::MAX,
            tensors: 0,
            bytes: 0,
            digest: 0,
        }
    }

    fn words(self) -> [u64; 3] {
        [
            u64::from(self.root) | (u64::from(self.tensors) << 32),
            self.bytes,
            self.digest,
        ]
    }

    fn from_words(w: [u64; 3]) -> Card {
        Card {
            root: (w[0] & 0xffff_ffff) as u32,
            tensors: (w[0] >> 32) as u32,
            bytes: w[1],
            digest: w[2],
        }
    }

    /// The card in words, for an error.
    fn describe(&self) -> String {
        if *self == Card::failed() {
            return "a call that failed its own checks (an argument error there)".into();
        }
        format!(
            "{} tensor{} of {} bytes in all from root {}",
            self.tensors,
            if self.tensors == 1 { "" } else { "s" },
            self.bytes,
            self.root
        )
    }
}

/// What a peer's ring holds for one call.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Card(Card),
    /// Not posted yet (or being written).
    NotYet,
    /// Overwritten by a later call: the peer is [`SLOTS`] calls ahead.
    Gone,
}

/// One rank's ring of cards: `SLOTS` slots of `WORDS` words.
struct Ring {
    words: *const AtomicU64,
    /// The mapping that holds `words` (none for a test's ring in heap memory).
    _mapping: Option<Mapping>,
    /// A test's heap memory holding `words`.
    #[cfg(test)]
    _heap: Option<Box<[AtomicU64]>>,
}

// SAFETY: `words` points into memory that lives as long as the ring (its own mapping; a test's
// view of another ring lives within that ring's test), accessed only through atomics.
unsafe impl Send for Ring {}
// SAFETY: as for `Send`: every access is atomic.
unsafe impl Sync for Ring {}

impl Ring {
    #[cfg(test)]
    fn heap() -> Ring {
        let words: Box<[AtomicU64]> = (0..SLOTS * WORDS).map(|_| AtomicU64::new(0)).collect();
        Ring {
            words: words.as_ptr(),
            _mapping: None,
            _heap: Some(words),
        }
    }

    fn mapped(m: Mapping) -> Ring {
        Ring {
            words: m.ptr.cast::<AtomicU64>(),
            _mapping: Some(m),
            #[cfg(test)]
            _heap: None,
        }
    }

    fn slot(&self, call: u64) -> &[AtomicU64] {
        let first = usize::try_from(call % SLOTS as u64).expect("below SLOTS") * WORDS;
        // SAFETY: `first + WORDS <= SLOTS * WORDS` words live as long as `self`, aligned (a
        // page-aligned mapping or a boxed slice of AtomicU64). A peer's ring is mapped
        // read-only: it is only read, with relaxed loads (`read`).
        unsafe { std::slice::from_raw_parts(self.words.add(first), WORDS) }
    }

    /// Writes the card of `call` (only the owner writes its ring).
    fn write(&self, call: u64, card: Card) {
        let slot = self.slot(call);
        let seq = call.wrapping_mul(2);
        slot[0].store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        for (w, v) in slot[1..].iter().zip(card.words()) {
            w.store(v, Ordering::Relaxed);
        }
        slot[0].store(seq.wrapping_add(2), Ordering::Release);
    }

    /// Reads the card of `call`, if its slot holds it whole.
    fn read(&self, call: u64) -> Seen {
        let slot = self.slot(call);
        let want = call.wrapping_mul(2).wrapping_add(2);
        // Relaxed loads and fences only: a peer's ring is mapped read-only.
        let s1 = slot[0].load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if s1 < want {
            return Seen::NotYet;
        }
        if s1 > want {
            return Seen::Gone;
        }
        let w = [
            slot[1].load(Ordering::Relaxed),
            slot[2].load(Ordering::Relaxed),
            slot[3].load(Ordering::Relaxed),
        ];
        fence(Ordering::Acquire);
        if slot[0].load(Ordering::Relaxed) != s1 {
            return Seen::Gone;
        }
        Seen::Card(Card::from_words(w))
    }
}

/// A shared mapping of a ring's memfd (unmapped on drop).
struct Mapping {
    ptr: *mut libc::c_void,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` is a live mapping of RING_BYTES made by `map`, unmapped only here.
        unsafe { libc::munmap(self.ptr, RING_BYTES) };
    }
}

fn os_error(during: &str) -> Error {
    Error::InvalidSetting {
        name: "call log",
        reason: format!("{during}: {}", std::io::Error::last_os_error()),
    }
}

/// Maps `fd` (RING_BYTES long), writable or read-only.
fn map(fd: &OwnedFd, writable: bool) -> Result<Mapping> {
    let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
    // SAFETY: a fresh shared mapping of RING_BYTES of a file checked to be that long and
    // sealed against shrinking (`check_peer_fd`, or created so here): no access faults.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            RING_BYTES,
            prot,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(os_error("mapping a call log"));
    }
    Ok(Mapping { ptr })
}

/// A fresh ring file: RING_BYTES of zeros, sealed so that nobody can shrink or grow it (its
/// owner seals it against further writable mappings once it has its own).
fn create_fd() -> Result<OwnedFd> {
    // SAFETY: a C string literal and valid flags; the result is checked.
    let raw = unsafe {
        libc::memfd_create(
            c"gpucast-calls".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(os_error("creating a call log"));
    }
    // SAFETY: `raw` is a descriptor just created and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain calls on an owned descriptor; results checked.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), RING_BYTES as libc::off_t) } != 0 {
        return Err(os_error("sizing a call log"));
    }
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(os_error("sealing a call log"));
    }
    Ok(fd)
}

/// A peer's ring file is exactly RING_BYTES and sealed against shrinking (else a peer could
/// truncate it and make every read here fault).
fn check_peer_fd(fd: &OwnedFd) -> Result<()> {
    // SAFETY: an owned descriptor; the result is checked.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    let size = nix::sys::stat::fstat(std::os::fd::AsFd::as_fd(fd))
        .map(|s| s.st_size)
        .unwrap_or(-1);
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 || size != RING_BYTES as i64 {
        return Err(Error::InvalidSetting {
            name: "call log",
            reason: format!("a peer's call log is not a sealed {RING_BYTES}-byte file"),
        });
    }
    Ok(())
}

/// Calls posted whose card some peer had not posted yet.
struct State {
    next: u64,
    unchecked: VecDeque<(u64, Card, Vec<usize>)>,
}

/// This rank's log and its view of its peers'.
pub(crate) struct Log {
    own: Ring,
    peers: Vec<(usize, Ring)>,
    state: Mutex<State>,
}

impl Log {
    fn new(own: Ring, peers: Vec<(usize, Ring)>) -> Log {
        Log {
            own,
            peers,
            state: Mutex::new(State {
                next: 0,
                unchecked: VecDeque::new(),
            }),
        }
    }

    /// Posts the card of this rank's next call and checks it, and the earlier calls not yet
    /// checked, against the peers' cards: [`Error::CallMismatch`] when a peer's differs (the
    /// call is then not to be queued).
    pub(crate) fn post(&self, card: Card) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let call = st.next;
        st.next += 1;
        self.own.write(call, card);
        fence(Ordering::SeqCst);
        if card == Card::failed() {
            // This rank reported its own error; the peers compare against this card. Nothing
            // to check here, now or later (it differs from every call that passed).
            return Ok(());
        }
        let earlier = Self::recheck(&self.peers, &mut st);
        let mut left = Vec::new();
        for (peer, ring) in &self.peers {
            match ring.read(call) {
                Seen::Card(theirs) if theirs != card => {
                    return Err(mismatch(call, *peer, theirs, card))
                }
                Seen::NotYet => left.push(*peer),
                Seen::Card(_) | Seen::Gone => {}
            }
        }
        earlier?;
        if !left.is_empty() {
            if st.unchecked.len() >= SLOTS {
                st.unchecked.pop_front();
            }
            st.unchecked.push_back((call, card, left));
        }
        Ok(())
    }

    /// Number of calls posted so far.
    pub(crate) fn posted(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).next
    }

    /// Checks the calls posted earlier whose peers' cards were not there yet, waiting until
    /// every peer has posted them or `within` has passed (then the peers are late, which is
    /// no error: their calls are checked later).
    pub(crate) fn check(&self, within: std::time::Duration) -> Result<()> {
        let start = Instant::now();
        let mut backoff = crate::wait::Backoff::new();
        loop {
            {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                fence(Ordering::SeqCst);
                Self::recheck(&self.peers, &mut st)?;
                if st.unchecked.is_empty() || start.elapsed() >= within {
                    return Ok(());
                }
            }
            backoff.pause();
        }
    }

    fn recheck(peers: &[(usize, Ring)], st: &mut State) -> Result<()> {
        let mut found = None;
        st.unchecked.retain_mut(|(call, card, left)| {
            left.retain(|&peer| {
                let ring = &peers.iter().find(|(p, _)| *p == peer).expect("a peer").1;
                match ring.read(*call) {
                    Seen::NotYet => true,
                    Seen::Gone => false,
                    Seen::Card(theirs) => {
                        if theirs != *card && found.is_none() {
                            found = Some(mismatch(*call, peer, theirs, *card));
                        }
                        false
                    }
                }
            });
            !left.is_empty()
        });
        found.map_or(Ok(()), Err)
    }
}

fn mismatch(call: u64, rank: usize, theirs: Card, mine: Card) -> Error {
    let (t, m) = (theirs.describe(), mine.describe());
    let (theirs, mine) = if t == m {
        (format!("{t} (other lengths, types or paths per tensor)"), m)
    } else {
        (t, m)
    };
    Error::CallMismatch {
        call,
        rank,
        theirs,
        mine,
    }
}

/// Sets up the log of this rank among `world` ranks of one host: each rank's ring file is
/// handed to every peer (as the P2P path's descriptors are), within `deadline`. Every rank
/// calls this alike (one round of `exchange`); a rank whose log could not be set up checks
/// nothing, and its peers check nothing against it.
pub(crate) fn setup(exchange: &dyn Exchange, deadline: Instant) -> Result<Option<Log>> {
    let (rank, world) = (exchange.rank(), exchange.world_size());
    let local = (|| -> Result<_> {
        let fd = create_fd()?;
        let own = Ring::mapped(map(&fd, true)?);
        // Only this mapping may write the ring: peers get the file, not the right to write it.
        // SAFETY: a plain call on an owned descriptor; the result is checked.
        let future = unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL,
            )
        };
        if future != 0 {
            return Err(os_error("sealing a call log against writes"));
        }
        let server = ipc::Server::bind()?;
        Ok((fd, own, server))
    })();
    let card = match &local {
        Ok((_, _, server)) => server.card().encode(),
        Err(e) => {
            tracing::warn!("gpucast: no call log on this rank ({e}); calls are not checked");
            Vec::new()
        }
    };
    let cards = exchange.all_gather(&card)?;
    let Ok((fd, own, server)) = local else {
        return Ok(None);
    };
    if cards.iter().any(Vec::is_empty) {
        return Ok(None);
    }
    let header = u32::try_from(rank).unwrap_or(u32::MAX).to_le_bytes();
    let mut peers = Vec::new();
    let served = std::thread::scope(|scope| {
        let served =
            scope.spawn(|| server.serve(&header, std::slice::from_ref(&fd), world - 1, deadline));
        for (peer, c) in cards.iter().enumerate() {
            if peer == rank {
                continue;
            }
            let got = ipc::Card::decode(c)
                .and_then(|card| ipc::fetch(&card, 1, deadline))
                .and_then(|(head, mut fds)| {
                    if head != u32::try_from(peer).unwrap_or(u32::MAX).to_le_bytes() {
                        return Err(Error::InvalidSetting {
                            name: "call log",
                            reason: format!("the socket of rank {peer} answered for another"),
                        });
                    }
                    let fd = fds.pop().expect("one descriptor");
                    check_peer_fd(&fd)?;
                    Ok(Ring::mapped(map(&fd, false)?))
                });
            match got {
                Ok(ring) => peers.push((peer, ring)),
                Err(e) => tracing::warn!("gpucast: rank {peer}'s calls are not checked: {e}"),
            }
        }
        served.join()
    });
    if !matches!(served, Ok(Ok(()))) {
        tracing::warn!("gpucast: not every peer took this rank's call log");
    }
    Ok(Some(Log::new(own, peers)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(root: usize, sizes: &[usize]) -> Card {
        Card::of(root, sizes.iter().map(|&b| (b, DType::F32, Route::P2pPull)))
    }

    /// Two ranks whose rings are heap memory, each seeing the other's (a view without memory
    /// of its own: both logs live to the end of the test).
    fn pair() -> (Log, Log) {
        let (a, b) = (Ring::heap(), Ring::heap());
        let view = |r: &Ring| Ring {
            words: r.words,
            _mapping: None,
            _heap: None,
        };
        let (va, vb) = (view(&a), view(&b));
        (Log::new(a, vec![(1, vb)]), Log::new(b, vec![(0, va)]))
    }

    #[test]
    fn cards_differ_in_whatever_the_ranks_must_agree_on() {
        let base = card(0, &[4096, 16]);
        assert_eq!(base, card(0, &[4096, 16]));
        assert_ne!(base, card(1, &[4096, 16]));
        assert_ne!(base, card(0, &[16, 4096]));
        assert_ne!(base, card(0, &[4096]));
        let other_type = Card::of(
            0,
            [
                (4096, DType::I32, Route::P2pPull),
                (16, DType::F32, Route::P2pPull),
            ],
        );
        assert_ne!(base, other_type);
        let other_route = Card::of(
            0,
            [
                (4096, DType::F32, Route::Nccl),
                (16, DType::F32, Route::P2pPull),
            ],
        );
        assert_ne!(base, other_route);
        assert_eq!(Card::from_words(base.words()), base);
    }

    #[test]
    fn the_rank_that_posts_second_refuses_a_call_that_differs() {
        let (a, b) = pair();
        a.post(card(0, &[4096])).unwrap();
        b.post(card(0, &[4096])).unwrap();
        a.post(card(0, &[4096])).unwrap();
        match b.post(card(0, &[8192])) {
            Err(Error::CallMismatch {
                call,
                rank,
                theirs,
                mine,
            }) => {
                assert_eq!((call, rank), (1, 0));
                assert!(
                    theirs.contains("4096 bytes") && mine.contains("8192 bytes"),
                    "{theirs} / {mine}"
                );
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        // The first rank hears of it at its next check.
        assert!(matches!(
            a.check(std::time::Duration::ZERO),
            Err(Error::CallMismatch {
                call: 1,
                rank: 1,
                ..
            })
        ));
        // Reported once.
        assert!(a.check(std::time::Duration::ZERO).is_ok());
    }

    #[test]
    fn a_call_that_failed_its_checks_keeps_its_number_and_tells_the_peers() {
        let (a, b) = pair();
        a.post(card(0, &[64])).unwrap();
        let _ = b.post(Card::failed());
        match a.check(std::time::Duration::ZERO) {
            Err(Error::CallMismatch {
                call: 0, theirs, ..
            }) => {
                assert!(theirs.contains("failed its own checks"), "{theirs}")
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        // Both go on in step, whichever posted first.
        a.post(card(0, &[8])).unwrap();
        b.post(card(0, &[8])).unwrap();
        assert!(a.check(std::time::Duration::ZERO).is_ok());
        let _ = b.post(Card::failed());
        assert!(a.post(card(0, &[9])).is_err());
        a.post(card(0, &[10])).unwrap();
        b.post(card(0, &[10])).unwrap();
        assert!(b.check(std::time::Duration::ZERO).is_ok());
        // A failure on every rank matches.
        a.post(Card::failed()).unwrap();
        b.post(Card::failed()).unwrap();
    }

    #[test]
    fn a_peer_behind_is_checked_when_it_catches_up_and_one_far_ahead_is_not() {
        let (a, b) = pair();
        for _ in 0..10 {
            a.post(card(0, &[64])).unwrap();
        }
        for _ in 0..9 {
            b.post(card(0, &[64])).unwrap();
        }
        assert!(b.post(card(0, &[65])).is_err());
        // A rank SLOTS calls ahead has overwritten the card: nothing to compare, no error.
        let (c, d) = pair();
        for _ in 0..=SLOTS {
            c.post(card(0, &[1])).unwrap();
        }
        assert!(d.post(card(0, &[2])).is_ok());
        assert_eq!(c.own.read(0), Seen::Gone);
    }

    #[test]
    fn ranks_posting_at_once_never_both_miss_a_difference() {
        for round in 0..200 {
            let (a, b) = pair();
            let (ra, rb) = std::thread::scope(|s| {
                let ta = s.spawn(|| a.post(card(0, &[1])));
                let tb = s.spawn(|| b.post(card(0, &[2])));
                (ta.join().unwrap(), tb.join().unwrap())
            });
            let caught = ra.is_err()
                || rb.is_err()
                || a.check(std::time::Duration::ZERO).is_err()
                || b.check(std::time::Duration::ZERO).is_err();
            assert!(caught, "round {round}");
        }
    }

    #[test]
    fn ring_files_are_sealed_and_sized_and_others_are_refused() {
        let fd = create_fd().unwrap();
        check_peer_fd(&fd).unwrap();
        let own = Ring::mapped(map(&fd, true).unwrap());
        let peer_view = Ring::mapped(map(&fd, false).unwrap());
        own.write(3, card(0, &[5]));
        assert_eq!(peer_view.read(3), Seen::Card(card(0, &[5])));
        // Once sealed against writes, nobody maps it writable again.
        // SAFETY: a plain call on an owned descriptor; the result is checked.
        let sealed =
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_FUTURE_WRITE) };
        assert_eq!(sealed, 0);
        assert!(map(&fd, true).is_err());
        assert!(map(&fd, false).is_ok());
        // SAFETY: shrinking must fail on a sealed file; the call is checked.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 8) }, 0);
        let plain = std::fs::File::from(create_unsealed());
        assert!(check_peer_fd(&OwnedFd::from(plain)).is_err());
    }

    /// Every round's contributions, by rank, and the barrier that ends a round.
    type Board = std::sync::Arc<(Mutex<Vec<Vec<Vec<u8>>>>, std::sync::Barrier)>;

    /// An all-gather among threads of this process.
    struct Threads {
        rank: usize,
        world: usize,
        board: Board,
    }

    impl Exchange for Threads {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.world
        }
        fn all_gather(
            &self,
            mine: &[u8],
        ) -> std::result::Result<Vec<Vec<u8>>, gpucast_rendezvous::RendezvousError> {
            let (board, barrier) = &*self.board;
            let round = {
                let mut b = board.lock().unwrap();
                let round = b
                    .iter()
                    .position(|r| r[self.rank].is_empty() && r.len() == self.world);
                let round = match round {
                    Some(r) if b[r].iter().any(|c| !c.is_empty()) => r,
                    _ => {
                        b.push(vec![Vec::new(); self.world]);
                        b.len() - 1
                    }
                };
                b[round][self.rank] = mine.to_vec();
                round
            };
            barrier.wait();
            let out = board.lock().unwrap()[round].clone();
            barrier.wait();
            Ok(out)
        }
    }

    #[test]
    fn ranks_set_up_their_logs_through_the_exchange_and_catch_a_difference() {
        let world = 3;
        let board: Board =
            std::sync::Arc::new((Mutex::new(Vec::new()), std::sync::Barrier::new(world)));
        let deadline = Instant::now() + std::time::Duration::from_secs(20);
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let x = Threads {
                        rank,
                        world,
                        board: board.clone(),
                    };
                    s.spawn(move || -> Result<()> {
                        let log = setup(&x, deadline)?.expect("a log");
                        assert_eq!(log.peers.len(), world - 1, "rank {rank} maps every peer");
                        log.post(card(0, &[64]))?;
                        x.all_gather(&[]).unwrap();
                        let size = if rank == 2 { 128 } else { 64 };
                        let posted = log.post(card(0, &[size]));
                        x.all_gather(&[]).unwrap();
                        posted.and(log.check(std::time::Duration::from_secs(5)))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, r) in results.iter().enumerate() {
            assert!(
                matches!(r, Err(Error::CallMismatch { call: 1, .. })),
                "rank {rank}: {r:?}"
            );
        }
    }

    fn create_unsealed() -> OwnedFd {
        // SAFETY: as in `create_fd`.
        let raw = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: just created.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain call on an owned descriptor.
        let sized = unsafe { libc::ftruncate(fd.as_raw_fd(), RING_BYTES as libc::off_t) };
        assert_eq!(sized, 0);
        fd
    }
}
