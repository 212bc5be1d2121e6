// The PCIe copy ceiling on this machine, measured in the same run as the hook benchmark:
// cudaMemcpy device<->host through pinned memory (cudaMallocHost) and pageable memory.
//   pinned_ceiling GIB   -> "ceiling d2h_pinned_gbps=.. h2d_pinned_gbps=.. d2h_pageable_gbps=.. h2d_pageable_gbps=.."
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                 \
  do {                                                                              \
    cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess) {                                                        \
      fprintf(stderr, "pinned_ceiling: %s: %s\n", #call, cudaGetErrorString(e_)); \
      exit(2);                                                                      \
    }                                                                               \
  } while (0)

static double gbps(void *dst, const void *src, size_t n, cudaMemcpyKind kind, int reps) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaMemcpy(dst, src, n, kind));  // warm-up
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < reps; i++) CHECK(cudaMemcpy(dst, src, n, kind));
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return (double)n * reps / (ms / 1000.0) / 1e9;
}

int main(int argc, char **argv) {
  double gib = argc > 1 ? atof(argv[1]) : 2.0;
  size_t n = (size_t)(gib * 1073741824.0);
  void *dev, *pinned, *pageable;
  CHECK(cudaMalloc(&dev, n));
  CHECK(cudaMemset(dev, 7, n));
  CHECK(cudaMallocHost(&pinned, n));
  pageable = malloc(n);
  memset(pageable, 1, n);
  double d2h = gbps(pinned, dev, n, cudaMemcpyDeviceToHost, 4);
  double h2d = gbps(dev, pinned, n, cudaMemcpyHostToDevice, 4);
  double d2hp = gbps(pageable, dev, n, cudaMemcpyDeviceToHost, 2);
  double h2dp = gbps(dev, pageable, n, cudaMemcpyHostToDevice, 2);
  printf("ceiling bytes=%zu d2h_pinned_gbps=%.1f h2d_pinned_gbps=%.1f d2h_pageable_gbps=%.1f h2d_pageable_gbps=%.1f\n",
         n, d2h, h2d, d2hp, h2dp);
  return 0;
}
