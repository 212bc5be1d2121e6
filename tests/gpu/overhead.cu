// What the hook costs a running workload: kernel launches, small copies, and allocations
// (cudaMalloc/cudaFree, which the hook backs with VMM), timed in one process. h200-hook.sh runs
// it with and without the hook preloaded, interleaved.
//   overhead   -> "overhead launch_us=.. memcpy_us=.. malloc_free_us=.. malloc_64m_us=.."
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHECK(call)                                                            \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      fprintf(stderr, "overhead: %s: %s\n", #call, cudaGetErrorString(e_));   \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

__global__ void empty_kernel(int *p) {
  if (p && threadIdx.x == 1024) *p = 1;
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

int main(void) {
  CHECK(cudaFree(0));
  int *d = NULL;
  CHECK(cudaMalloc((void **)&d, 4096));
  char host[4096] = {0};
  for (int i = 0; i < 1000; i++) empty_kernel<<<1, 32>>>(d);  // warm-up
  CHECK(cudaDeviceSynchronize());

  const int launches = 200000;
  double t0 = now_us();
  for (int i = 0; i < launches; i++) empty_kernel<<<1, 32>>>(d);
  CHECK(cudaDeviceSynchronize());
  double launch = (now_us() - t0) / launches;

  const int copies = 20000;
  t0 = now_us();
  for (int i = 0; i < copies; i++) CHECK(cudaMemcpy(d, host, sizeof(host), cudaMemcpyHostToDevice));
  double memcpy_us = (now_us() - t0) / copies;

  const int allocs = 2000;
  void *p;
  t0 = now_us();
  for (int i = 0; i < allocs; i++) {
    CHECK(cudaMalloc(&p, 2 << 20));
    CHECK(cudaFree(p));
  }
  double mf = (now_us() - t0) / allocs;

  const int big = 200;
  t0 = now_us();
  for (int i = 0; i < big; i++) {
    CHECK(cudaMalloc(&p, 64 << 20));
    CHECK(cudaFree(p));
  }
  double mf64 = (now_us() - t0) / big;
  printf("overhead launch_us=%.3f memcpy_us=%.3f malloc_free_us=%.2f malloc_64m_us=%.2f\n", launch,
         memcpy_us, mf, mf64);
  CHECK(cudaFree(d));
  return 0;
}
