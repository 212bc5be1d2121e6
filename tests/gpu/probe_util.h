// What the driver-API probes (register_probe.cu, xproc_probe.cu) share: define PROBE (the
// program's name, for error lines) before including.
#pragma once
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

// A driver call that must succeed; else the probe says which and exits 2.
#define CK(call)                                                  \
  do {                                                            \
    CUresult r_ = (call);                                         \
    if (r_ != CUDA_SUCCESS) {                                     \
      const char *s_ = "";                                        \
      cuGetErrorString(r_, &s_);                                  \
      fprintf(stderr, PROBE ": %s: %d %s\n", #call, r_, s_);      \
      exit(2);                                                    \
    }                                                             \
  } while (0)

// Seconds on the monotonic clock.
static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}
