// How fast can an image that lies in the page cache (a tmpfs file) reach the GPU? The
// copy-in's two ways, measured on one file of GIB GiB in DIR, one process:
//   register T   : cuMemHostRegister(READ_ONLY) of the file's mapping in WIN-sized windows on
//                  T threads (what a direct copy-in pays before its DMA), then unregistering
//                  them on one thread and on T threads;
//   pipe T       : T threads register windows while the main thread DMAs each registered
//                  window into device memory on 4 streams (the time until the data is on the
//                  GPU; the unpinning after it is reported apart);
//   memcpy T     : T threads memcpy from the populated mapping into pinned 32 MiB buffers
//                  (the staged copy-in's readers without read(2));
//   hybrid T/R   : T registrar threads feed the direct DMA of the file's first part while R
//                  threads stage its second part through pinned buffers (both kinds of
//                  copy on the link at once).
//   register_probe DIR GIB WIN_MIB -> lines "regprobe KIND ... gbps=.."
// Build: nvcc -O2 -o register_probe register_probe.cu -lcuda (GPUCR_HOOK_PROBES=register in h200-hook.sh)
#define PROBE "register_probe"
#include "probe_util.h"

#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <atomic>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static CUcontext ctx;
static char *map;
static size_t total, win, nwin;
static CUdeviceptr dev;
static std::atomic<size_t> next_win;
static std::atomic<int> *ready;  // per window: 1 registered
static size_t reg_limit;   // windows [0, reg_limit) are registered by the registrars

static void *registrar(void *arg) {
  (void)arg;
  cuCtxSetCurrent(ctx);
  for (;;) {
    size_t k = next_win.fetch_add(1);
    if (k >= reg_limit) return NULL;
    CK(cuMemHostRegister(map + k * win, win, CU_MEMHOSTREGISTER_READ_ONLY));
    ready[k].store(1);
  }
}

static void *unregistrar(void *arg) {
  (void)arg;
  cuCtxSetCurrent(ctx);
  for (;;) {
    size_t k = next_win.fetch_add(1);
    if (k >= reg_limit) return NULL;
    CK(cuMemHostUnregister(map + k * win));
  }
}

static void run_threads(void *(*f)(void *), int t) {
  pthread_t th[64];
  for (int i = 0; i < t; i++) pthread_create(&th[i], NULL, f, NULL);
  for (int i = 0; i < t; i++) pthread_join(th[i], NULL);
}

static double unregister_all(int t) {
  double a = now_s();
  next_win.store(0);
  run_threads(unregistrar, t);
  return now_s() - a;
}

// Staged part: readers memcpy [from, to) of the mapping into a ring of pinned buffers;
// the main thread DMAs each filled buffer.
#define BUF (32u << 20)
#define NBUF 16
static char *pinned;
static size_t stage_from, stage_to;
static std::atomic<size_t> next_piece;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int buf_free[NBUF];  // 1: free for a reader
static long filled_piece[NBUF];  // piece index, -1 none
static size_t pieces_done;

static void *stager(void *arg) {
  (void)arg;
  size_t n = (stage_to - stage_from + BUF - 1) / BUF;
  for (;;) {
    size_t p = next_piece.fetch_add(1);
    if (p >= n) return NULL;
    pthread_mutex_lock(&mu);
    int b;
    for (;;) {
      for (b = 0; b < NBUF && !buf_free[b]; b++) {
      }
      if (b < NBUF) break;
      pthread_cond_wait(&cv, &mu);
    }
    buf_free[b] = 0;
    pthread_mutex_unlock(&mu);
    size_t off = stage_from + p * BUF;
    size_t len = stage_to - off < BUF ? stage_to - off : BUF;
    memcpy(pinned + (size_t)b * BUF, map + off, len);
    pthread_mutex_lock(&mu);
    filled_piece[b] = (long)p;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
  }
}

// Copies: direct windows [0, reg_limit) as they become registered, staged pieces as they
// fill, alternating, on 4 streams. Returns seconds until everything is on the GPU.
static double feed(int treg, int tstage) {
  CUstream st[4];
  CUevent ev[NBUF];
  for (int i = 0; i < 4; i++) CK(cuStreamCreate(&st[i], CU_STREAM_NON_BLOCKING));
  for (int i = 0; i < NBUF; i++) CK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
  int ev_live[NBUF] = {0};
  for (int i = 0; i < NBUF; i++) buf_free[i] = 1, filled_piece[i] = -1;
  size_t npieces = stage_to > stage_from ? (stage_to - stage_from + BUF - 1) / BUF : 0;
  pieces_done = 0;
  next_win.store(0);
  next_piece.store(0);
  for (size_t k = 0; k < nwin; k++) ready[k].store(0);
  double a = now_s();
  pthread_t rt[64], stt[64];
  for (int i = 0; i < treg && reg_limit; i++) pthread_create(&rt[i], NULL, registrar, NULL);
  for (int i = 0; i < tstage && npieces; i++) pthread_create(&stt[i], NULL, stager, NULL);
  size_t k = 0;
  int s = 0;
  while (k < reg_limit || pieces_done < npieces) {
    int progress = 0;
    if (k < reg_limit && ready[k].load()) {
      CK(cuMemcpyHtoDAsync(dev + k * win, map + k * win, win, st[s++ % 4]));
      k++;
      progress = 1;
    }
    pthread_mutex_lock(&mu);
    for (int b = 0; b < NBUF; b++) {
      if (filled_piece[b] >= 0) {
        size_t off = stage_from + (size_t)filled_piece[b] * BUF;
        size_t len = stage_to - off < BUF ? stage_to - off : BUF;
        filled_piece[b] = -1;
        pthread_mutex_unlock(&mu);
        CUstream q = st[s++ % 4];
        CK(cuMemcpyHtoDAsync(dev + off, pinned + (size_t)b * BUF, len, q));
        CK(cuEventRecord(ev[b], q));
        ev_live[b] = 1;
        pieces_done++;
        progress = 1;
        pthread_mutex_lock(&mu);
      }
    }
    for (int b = 0; b < NBUF; b++) {
      if (ev_live[b] && cuEventQuery(ev[b]) == CUDA_SUCCESS) {
        ev_live[b] = 0;
        buf_free[b] = 1;
        pthread_cond_broadcast(&cv);
      }
    }
    pthread_mutex_unlock(&mu);
    if (!progress) sched_yield();
  }
  CK(cuCtxSynchronize());
  double t = now_s() - a;
  for (int i = 0; i < treg && reg_limit; i++) pthread_join(rt[i], NULL);
  for (int i = 0; i < tstage && npieces; i++) pthread_join(stt[i], NULL);
  for (int i = 0; i < 4; i++) cuStreamDestroy(st[i]);
  for (int i = 0; i < NBUF; i++) cuEventDestroy(ev[i]);
  return t;
}

struct mc {
  size_t from, to;
  char *buf;
};
static void *memcpy_job(void *arg) {
  struct mc *m = (struct mc *)arg;
  for (size_t off = m->from; off < m->to; off += BUF) {
    size_t len = m->to - off < BUF ? m->to - off : BUF;
    memcpy(m->buf, map + off, len);
  }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: register_probe DIR GIB WIN_MIB\n");
    return 1;
  }
  total = (size_t)(atof(argv[2]) * 1073741824.0);
  win = (size_t)atoi(argv[3]) << 20;
  total -= total % win;
  nwin = total / win;
  ready = new std::atomic<int>[nwin]();
  char path[4096];
  snprintf(path, sizeof path, "%s/register-probe.bin", argv[1]);
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return perror("open"), 1;
  char *blk = (char *)malloc(BUF);
  for (size_t i = 0; i < BUF; i++) blk[i] = (char)(i * 131 + 7);
  double a = now_s();
  for (size_t off = 0; off < total; off += BUF)
    if (pwrite(fd, blk, BUF, off) != BUF) return perror("pwrite"), 1;
  printf("regprobe write gib=%.0f gbps=%.1f\n", total / 1073741824.0, total / (now_s() - a) / 1e9);

  CK(cuInit(0));
  CUdevice d;
  CK(cuDeviceGet(&d, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, d));
  CK(cuCtxSetCurrent(ctx));
  CK(cuMemAlloc(&dev, total));
  CK(cuMemHostAlloc((void **)&pinned, (size_t)NBUF * BUF, 0));

  a = now_s();
  map = (char *)mmap(NULL, total, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (map == MAP_FAILED) return perror("mmap"), 1;
  printf("regprobe populate gbps=%.1f\n", total / (now_s() - a) / 1e9);

  int threads[] = {1, 4, 8, 16};
  reg_limit = nwin;
  for (int i = 0; i < 4; i++) {
    int t = threads[i];
    next_win.store(0);
    a = now_s();
    run_threads(registrar, t);
    double r = now_s() - a;
    double u = unregister_all(i % 2 ? t : 1);
    printf("regprobe register threads=%d win_mib=%zu gbps=%.1f s=%.3f unregister_threads=%d unregister_s=%.3f\n",
           t, win >> 20, total / r / 1e9, r, i % 2 ? t : 1, u);
    fflush(stdout);
  }
  // Direct only: registrars feed the DMA.
  stage_from = stage_to = total;
  int pipe_threads[] = {4, 8, 16};
  for (int i = 0; i < 3; i++) {
    double t = feed(pipe_threads[i], 0);
    double u = unregister_all(1);
    printf("regprobe pipe threads=%d gbps=%.1f s=%.3f unregister_s=%.3f\n", pipe_threads[i],
           total / t / 1e9, t, u);
    fflush(stdout);
  }
  // memcpy out of the mapping into pinned buffers.
  int mthreads[] = {8, 16};
  for (int i = 0; i < 2; i++) {
    int t = mthreads[i];
    pthread_t th[64];
    struct mc jobs[64];
    char *bufs[64];
    for (int j = 0; j < t; j++) CK(cuMemHostAlloc((void **)&bufs[j], BUF, 0));
    a = now_s();
    size_t per = total / t;
    for (int j = 0; j < t; j++) {
      jobs[j].from = j * per;
      jobs[j].to = j == t - 1 ? total : (j + 1) * per;
      jobs[j].buf = bufs[j];
      pthread_create(&th[j], NULL, memcpy_job, &jobs[j]);
    }
    for (int j = 0; j < t; j++) pthread_join(th[j], NULL);
    double r = now_s() - a;
    printf("regprobe memcpy threads=%d gbps=%.1f\n", t, total / r / 1e9);
    for (int j = 0; j < t; j++) cuMemFreeHost(bufs[j]);
  }
  // Staged only, then hybrids: the first FRACTION of the file direct, the rest staged.
  double fr[] = {0.0, 0.4, 0.5, 0.6};
  int regs[] = {0, 8, 8, 8};
  int stg[] = {12, 8, 8, 6};
  for (int i = 0; i < 4; i++) {
    reg_limit = (size_t)(nwin * fr[i]);
    stage_from = reg_limit * win;
    stage_to = total;
    double t = feed(regs[i], stg[i]);
    double u = reg_limit ? unregister_all(1) : 0;
    printf("regprobe hybrid direct_frac=%.1f registrars=%d stagers=%d gbps=%.1f s=%.3f unregister_s=%.3f\n",
           fr[i], regs[i], stg[i], total / t / 1e9, t, u);
    fflush(stdout);
  }
  // Check the device got the file (first and last window).
  char *back = (char *)malloc(win);
  CK(cuMemcpyDtoH(back, dev, win));
  int ok = memcmp(back, map, win) == 0;
  CK(cuMemcpyDtoH(back, dev + total - win, win));
  ok = ok && memcmp(back, map + total - win, win) == 0;
  printf("regprobe check %s\n", ok ? "ok" : "MISMATCH");
  munmap(map, total);
  close(fd);
  unlink(path);
  return 0;
}
