//! The job token as a secret: a key derived from it once per process (PBKDF2-HMAC-SHA256,
//! [`KDF_ROUNDS`] rounds), proofs that a peer knows that key (HMAC-SHA256 over fresh nonces, so
//! a captured proof is worth nothing on another connection), values sealed under a key derived
//! from it, random nonces and tokens, and the warning for a token that does not look random.
//!
//! The token itself never leaves the process: not in a message, a log line or an error.
//!
//! Why PBKDF2 and not a memory-hard function: one captured HELLO (or sealed value) lets anyone
//! test guesses of the token offline, each guess costing one derivation. A random token of 128
//! bits or more is out of reach whatever the derivation; for a weak one the derivation only
//! multiplies the cost of each guess ([`KDF_ROUNDS`] HMACs, ~2^17, instead of one: a
//! 2-million-word list takes hours of one core instead of a fraction of a second). scrypt or
//! Argon2 would also make guessing on GPUs costly, but would bring crates of their own for what
//! stays a delay: the defence is a random token, which gpucast warns about when it is missing.
//! PBKDF2 is written here on the HMAC-SHA256 the proofs use already. Its salt is a fixed label
//! (both sides must derive the key before either has proven anything), so a list of guesses
//! can be derived once and tried against many captures.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::PoisonError;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::env::TokenSource;
use super::error::{RendezvousError as E, Result};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a connection nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 tag).
pub(crate) const PROOF_LEN: usize = 32;
/// Bytes a sealed value carries besides the value: its 32-byte tag.
pub(crate) const SEAL_OVERHEAD: usize = 32;
/// PBKDF2 rounds of the key derivation (see the module's documentation).
pub(crate) const KDF_ROUNDS: u32 = 1 << 17;
/// Bits of randomness below which a token is called guessable.
const MIN_SECRET_BITS: f64 = 128.0;

/// A proof.
pub(crate) type Proof = [u8; PROOF_LEN];

/// `N` bytes from the operating system's random source.
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| E::NoRandomness(e.to_string()))?;
    Ok(bytes)
}

/// A fresh job token: 32 random bytes in hex (64 characters). Launchers that start the ranks of
/// a job themselves give every rank the same one in `GPUCAST_JOB_TOKEN`.
///
/// Errors: [`RendezvousError::NoRandomness`](crate::RendezvousError::NoRandomness) if the
/// operating system has no random source.
pub fn random_token() -> Result<String> {
    Ok(random::<32>()?.iter().map(|b| format!("{b:02x}")).collect())
}

/// The MAC of `label` and `parts` (each length-prefixed, so no two inputs share an encoding)
/// under `key` (with an empty key, a digest).
pub(crate) fn mac(key: &[u8], label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC takes keys of any length: `new_from_slice` cannot fail for it.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    m.update(label);
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// PBKDF2-HMAC-SHA256 of `password` and `salt` with `rounds` rounds: the first 32 bytes
/// (RFC 8018, section 5.2), each round's HMAC from the password's keyed state.
fn pbkdf2_sha256(password: &[u8], salt: &[u8], rounds: u32) -> [u8; 32] {
    let keyed = <HmacSha256 as Mac>::new_from_slice(password)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    let round = |parts: &[&[u8]]| -> [u8; 32] {
        let mut m = keyed.clone();
        parts.iter().for_each(|p| m.update(p));
        m.finalize().into_bytes().into()
    };
    let mut u = round(&[salt, &1u32.to_be_bytes()]);
    let mut out = u;
    for _ in 1..rounds {
        u = round(&[&u]);
        out.iter_mut().zip(u).for_each(|(o, x)| *o ^= x);
    }
    out
}

/// The key every proof and sealed value of a job is made with, derived from the job token
/// (never the token itself). Its `Debug` form shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(<not shown>)")
    }
}

/// Keys derived in this process, by a MAC of their token: the derivation is made costly
/// on purpose, and a process needs it once.
static KEYS: std::sync::Mutex<Vec<([u8; 32], Key)>> = std::sync::Mutex::new(Vec::new());

/// What a proof is for: the label makes a client's proof useless as the store's, and each
/// useless anywhere else.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Purpose {
    /// A client proves the token when it says hello.
    Hello,
    /// The store proves it back in its welcome.
    Welcome,
    /// The store proves that it refused this HELLO with the error it sends, so that whatever
    /// holds the port cannot end a rank with an error of its choosing.
    Refusal,
}

impl Key {
    /// The key of `token`: PBKDF2-HMAC-SHA256 with [`KDF_ROUNDS`] rounds, computed once per
    /// process and token.
    pub(crate) fn of(token: &str) -> Key {
        let id = mac(token.as_bytes(), b"gpucast rendezvous v3: key cache", &[]);
        let mut keys = KEYS.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, key)) = keys.iter().find(|(k, _)| same_secret(k, &id)) {
            return key.clone();
        }
        let salt = b"gpucast rendezvous v3: job token";
        let key = Key(pbkdf2_sha256(token.as_bytes(), salt, KDF_ROUNDS));
        if keys.len() >= 16 {
            keys.remove(0);
        }
        keys.push((id, key.clone()));
        key
    }

    /// The proof of knowing the token for `purpose` in one handshake: over `claim` (the
    /// store's fresh nonce, the client's, and the rank and world size the HELLO claims) and
    /// `extra` (a refusal's encoded error).
    pub(crate) fn prove(&self, purpose: Purpose, claim: &[&[u8]; 3], extra: &[u8]) -> Proof {
        // `gpucast rendezvous v4: hello`, `...: welcome` or `...: refusal`.
        let label = format!("gpucast rendezvous v4: {purpose:?}").to_ascii_lowercase();
        let [a, b, c] = *claim;
        mac(&self.0, label.as_bytes(), &[a, b, c, extra])
    }
}

/// Equality of two byte strings in time that depends on their lengths only.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// Seals values to where they belong: each carries HMAC-SHA256, under a key derived from the
/// job token and a context, of the value and of `aad` (the session, instance, round and rank it
/// is for). Without the token a value can be neither forged nor moved to another place or
/// session. Values are not hidden: what gpucast puts in torchrun's store (nonces, world sizes,
/// the NCCL id, which PyTorch itself writes there in the clear) is readable by whoever reaches
/// that store, and worth no cipher's crates.
pub(crate) struct Sealer([u8; 32]);

impl Sealer {
    /// The sealer of `key` for `context` (e.g. the key prefix of one job in a shared store).
    pub(crate) fn new(key: &Key, context: &[u8]) -> Sealer {
        Sealer(mac(&key.0, b"gpucast rendezvous v3: value key", &[context]))
    }

    /// The tag of `value` for `aad`.
    fn tag(&self, aad: &[u8], value: &[u8]) -> [u8; 32] {
        mac(&self.0, b"gpucast rendezvous v3: value", &[aad, value])
    }

    /// `value`, then its tag for `aad`.
    pub(crate) fn seal(&self, aad: &[u8], value: &[u8]) -> Vec<u8> {
        [value, &self.tag(aad, value)].concat()
    }

    /// The value of `sealed` if its tag is this key's for `aad` (compared in constant time),
    /// else `None`.
    pub(crate) fn open(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        let (value, tag) = sealed.split_at(sealed.len().checked_sub(SEAL_OVERHEAD)?);
        same_secret(&self.tag(aad, value), tag).then(|| value.to_vec())
    }
}

/// Why `token` is no secret, if it is not: empty, torchrun's run id or Slurm's job id (anyone
/// on the host or cluster can read them), or a string that does not look random: fewer than
/// 128 bits by its length and the kinds of characters in it, a repetition of a shorter string,
/// or too few distinct characters for its length.
pub(crate) fn weakness(token: &str, source: TokenSource) -> Option<&'static str> {
    let why = match source {
        _ if token.is_empty() => "no job token is set",
        _ if token.eq_ignore_ascii_case("none") => "the job token is \"none\" (torchrun's run id when --rdzv-id is not given)",
        TokenSource::SlurmJobId => "the job token is Slurm's job id, which every user of the cluster can list",
        TokenSource::TorchRunId => "the job token is torchrun's run id, which every user of the host sees in the process list",
        _ if !looks_random(token.as_bytes()) => "the job token does not look random (it needs at least 128 random bits, e.g. 32 hex digits)",
        _ => return None,
    };
    Some(why)
}

/// Whether `t` could hold 128 random bits: long enough for its alphabet, not a repetition,
/// and with as many distinct characters as a random string of its length and alphabet would
/// almost surely have. (Lengths and counts become floats for the estimate.)
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
fn looks_random(t: &[u8]) -> bool {
    let any = |f: fn(&u8) -> bool| t.iter().any(f);
    let hex = t.iter().all(u8::is_ascii_hexdigit)
        && !(any(u8::is_ascii_lowercase) && any(u8::is_ascii_uppercase));
    let alphabet: u32 = if t.iter().all(u8::is_ascii_digit) {
        10
    } else if hex {
        16
    } else {
        let other = |b: &u8| !b.is_ascii_alphanumeric() && !b.is_ascii_punctuation();
        let classes = [
            (any(u8::is_ascii_digit), 10),
            (any(u8::is_ascii_lowercase), 26),
            (any(u8::is_ascii_uppercase), 26),
            (any(u8::is_ascii_punctuation), 32),
            (any(other), 128),
        ];
        classes.iter().map(|&(p, n)| u32::from(p) * n).sum()
    };
    let a = f64::from(alphabet);
    let bits = t.len() as f64 * a.log2();
    let repeated = (1..=t.len() / 2).any(|p| t[p..] == t[..t.len() - p]);
    let distinct = (0..=u8::MAX).filter(|c| t.contains(c)).count();
    // A random string of n characters from an alphabet of a has about a(1 - (1 - 1/a)^n)
    // distinct ones; half of that is far below what chance gives.
    let expected = a * (1.0 - (1.0 - 1.0 / a).powi(t.len().min(1 << 20) as i32));
    let varied = distinct as f64 >= expected / 2.0;
    bits >= MIN_SECRET_BITS && !repeated && varied
}

static WARNED: AtomicBool = AtomicBool::new(false);

/// Says once per process, on standard error and through `tracing`, that the rendezvous is
/// protected by a guessable token (`reason`; `exposure` says who can reach it), and how to set
/// a real one.
pub(crate) fn warn_weak_token(reason: &str, exposure: &str) {
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    let text = format!(
        "{reason}, and {exposure}: any process that can reach it and finds out the token can \
         join the job, or guess the token from one captured exchange. Give every rank the \
         same random secret of at least 128 bits, e.g. \
         `export GPUCAST_JOB_TOKEN=$(openssl rand -hex 32)` before launching."
    );
    tracing::warn!("{text}");
    eprintln!("gpucast: warning: {text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_token_the_nonces_and_the_claim() {
        let (s, c) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let (tok, tok2) = (Key::of("tok"), Key::of("tok2"));
        let claim = |rank: u32, world: u32| [rank.to_le_bytes(), world.to_le_bytes()].concat();
        let p = tok.prove(Purpose::Hello, &[&s, &c, &claim(3, 8)], b"");
        let same = |q: Proof| same_secret(&p, &q);
        assert!(same(tok.prove(
            Purpose::Hello,
            &[&s, &c, &claim(3, 8)],
            b""
        )));
        assert!(!same(tok2.prove(
            Purpose::Hello,
            &[&s, &c, &claim(3, 8)],
            b""
        )));
        assert!(!same(tok.prove(
            Purpose::Welcome,
            &[&s, &c, &claim(3, 8)],
            b""
        )));
        assert!(!same(tok.prove(
            Purpose::Refusal,
            &[&s, &c, &claim(3, 8)],
            b""
        )));
        assert!(!same(tok.prove(
            Purpose::Hello,
            &[&c, &s, &claim(3, 8)],
            b""
        )));
        assert!(!same(tok.prove(
            Purpose::Hello,
            &[&s, &c, &claim(4, 8)],
            b""
        )));
        assert!(!same(tok.prove(
            Purpose::Hello,
            &[&s, &c, &claim(3, 9)],
            b""
        )));
        assert!(!same(tok.prove(
            Purpose::Hello,
            &[&s, &c, &claim(3, 8)],
            b"x"
        )));
        assert!(!same_secret(&p, &p[..31]));
        // The labels are the documented ones.
        for (purpose, label) in [
            (Purpose::Hello, &b"gpucast rendezvous v4: hello"[..]),
            (Purpose::Welcome, b"gpucast rendezvous v4: welcome"),
            (Purpose::Refusal, b"gpucast rendezvous v4: refusal"),
        ] {
            let parts: [&[u8]; 4] = [&s, &c, &claim(3, 8), b""];
            assert_eq!(
                tok.prove(purpose, &[&s, &c, &claim(3, 8)], b""),
                mac(&tok.0, label, &parts)
            );
        }
        // A refusal's proof covers the error it proves.
        let r = tok.prove(Purpose::Refusal, &[&s, &c, &claim(3, 8)], b"error 1");
        assert_ne!(
            r,
            tok.prove(Purpose::Refusal, &[&s, &c, &claim(3, 8)], b"error 2")
        );
        // The token is not in the proof in any readable form.
        assert!(!p.windows(3).any(|w| w == b"tok"));
    }

    #[test]
    fn sealed_values_open_only_with_the_same_key_and_binding() {
        let (ka, kb) = (
            Key::of("secret token of job a"),
            Key::of("secret token of job b"),
        );
        let a = Sealer::new(&ka, b"/worker/attempt_0");
        let b = Sealer::new(&kb, b"/worker/attempt_0");
        let other_place = Sealer::new(&ka, b"/worker/attempt_1");
        let sealed = a.seal(b"round 3 rank 1", b"the nccl id");
        assert_eq!(sealed.len(), b"the nccl id".len() + SEAL_OVERHEAD);
        assert_eq!(a.open(b"round 3 rank 1", &sealed).unwrap(), b"the nccl id");
        assert!(a.open(b"round 3 rank 2", &sealed).is_none());
        assert!(b.open(b"round 3 rank 1", &sealed).is_none());
        assert!(other_place.open(b"round 3 rank 1", &sealed).is_none());
        let mut flipped = sealed.clone();
        flipped[30] ^= 1;
        assert!(a.open(b"round 3 rank 1", &flipped).is_none());
        for cut in 0..sealed.len() {
            assert!(a.open(b"round 3 rank 1", &sealed[..cut]).is_none());
        }
        // The tag covers the boundary between value and binding.
        assert!(a.open(b"round 3 rank 1the", &sealed[3..]).is_none());
    }

    /// The derivation is PBKDF2-HMAC-SHA256 (vectors of RFC 7914 and Python's hashlib), and the
    /// key of a token is that derivation with its rounds, not one HMAC of the token.
    #[test]
    fn the_key_is_an_iterated_derivation_of_the_token() {
        assert_eq!(
            pbkdf2_sha256(b"passwd", b"salt", 1).to_vec(),
            hex("55ac046e56e3089fec1691c22544b605f94185216dde0465e68b9d57c20dacbc")
        );
        assert_eq!(
            pbkdf2_sha256(b"Password", b"NaCl", 80_000).to_vec(),
            hex("4ddcd8f60b98be21830cee5ef22701f9641a4418d04c0414aeff08876b34ab56")
        );
        // A password longer than SHA-256's block is hashed first (as HMAC does).
        assert_eq!(
            pbkdf2_sha256(&[b'p'; 100], b"salt", 3).to_vec(),
            hex("f598272d35e2ca276ac07694cf01636c4d643ad3075956477cfdd83eda46d9f6")
        );
        let key = Key::of("a job token");
        assert_eq!(
            key.0.to_vec(),
            hex("5b43687b14f80a20a76dea3a9ce5f9f2ede7562503fcc138ff2a3768a38f32a2")
        );
        assert_eq!(Key::of("a job token"), key, "the same key, from the cache");
        assert!(!format!("{key:?}").contains(&format!("{}", key.0[0])));
        // A HELLO's proof is no single HMAC keyed by the raw token: one capture must cost a
        // guesser a whole derivation per guess.
        let (sn, cn) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let parts: [&[u8]; 3] = [&sn, &cn, &[1, 0, 0, 0, 2, 0, 0, 0]];
        let proof = key.prove(Purpose::Hello, &parts, b"");
        for label in [
            &b"gpucast rendezvous v3: hello"[..],
            b"gpucast rendezvous v4: hello",
        ] {
            let raw: Proof = mac(b"a job token", label, &[&sn, &cn, parts[2], b""]);
            assert_ne!(proof, raw);
        }
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn tokens_that_do_not_look_random_are_named() {
        let weak = |t: &str| weakness(t, TokenSource::Explicit).is_some();
        for t in [
            "short",
            "blue-river-2024!",
            "0123456789abcdef0123",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "passwordpasswordpasswordpasswordpassword",
            "abababababababababababababababababababababababab",
            "00000000000000000000000000000000000000000000000000000001",
            "12345678901234567890123456789012345678", // 38 digits: 126 bits at most
        ] {
            assert!(weak(t), "{t:?} passed as random");
        }
        for t in [
            random_token().unwrap(),
            random_token().unwrap()[..32].to_owned(), // 128 bits in hex
            random_token().unwrap().to_uppercase(),
            "Zq3v_9rT-pL2xW8mK4nB7yH1cF6dJ0sA".to_owned(), // 32 of base64url
            "3f2a9c1e-7b4d-4e8a-9c6f-1d2e3f4a5b6c".to_owned(), // a UUID
        ] {
            assert!(!weak(&t), "{t:?} called weak");
        }
    }

    #[test]
    fn guessable_tokens_are_named() {
        assert!(weakness("", TokenSource::Unset).is_some());
        assert!(weakness("None", TokenSource::TorchRunId).is_some());
        assert!(weakness("123456", TokenSource::SlurmJobId).is_some());
        assert!(weakness("0123456789abcdef0123", TokenSource::SlurmJobId).is_some());
        assert!(weakness("short", TokenSource::Explicit).is_some());
        assert!(weakness(&random_token().unwrap(), TokenSource::Explicit).is_none());
        assert!(weakness(&random_token().unwrap(), TokenSource::TorchRunId).is_some());
        let t = random_token().unwrap();
        assert_eq!(t.len(), 64);
        assert!(t.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(t, random_token().unwrap());
    }

    #[test]
    fn constant_time_equality() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"ab"));
    }
}
