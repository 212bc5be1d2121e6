// gpucr's device-side chunk hash ("gh1"): one 128-bit digest and an all-zero flag per chunk,
// computed where the data is, so unchanged and zero chunks never cross PCIe.
// The definition (and a CPU reference that must give the same bits) is in
// gpu-state/src/image/gpuhash.rs. Built to PTX with clang, without CUDA headers:
// hook/kernels/build-ptx.sh. Launch: grid = chunks x segments-per-chunk blocks of 256
// threads; `out` holds 3 u64 per chunk (sum a, sum b, or), zeroed before the launch.

typedef unsigned long long u64;
typedef unsigned int u32;

#define GLOBAL __attribute__((global))
#define DEVICE __attribute__((device)) static inline

#define SEGMENT_WORDS 8192ull
#define LANES 256u

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull
#define P4 0x85EBCA77C2B2AE63ull
#define P5 0x27D4EB2F165667C5ull

DEVICE u64 rotl(u64 x, u32 r) { return (x << r) | (x >> (64 - r)); }

DEVICE u64 fmix(u64 k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

DEVICE u64 shfl_down(u64 v, u32 off) {
  u32 lo = (u32)v, hi = (u32)(v >> 32);
  lo = (u32)__nvvm_shfl_sync_down_i32(0xffffffffu, (int)lo, off, 0x1f);
  hi = (u32)__nvvm_shfl_sync_down_i32(0xffffffffu, (int)hi, off, 0x1f);
  return ((u64)hi << 32) | lo;
}

extern "C" GLOBAL void gpucr_gh1(const u64 *base, u64 total_words, u64 chunk_words,
                                 u64 segs_per_chunk, u64 *out) {
  u64 blk = __nvvm_read_ptx_sreg_ctaid_x();
  u32 t = __nvvm_read_ptx_sreg_tid_x();
  u64 c = blk / segs_per_chunk, s = blk % segs_per_chunk;
  u64 cstart = c * chunk_words;
  if (cstart >= total_words) return;
  u64 cwords = total_words - cstart < chunk_words ? total_words - cstart : chunk_words;
  u64 sstart = s * SEGMENT_WORDS;
  if (sstart >= cwords) return;
  u64 swords = cwords - sstart < SEGMENT_WORDS ? cwords - sstart : SEGMENT_WORDS;
  const u64 *p = base + cstart + sstart;
  u64 a = (u64)(t + 1) * P1, b = ((u64)(t + 1) * P2) ^ P5, o = 0;
  for (u64 j = t; j < swords; j += LANES) {
    u64 w = (u64)__nvvm_ldg_ll((const long long *)(p + j));
    a = rotl(a + w * P2, 31) * P1;
    b = rotl(b ^ (w * P4), 27) * P3 + P5;
    o |= w;
  }
  u64 la = fmix(a ^ (s * P3)), lb = fmix(b + s * P4);
  for (u32 off = 16; off > 0; off >>= 1) {
    la += shfl_down(la, off);
    lb += shfl_down(lb, off);
    o |= shfl_down(o, off);
  }
  if ((t & 31) == 0) {
    __nvvm_atom_add_gen_ll((long long *)&out[c * 3], (long long)la);
    __nvvm_atom_add_gen_ll((long long *)&out[c * 3 + 1], (long long)lb);
    __nvvm_atom_or_gen_ll((long long *)&out[c * 3 + 2], (long long)o);
  }
}
