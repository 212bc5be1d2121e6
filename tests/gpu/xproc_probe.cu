// Does the driver serialize pinning with DMA across processes, or only inside one? One
// process cannot register host memory while its copies run (register_probe.cu: register +
// DMA = their sum). Two processes, each with its own context, started at the same instant:
//   xproc_probe mkfile FILE GIB                      -> writes FILE (GIB GiB)
//   xproc_probe staged FILE OFF_GIB LEN_GIB START_NS -> 12 threads pread the range into a
//       ring of 32 pinned 16 MiB buffers, DMA'd as filled on 4 streams (the hook's copy-in)
//   xproc_probe direct FILE OFF_GIB LEN_GIB START_NS -> the range mapped (populated) and
//       registered read-only in 512 MiB windows by 8 threads, each DMA'd once registered
//   xproc_probe pre FILE OFF_GIB LEN_GIB START_NS DIRECT_GIB -> one process: the range's
//       first DIRECT_GIB registered first (8 threads, nothing else running), then those
//       windows DMA'd while the rest is staged as above (registration and copies never
//       overlap: the driver serializes them inside a process)
// Setup (context, device memory, pinned ring, mapping) happens before START_NS
// (CLOCK_REALTIME); the timed part starts there. Prints
//   "xprobe MODE gib=.. s=.. gbps=.. end_ns=.." (end_ns: everything on the GPU).
// Build: nvcc -O2 -o xproc_probe xproc_probe.cu -lcuda (GPUCR_HOOK_PROBES=xproc in h200-hook.sh)
#define PROBE "xproc_probe"
#include "probe_util.h"

#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>

static long long real_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

#define BUF (16u << 20)
#define NBUF 32
#define WIN (512u << 20)
static CUcontext ctx;
static int fd;
static char *map, *pinned;
static size_t off0, len, dlen;  // dlen: the range's first bytes copied direct
static std::atomic<size_t> next;
static std::atomic<int> *ready, *sready;  // per window / piece: 1 registered / filled
static std::atomic<size_t> turn[NBUF];  // the piece that may fill the buffer next

static void *reader(void *) {
  size_t n = (len - dlen + BUF - 1) / BUF;
  for (;;) {
    size_t p = next.fetch_add(1);
    if (p >= n) return NULL;
    int b = (int)(p % NBUF);  // pieces take buffers in turn; wait until the DMA frees it
    while (turn[b].load() != p) sched_yield();
    size_t o = dlen + p * BUF, l = len - o < BUF ? len - o : BUF;
    if (pread(fd, pinned + (size_t)b * BUF, l, off0 + o) != (ssize_t)l) perror("pread"), exit(1);
    sready[p].store(1);
  }
}

static void *registrar(void *) {
  cuCtxSetCurrent(ctx);
  size_t n = dlen / WIN;
  for (;;) {
    size_t k = next.fetch_add(1);
    if (k >= n) return NULL;
    CK(cuMemHostRegister(map + k * WIN, WIN, CU_MEMHOSTREGISTER_READ_ONLY));
    ready[k].store(1);
  }
}

int main(int argc, char **argv) {
  if (argc >= 4 && !strcmp(argv[1], "mkfile")) {
    size_t total = (size_t)(atof(argv[3]) * 1073741824.0);
    int f = open(argv[2], O_RDWR | O_CREAT | O_TRUNC, 0600);
    char *blk = (char *)malloc(BUF);
    for (size_t i = 0; i < BUF; i++) blk[i] = (char)(i * 131 + 7);
    for (size_t o = 0; o < total; o += BUF)
      if (pwrite(f, blk, BUF, o) != BUF) return perror("pwrite"), 1;
    close(f);
    return 0;
  }
  if (argc < 6) {
    fprintf(stderr, "usage: xproc_probe staged|direct|pre FILE OFF_GIB LEN_GIB START_NS [DIRECT_GIB]\n");
    return 1;
  }
  int direct = !strcmp(argv[1], "direct"), pre = !strcmp(argv[1], "pre");
  off0 = (size_t)(atof(argv[3]) * 1073741824.0);
  len = (size_t)(atof(argv[4]) * 1073741824.0);
  len -= len % WIN;
  long long start = atoll(argv[5]);
  dlen = direct ? len : pre && argc > 6 ? (size_t)(atof(argv[6]) * 1073741824.0) : 0;
  dlen -= dlen % WIN;
  fd = open(argv[2], O_RDONLY);
  if (fd < 0) return perror("open"), 1;
  CK(cuInit(0));
  CUdevice d;
  CK(cuDeviceGet(&d, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, d));
  CK(cuCtxSetCurrent(ctx));
  CUdeviceptr dev;
  CK(cuMemAlloc(&dev, len));
  size_t dn = dlen / WIN, sn = (len - dlen + BUF - 1) / BUF;
  ready = new std::atomic<int>[dn + 1]();
  sready = new std::atomic<int>[sn + 1]();
  CUstream st[4];
  for (int i = 0; i < 4; i++) CK(cuStreamCreate(&st[i], CU_STREAM_NON_BLOCKING));
  CUevent ev[NBUF];
  for (int i = 0; i < NBUF; i++) CK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
  if (dlen) {
    map = (char *)mmap(NULL, dlen, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, off0);
    if (map == MAP_FAILED) return perror("mmap"), 1;
  }
  if (sn) {
    CK(cuMemHostAlloc((void **)&pinned, (size_t)NBUF * BUF, 0));
    memset(pinned, 0, (size_t)NBUF * BUF);
    for (int b = 0; b < NBUF; b++) turn[b].store(b);
  }
  long long wait = start - real_ns();
  if (wait < 0) fprintf(stderr, "xproc_probe: setup ended %.3f s after the start\n", -wait / 1e9);
  while (real_ns() < start) {
  }
  double a = now_s(), reg_s = 0;
  pthread_t th[32];
  int nt = 0;
  if (pre) {  // register the direct part first, on 8 threads
    for (int i = 0; i < 8; i++) pthread_create(&th[i], NULL, registrar, NULL);
    for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
    reg_s = now_s() - a;
    next.store(0);
  } else if (dlen) {
    for (; nt < 8; nt++) pthread_create(&th[nt], NULL, registrar, NULL);
  }
  if (sn)
    for (int i = 0; i < 12; i++) pthread_create(&th[nt++], NULL, reader, NULL);
  long live[NBUF];  // the piece whose DMA reads the buffer, -1 none
  for (int b = 0; b < NBUF; b++) live[b] = -1;
  size_t k = 0, j = 0;  // next direct window, next staged piece
  for (int q = 0; k < dn || j < sn;) {
    int progress = 0;
    if (k < dn && ready[k].load()) {
      CK(cuMemcpyHtoDAsync(dev + k * WIN, map + k * WIN, WIN, st[q++ % 4]));
      k++;
      progress = 1;
    }
    if (j < sn && sready[j].load()) {
      CUstream s_ = st[q++ % 4];
      int b = (int)(j % NBUF);
      size_t o = dlen + j * BUF, l = len - o < BUF ? len - o : BUF;
      CK(cuMemcpyHtoDAsync(dev + o, pinned + (size_t)b * BUF, l, s_));
      CK(cuEventRecord(ev[b], s_));
      live[b] = (long)j;
      j++;
      progress = 1;
    }
    for (int b = 0; b < NBUF; b++)
      if (live[b] >= 0 && cuEventQuery(ev[b]) == CUDA_SUCCESS)
        turn[b].store((size_t)live[b] + NBUF), live[b] = -1;
    if (!progress) sched_yield();
  }
  CK(cuCtxSynchronize());
  double s = now_s() - a;
  long long end = real_ns();
  for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
  double u = 0;
  if (dlen) {
    double b = now_s();
    for (size_t w = 0; w < dn; w++) CK(cuMemHostUnregister(map + w * WIN));
    u = now_s() - b;
  }
  // The device got the range: its first and last 16 MiB.
  char *back = (char *)malloc(BUF), *want = (char *)malloc(BUF);
  int ok = 1;
  size_t at[2] = {0, len - BUF};
  for (int i = 0; i < 2; i++) {
    CK(cuMemcpyDtoH(back, dev + at[i], BUF));
    ok = ok && pread(fd, want, BUF, off0 + at[i]) == BUF && !memcmp(back, want, BUF);
  }
  printf("xprobe %s gib=%.1f direct_gib=%.1f s=%.3f gbps=%.1f register_first_s=%.3f end_ns=%lld "
         "unregister_s=%.3f check=%s\n", argv[1], len / 1073741824.0, dlen / 1073741824.0, s,
         len / s / 1e9, reg_s, end, u, ok ? "ok" : "MISMATCH");
  return 0;
}
