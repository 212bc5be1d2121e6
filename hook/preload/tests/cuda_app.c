/* A CUDA driver API client for the interposition tests (tests/fake-libcuda as its
 * libcuda.so.1; device pointers are host addresses there). It reaches the driver the
 * two ways real programs do: through cuGetProcAddress_v2, asking it for
 * cuGetProcAddress itself first (the CUDA runtime), and with plain dlsym on libcuda's
 * handle (PyTorch).
 *
 * Usage: cuda_app [managed | loop <file>]. Prints "sym <name> <library> <symbol>" for
 * resolved functions, then "ready <a> <size_a> <b> <size_b>", then answers stdin lines:
 * check -> "ok <hash>" | "bad <offset>"; launch -> "launched <rc>"; free -> "freed <rc> <rc>";
 * quit. With "loop" (the container test: no stdin) it instead checks its memory every
 * 100 ms, reading it through the driver only (like a GPU program: the hook may release it
 * between two calls), and writes "<step> ok <hash>" | "<step> bad <offset>" to <file>
 * (atomically) and stdout. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*gpa2_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*init_t)(unsigned);
typedef CUresult (*dev_get_t)(int *, int);
typedef CUresult (*retain_t)(void **, int);
typedef CUresult (*set_ctx_t)(void *);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*managed_t)(CUdeviceptr *, size_t, unsigned);
typedef CUresult (*free_t)(CUdeviceptr);
typedef CUresult (*dtoh_t)(void *, CUdeviceptr, size_t);
typedef CUresult (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, void *, void **, void **);

static void *lib;
static gpa2_t gpa;

static void show(const char *what, void *fn) {
  Dl_info info;
  if (fn && dladdr(fn, &info) && info.dli_fname) {
    const char *base = strrchr(info.dli_fname, '/');
    printf("sym %s %s %s\n", what, base ? base + 1 : info.dli_fname,
           info.dli_sname ? info.dli_sname : "?");
  } else {
    printf("sym %s none none\n", what);
  }
}

static void *proc(const char *name, int version, unsigned long long flags) {
  void *fn = NULL;
  int status = -1;
  if (gpa(name, &fn, version, flags, &status) != 0 || !fn) {
    fprintf(stderr, "cuGetProcAddress(%s) failed\n", name);
    exit(2);
  }
  show(name, fn);
  return fn;
}

static unsigned char pattern_a(size_t i, unsigned launches) {
  return (unsigned char)(i * 7 + 1 + launches);
}
static unsigned char pattern_b(size_t i) { return (unsigned char)(i * 13 + 5); }

/* Checks a copy of both allocations against their patterns; the FNV-1a hash of both, or
 * the first bad offset. */
static long verify(const unsigned char *a, size_t na, const unsigned char *b, size_t nb,
                   unsigned launches, uint64_t *hash) {
  *hash = 1469598103934665603ull;
  for (size_t i = 0; i < na; i++) {
    if (a[i] != pattern_a(i, launches)) return (long)i;
    *hash = (*hash ^ a[i]) * 1099511628211ull;
  }
  for (size_t i = 0; i < nb; i++) {
    if (b[i] != pattern_b(i)) return (long)(na + i);
    *hash = (*hash ^ b[i]) * 1099511628211ull;
  }
  return -1;
}

/* The "loop" mode: never returns. */
static void loop(const char *file, dtoh_t dtoh, CUdeviceptr a, size_t na, CUdeviceptr b,
                 size_t nb) {
  unsigned char *ca = malloc(na), *cb = malloc(nb);
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.new", file);
  for (unsigned long step = 1;; step++) {
    char line[128];
    uint64_t hash = 0;
    if (!ca || !cb || dtoh(ca, a, na) || dtoh(cb, b, nb)) {
      snprintf(line, sizeof line, "%lu bad copy\n", step);
    } else {
      long bad = verify(ca, na, cb, nb, 0, &hash);
      if (bad >= 0)
        snprintf(line, sizeof line, "%lu bad %ld\n", step, bad);
      else
        snprintf(line, sizeof line, "%lu ok %016llx\n", step, (unsigned long long)hash);
    }
    FILE *f = fopen(tmp, "w");
    if (f) {
      fputs(line, f);
      fclose(f);
      rename(tmp, file);
    }
    fputs(line, stdout);
    usleep(100 * 1000);
  }
}

int main(int argc, char **argv) {
  int managed = argc > 1 && strcmp(argv[1], "managed") == 0;
  const char *loop_file = argc > 2 && strcmp(argv[1], "loop") == 0 ? argv[2] : NULL;
  setvbuf(stdout, NULL, _IOLBF, 0);
  lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  gpa2_t first = (gpa2_t)dlsym(lib, "cuGetProcAddress_v2");
  if (!first) return 2;
  show("dlsym:cuGetProcAddress_v2", (void *)first);
  gpa = first;
  gpa = (gpa2_t)proc("cuGetProcAddress", 12000, 0);
  ((init_t)proc("cuInit", 2000, 0))(0);
  int dev = -1;
  void *ctx = NULL;
  if (((dev_get_t)proc("cuDeviceGet", 2000, 0))(&dev, 0) ||
      ((retain_t)proc("cuDevicePrimaryCtxRetain", 7000, 0))(&ctx, dev) ||
      ((set_ctx_t)proc("cuCtxSetCurrent", 4000, 0))(ctx))
    return 3;
  alloc_t alloc = (alloc_t)proc("cuMemAlloc", 3020, 0);
  launch_t launch = (launch_t)proc("cuLaunchKernel", 4000, 2);
  dtoh_t dtoh = (dtoh_t)proc("cuMemcpyDtoH", 3020, 2);
  alloc_t alloc_v2 = (alloc_t)dlsym(lib, "cuMemAlloc_v2");
  free_t free_v2 = (free_t)dlsym(lib, "cuMemFree_v2");
  show("dlsym:cuMemAlloc_v2", (void *)alloc_v2);
  show("dlsym:cuMemFree_v2", (void *)free_v2);

  size_t na = (5 << 20) + 123, nb = 3 << 20;
  CUdeviceptr a = 0, b = 0;
  if (alloc(&a, na) || alloc_v2(&b, nb)) return 4;
  unsigned char *pa = (unsigned char *)(uintptr_t)a, *pb = (unsigned char *)(uintptr_t)b;
  for (size_t i = 0; i < na; i++) pa[i] = pattern_a(i, 0) - 1;
  for (size_t i = 0; i < nb; i++) pb[i] = pattern_b(i);
  unsigned launches = 0;
  void *params[2] = {&a, &na};
  /* The built-in kernel adds one to every byte: pattern_a(i, 0) after this. */
  if (launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL)) return 5;
  if (managed) {
    CUdeviceptr m = 0;
    if (((managed_t)proc("cuMemAllocManaged", 6000, 0))(&m, 4096, 1)) return 6;
  }
  printf("ready %llx %zu %llx %zu\n", a, na, b, nb);
  if (loop_file) loop(loop_file, dtoh, a, na, b, nb);

  char line[64];
  while (fgets(line, sizeof line, stdin)) {
    if (strncmp(line, "check", 5) == 0) {
      /* Read through the driver copy too (wrapped _ptds variant). */
      unsigned char *copy = malloc(na);
      if (!copy || dtoh(copy, a, na)) {
        printf("bad copy\n");
        continue;
      }
      uint64_t hash = 0;
      long bad = verify(pa, na, pb, nb, launches, &hash);
      for (size_t i = 0; i < na && bad < 0; i++)
        if (copy[i] != pa[i]) bad = (long)i;
      free(copy);
      if (bad >= 0)
        printf("bad %ld\n", bad);
      else
        printf("ok %016llx\n", (unsigned long long)hash);
    } else if (strncmp(line, "launch", 6) == 0) {
      CUresult rc = launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
      if (rc == 0) launches++;
      printf("launched %d\n", rc);
    } else if (strncmp(line, "free", 4) == 0) {
      printf("freed %d %d\n", free_v2(a), free_v2(b));
    } else if (strncmp(line, "quit", 4) == 0) {
      break;
    }
  }
  return 0;
}
