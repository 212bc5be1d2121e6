/* The page cache's own speed on this machine (issue 4's "within X of the write speed" for
 * tmpfs images): THREADS threads each write GIB/THREADS into their own file in DIR with
 * write(2) from a 32 MiB buffer, then read it back with pread(2) into that buffer (what the
 * copy-in's readers do), twice: the first pass allocates memory the machine may never have
 * touched (a VM's first touch can cost more), the second reuses freed memory.
 *   tmpfs_ceiling DIR GIB THREADS [PASSES] -> "tmpfs pass=N write_gbps=.. read_gbps=.."
 * (PASSES=1 with a large GIB warms the machine's memory before a benchmark.)
 * Build: gcc -O2 -pthread -o tmpfs_ceiling tmpfs_ceiling.c
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BLOCK (32u << 20)
static const char *dir;
static size_t per_thread;
static pthread_barrier_t start;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

struct job {
  int id, reading;
  int rc;
};

static void *run(void *arg) {
  struct job *j = arg;
  char path[4096];
  snprintf(path, sizeof path, "%s/ceiling-%02d", dir, j->id);
  char *buf = aligned_alloc(4096, BLOCK);
  memset(buf, 0x5a + j->id, BLOCK);
  int fd = open(path, j->reading ? O_RDONLY : (O_WRONLY | O_CREAT | O_TRUNC), 0600);
  j->rc = fd < 0;
  pthread_barrier_wait(&start);
  for (size_t off = 0; fd >= 0 && off < per_thread; off += BLOCK) {
    ssize_t n = j->reading ? pread(fd, buf, BLOCK, off) : pwrite(fd, buf, BLOCK, off);
    if (n != BLOCK) { j->rc = 1; break; }
  }
  if (fd >= 0) close(fd);
  free(buf);
  return NULL;
}

static double pass(int threads, int reading) {
  pthread_t th[256];
  struct job jobs[256];
  pthread_barrier_init(&start, NULL, threads + 1);
  for (int i = 0; i < threads; i++) {
    jobs[i] = (struct job){i, reading, 0};
    pthread_create(&th[i], NULL, run, &jobs[i]);
  }
  pthread_barrier_wait(&start);
  double t0 = now_s();
  int rc = 0;
  for (int i = 0; i < threads; i++) {
    pthread_join(th[i], NULL);
    rc |= jobs[i].rc;
  }
  double t = now_s() - t0;
  pthread_barrier_destroy(&start);
  return rc ? -1 : per_thread * threads / t / 1e9;
}

int main(int argc, char **argv) {
  if (argc < 4) return 2;
  dir = argv[1];
  double gib = atof(argv[2]);
  int threads = atoi(argv[3]);
  int passes = argc > 4 ? atoi(argv[4]) : 2;
  if (threads < 1 || threads > 256) return 2;
  per_thread = (size_t)(gib * (1u << 30) / threads) / BLOCK * BLOCK;
  for (int p = 1; p <= passes; p++) {
    double w = pass(threads, 0);
    double r = pass(threads, 1);
    printf("tmpfs pass=%d dir=%s bytes=%zu threads=%d write_gbps=%.1f read_gbps=%.1f\n", p, dir,
           per_thread * threads, threads, w, r);
    fflush(stdout);
    for (int i = 0; i < threads; i++) {
      char path[4096];
      snprintf(path, sizeof path, "%s/ceiling-%02d", dir, i);
      unlink(path);
    }
  }
  return 0;
}
