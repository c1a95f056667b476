//! The job token as a secret: proofs that a peer knows it (HMAC-SHA256 over fresh nonces, so a
//! captured proof is worth nothing on another connection), values sealed under a key derived
//! from it, random nonces and tokens, and the warning for a token that anyone can guess.
//!
//! The token itself never leaves the process: not in a frame, a log line or an error.

use std::sync::atomic::{AtomicBool, Ordering};

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use super::env::TokenSource;
use super::error::{RendezvousError, Result};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a connection nonce.
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 tag).
pub(crate) const PROOF_LEN: usize = 32;
/// Bytes a sealed value carries besides its plaintext: the 24-byte nonce and the 16-byte tag.
pub(crate) const SEAL_OVERHEAD: usize = 24 + 16;
/// A token shorter than this is treated as guessable.
const MIN_SECRET_LEN: usize = 16;

/// A nonce.
pub(crate) type Nonce = [u8; NONCE_LEN];
/// A proof.
pub(crate) type Proof = [u8; PROOF_LEN];

/// `N` bytes from the operating system's random source.
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| RendezvousError::NoRandomness {
        reason: e.to_string(),
    })?;
    Ok(bytes)
}

/// A fresh job token: 32 random bytes in hex (64 characters). Launchers that start the ranks of
/// a job themselves give every rank the same one in `GPUCAST_JOB_TOKEN`.
///
/// Errors: [`RendezvousError::NoRandomness`] if the operating system has no random source.
pub fn random_token() -> Result<String> {
    Ok(random::<32>()?.iter().map(|b| format!("{b:02x}")).collect())
}

/// The MAC of `label` and `parts` (each length-prefixed, so no two inputs share an encoding)
/// under `key`.
fn mac(key: &[u8], label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length: `new_from_slice` cannot fail for it.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    m.update(label);
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

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

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::Hello => b"gpucast rendezvous v2: hello",
            Purpose::Welcome => b"gpucast rendezvous v2: welcome",
            Purpose::Refusal => b"gpucast rendezvous v2: refusal",
        }
    }
}

/// One handshake: both nonces (the store's is fresh per connection, so a recorded proof does
/// not replay) and the rank and world size the HELLO claims.
pub(crate) struct Handshake<'a> {
    pub token: &'a str,
    pub server_nonce: &'a Nonce,
    pub client_nonce: &'a Nonce,
    pub rank: u32,
    pub world_size: u32,
}

impl Handshake<'_> {
    /// The MAC of `purpose` over this handshake and `extra` (a refusal's encoded error).
    fn mac(&self, purpose: Purpose, extra: &[u8]) -> HmacSha256 {
        mac(
            self.token.as_bytes(),
            purpose.label(),
            &[
                self.server_nonce,
                self.client_nonce,
                &self.rank.to_le_bytes(),
                &self.world_size.to_le_bytes(),
                extra,
            ],
        )
    }

    /// The proof of knowing the token for `purpose`, over `extra` too.
    pub(crate) fn prove(&self, purpose: Purpose, extra: &[u8]) -> Proof {
        self.mac(purpose, extra).finalize().into_bytes().into()
    }

    /// Whether `claimed` is that proof, compared in constant time.
    pub(crate) fn verify(&self, purpose: Purpose, extra: &[u8], claimed: &[u8]) -> bool {
        self.mac(purpose, extra).verify_slice(claimed).is_ok()
    }
}

/// Equality of two byte strings in time that depends on their lengths only.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// SHA-256 of the length-prefixed `parts`.
pub(crate) fn digest(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().into()
}

/// Seals and opens values with a key derived from the job token and a context (XChaCha20-Poly1305
/// with a random 24-byte nonce per value): without the token a value can be neither read nor
/// forged, and the associated data binds it to where it belongs.
pub(crate) struct Sealer {
    cipher: XChaCha20Poly1305,
}

impl Sealer {
    /// The sealer of `token` for `context` (e.g. the key prefix of one job in a shared store).
    pub(crate) fn new(token: &str, context: &[u8]) -> Sealer {
        let key: [u8; 32] = mac(
            token.as_bytes(),
            b"gpucast rendezvous v2: sealing key",
            &[context],
        )
        .finalize()
        .into_bytes()
        .into();
        Sealer {
            cipher: XChaCha20Poly1305::new(&key.into()),
        }
    }

    /// `plain`, sealed and bound to `aad`: nonce, then ciphertext and tag.
    pub(crate) fn seal(&self, aad: &[u8], plain: &[u8]) -> Result<Vec<u8>> {
        let nonce = random::<24>()?;
        let sealed = self
            .cipher
            .encrypt(XNonce::from_slice(&nonce), Payload { msg: plain, aad })
            .map_err(|_| RendezvousError::InvalidArgument {
                reason: format!("a value of {} bytes cannot be sealed", plain.len()),
            })?;
        let mut out = nonce.to_vec();
        out.extend(sealed);
        Ok(out)
    }

    /// The plaintext of `sealed` if it was sealed with this key and `aad`, else `None`.
    pub(crate) fn open(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < SEAL_OVERHEAD {
            return None;
        }
        let (nonce, body) = sealed.split_at(24);
        self.cipher
            .decrypt(XNonce::from_slice(nonce), Payload { msg: body, aad })
            .ok()
    }
}

/// Why `token` is no secret, if it is not.
pub(crate) fn weakness(token: &str, source: TokenSource) -> Option<&'static str> {
    if token.is_empty() {
        Some("no job token is set")
    } else if token.eq_ignore_ascii_case("none") {
        Some("the job token is \"none\" (torchrun's run id when --rdzv-id is not given)")
    } else if source == TokenSource::SlurmJobId {
        Some("the job token is Slurm's job id, which every user of the cluster can list")
    } else if source == TokenSource::TorchRunId {
        Some("the job token is torchrun's run id, which every user of the host sees in the process list")
    } else if token.len() < MIN_SECRET_LEN {
        Some("the job token has fewer than 16 characters")
    } else {
        None
    }
}

static WARNED: AtomicBool = AtomicBool::new(false);

/// Says once per process, on standard error and through `tracing`, that a rendezvous reachable
/// from other machines is protected by a guessable token, and how to set a real one.
pub(crate) fn warn_weak_token(reason: &str, exposure: &str) {
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    let text = format!(
        "{reason}, and {exposure}: any process that can reach it and finds out the token can \
         join the job. Give every rank the same secret, e.g. \
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
        let hs = |token, server_nonce, client_nonce, rank, world_size| Handshake {
            token,
            server_nonce,
            client_nonce,
            rank,
            world_size,
        };
        let p = hs("tok", &s, &c, 3, 8).prove(Purpose::Hello, b"");
        assert!(hs("tok", &s, &c, 3, 8).verify(Purpose::Hello, b"", &p));
        assert!(!hs("tok2", &s, &c, 3, 8).verify(Purpose::Hello, b"", &p));
        assert!(!hs("tok", &s, &c, 3, 8).verify(Purpose::Welcome, b"", &p));
        assert!(!hs("tok", &s, &c, 3, 8).verify(Purpose::Refusal, b"", &p));
        assert!(!hs("tok", &c, &s, 3, 8).verify(Purpose::Hello, b"", &p));
        assert!(!hs("tok", &s, &c, 4, 8).verify(Purpose::Hello, b"", &p));
        assert!(!hs("tok", &s, &c, 3, 9).verify(Purpose::Hello, b"", &p));
        assert!(!hs("tok", &s, &c, 3, 8).verify(Purpose::Hello, b"x", &p));
        assert!(!hs("tok", &s, &c, 3, 8).verify(Purpose::Hello, b"", &p[..31]));
        assert!(!hs("tok", &s, &c, 3, 8).verify(Purpose::Hello, b"", &[]));
        // A refusal's proof covers the error it proves.
        let r = hs("tok", &s, &c, 3, 8).prove(Purpose::Refusal, b"error 1");
        assert!(hs("tok", &s, &c, 3, 8).verify(Purpose::Refusal, b"error 1", &r));
        assert!(!hs("tok", &s, &c, 3, 8).verify(Purpose::Refusal, b"error 2", &r));
        // The token is not in the proof in any readable form.
        assert!(!p.windows(3).any(|w| w == b"tok"));
    }

    #[test]
    fn sealed_values_open_only_with_the_same_key_and_binding() {
        let a = Sealer::new("secret token of job a", b"/worker/attempt_0");
        let b = Sealer::new("secret token of job b", b"/worker/attempt_0");
        let other_place = Sealer::new("secret token of job a", b"/worker/attempt_1");
        let sealed = a.seal(b"round 3 rank 1", b"the nccl id").unwrap();
        assert_eq!(sealed.len(), b"the nccl id".len() + SEAL_OVERHEAD);
        assert!(!sealed.windows(7).any(|w| w == b"nccl id"));
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
        // Two seals of one value differ (fresh nonces).
        assert_ne!(a.seal(b"x", b"v").unwrap(), a.seal(b"x", b"v").unwrap());
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
