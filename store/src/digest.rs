//! A chunk's address: BLAKE3-256 of its bytes, written as 64 lowercase hex digits.

use std::fmt;
use std::io::Read;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::StoreError;

/// BLAKE3-256 of a chunk's bytes. Collision-resistant, so equal digests mean equal bytes
/// and a chunk written once can be shared by every checkpoint that holds those bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

/// Above this many bytes, one buffer is hashed on several threads (BLAKE3's tree mode gives
/// the same digest either way).
const PARALLEL_FROM: usize = 1 << 20;

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        let mut h = blake3::Hasher::new();
        if bytes.len() >= PARALLEL_FROM {
            h.update_rayon(bytes);
        } else {
            h.update(bytes);
        }
        Digest(*h.finalize().as_bytes())
    }

    /// The digest of everything `r` yields, and how many bytes that was.
    pub fn of_reader(mut r: impl Read) -> std::io::Result<(Self, u64)> {
        let mut h = blake3::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut len = 0u64;
        loop {
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            h.update(&buf[..n]);
            len += n as u64;
        }
        Ok((Digest(*h.finalize().as_bytes()), len))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

impl FromStr for Digest {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, StoreError> {
        let bad = || StoreError::BadDigest(s.to_string());
        if s.len() != 64 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Digest(out))
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_matches_blake3() {
        let d = Digest::of(b"abc");
        assert_eq!(d.to_hex(), blake3::hash(b"abc").to_hex().as_str());
        assert_eq!(d.to_hex().parse::<Digest>().unwrap(), d);
        assert!("ABC".parse::<Digest>().is_err());
        assert!(d.to_hex().to_uppercase().parse::<Digest>().is_err());
    }

    #[test]
    fn parallel_and_streamed_digests_agree() {
        let big: Vec<u8> = (0..3 * PARALLEL_FROM + 7).map(|i| (i * 31) as u8).collect();
        let (streamed, len) = Digest::of_reader(&big[..]).unwrap();
        assert_eq!(len, big.len() as u64);
        assert_eq!(Digest::of(&big), streamed);
    }
}
