//! "gh1", the chunk hash computed on the GPU (`hook/kernels/gpuhash.cu`), and its CPU
//! reference, which must give the same bits.
//!
//! Why another hash: BLAKE3 runs on the CPU after the chunk crossed PCIe, so a checkpoint
//! of unchanged memory still moves all of it and the hashing caps copy-out near the CPU's
//! speed. gh1 runs where the data is (HBM bandwidth, milliseconds for tens of GB), before
//! any copy: all-zero chunks and chunks the parent image already stores never leave the
//! GPU, and the CPU only CRCs what it writes. It is not cryptographic: a 128-bit digest
//! of two independent 64-bit sums; two different chunks collide with a chance of about
//! 2^-128 for data nobody crafts against it (GPU memory of one's own workload), and the
//! CRC32C of every stored chunk still guards the bytes on disk.
//!
//! Definition, for a chunk of `len` bytes (`len` a multiple of 8) read as little-endian
//! u64 words: segments of [`SEGMENT_WORDS`] words, each hashed by [`LANES`] lanes; lane
//! `t` of segment `s` runs over words `t, t + LANES, …` of the segment:
//! `a = rotl(a + w·P2, 31)·P1`, `b = rotl(b ^ w·P4, 27)·P3 + P5`, from
//! `a = (t+1)·P1`, `b = (t+1)·P2 ^ P5`. Each lane adds `fmix(a ^ s·P3)` to `A` and
//! `fmix(b + s·P4)` to `B` (wrapping); `O` is the OR of all words. The digest is
//! `fmix(A ^ len·P1) ‖ fmix(B ^ rotl(len·P2, 29))` (little-endian), zero iff `O == 0`.
//! The GPU computes `A`, `B`, `O` with one thread block per segment; sums and OR do not
//! depend on the order the blocks finish in.

use std::fmt;

use serde::{Deserialize, Serialize};

/// u64 words per segment (64 KiB): one GPU thread block each.
pub const SEGMENT_WORDS: usize = 8192;
/// Lanes (GPU threads) per segment.
pub const LANES: usize = 256;

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

fn fmix(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// A gh1 digest, written as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuHash(pub [u8; 16]);

impl GpuHash {
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Option<GpuHash> {
        if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(GpuHash(out))
    }
}

impl fmt::Debug for GpuHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GpuHash({})", self.to_hex())
    }
}

impl Serialize for GpuHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for GpuHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        GpuHash::from_hex(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("bad gh1 hash {text:?}")))
    }
}

/// What the kernel leaves per chunk: the two lane sums and the OR of all words.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkSums {
    pub a: u64,
    pub b: u64,
    pub or: u64,
}

/// A chunk's identity before it is copied: all zero, or its digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkDigest {
    Zero,
    Hash(GpuHash),
}

impl ChunkSums {
    /// The digest of a chunk of `len` bytes with these sums.
    pub fn digest(self, len: u64) -> ChunkDigest {
        if self.or == 0 {
            return ChunkDigest::Zero;
        }
        let h0 = fmix(self.a ^ len.wrapping_mul(P1));
        let h1 = fmix(self.b ^ len.wrapping_mul(P2).rotate_left(29));
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&h0.to_le_bytes());
        out[8..].copy_from_slice(&h1.to_le_bytes());
        ChunkDigest::Hash(GpuHash(out))
    }
}

/// Whether gh1 can hash `len` bytes (whole u64 words) — a region, a chunk size, a chunk.
pub fn hashable(len: u64) -> bool {
    len & 7 == 0
}

/// The CPU reference of the kernel for one chunk; `None` when `data.len()` is not a
/// multiple of 8 (the GPU path is not used for such chunks).
pub fn chunk_sums(data: &[u8]) -> Option<ChunkSums> {
    if !hashable(data.len() as u64) {
        return None;
    }
    let words = data.len() / 8;
    let word = |i: usize| u64::from_le_bytes(data[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let mut sums = ChunkSums::default();
    for s in 0..words.div_ceil(SEGMENT_WORDS) {
        let start = s * SEGMENT_WORDS;
        let seg = SEGMENT_WORDS.min(words - start);
        let s64 = s as u64;
        for t in 0..LANES {
            let mut a = (t as u64 + 1).wrapping_mul(P1);
            let mut b = (t as u64 + 1).wrapping_mul(P2) ^ P5;
            let mut j = t;
            while j < seg {
                let w = word(start + j);
                a = a
                    .wrapping_add(w.wrapping_mul(P2))
                    .rotate_left(31)
                    .wrapping_mul(P1);
                b = (b ^ w.wrapping_mul(P4))
                    .rotate_left(27)
                    .wrapping_mul(P3)
                    .wrapping_add(P5);
                sums.or |= w;
                j += LANES;
            }
            sums.a = sums.a.wrapping_add(fmix(a ^ s64.wrapping_mul(P3)));
            sums.b = sums
                .b
                .wrapping_add(fmix(b.wrapping_add(s64.wrapping_mul(P4))));
        }
    }
    Some(sums)
}

/// The digest of `data` (CPU reference); `None` when its length is not a multiple of 8.
pub fn digest(data: &[u8]) -> Option<ChunkDigest> {
    chunk_sums(data).map(|s| s.digest(data.len() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn zero_chunks_are_zero_and_others_are_not() {
        assert_eq!(digest(&vec![0u8; 1 << 20]), Some(ChunkDigest::Zero));
        let mut one = vec![0u8; 1 << 20];
        one[12345] = 1;
        assert!(matches!(digest(&one), Some(ChunkDigest::Hash(_))));
        assert_eq!(digest(&[1, 2, 3]), None);
    }

    #[test]
    fn every_single_word_change_changes_the_digest() {
        // Partial last segment included: 2.5 segments.
        let data = pattern(SEGMENT_WORDS * 8 * 5 / 2, 7);
        let base = digest(&data).unwrap();
        for pos in [0, 8, 8 * 255, 8 * 256, 8 * SEGMENT_WORDS, data.len() - 8] {
            let mut d = data.clone();
            d[pos] ^= 0x80;
            assert_ne!(digest(&d).unwrap(), base, "change at {pos}");
        }
    }

    #[test]
    fn swapping_words_between_lanes_or_segments_changes_the_digest() {
        let data = pattern(SEGMENT_WORDS * 8 * 2, 9);
        let base = digest(&data).unwrap();
        let swap = |i: usize, j: usize| {
            let mut d = data.clone();
            for k in 0..8 {
                d.swap(i * 8 + k, j * 8 + k);
            }
            digest(&d).unwrap()
        };
        assert_ne!(swap(0, 1), base, "lanes 0 and 1");
        assert_ne!(swap(0, LANES), base, "two words of one lane");
        assert_ne!(swap(5, SEGMENT_WORDS + 5), base, "same lane, two segments");
    }

    #[test]
    fn length_is_part_of_the_digest() {
        let mut data = pattern(4096, 3);
        let a = digest(&data).unwrap();
        data.extend_from_slice(&[0u8; 8]);
        assert_ne!(digest(&data).unwrap(), a);
    }

    #[test]
    fn hex_round_trips() {
        let ChunkDigest::Hash(h) = digest(&pattern(64, 5)).unwrap() else {
            panic!("zero")
        };
        assert_eq!(GpuHash::from_hex(&h.to_hex()), Some(h));
        assert_eq!(GpuHash::from_hex("xyz"), None);
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<GpuHash>(&json).unwrap(), h);
    }
}
