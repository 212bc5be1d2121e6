// gpucr GPU end-to-end workload: holds GIB GiB of device memory (cudaMalloc) and changes it
// deterministically, one step at a time, so that a checkpointed/restored run can be compared
// with an uninterrupted one line by line.
//
//   workload GIB STEPS SLEEP_MS OUT [STATIC_GIB]
//     GIB       device memory in GiB (may be fractional, e.g. 0.5)
//     STEPS     steps to run, 0 = forever
//     SLEEP_MS  pause after each step
//     OUT       file the lines are appended to (opened and closed per line), or - for stdout
//     STATIC_GIB a second buffer filled once and never changed (model weights, for incremental
//                checkpoints); its hash is printed as "static 0 hash H" at the start and after
//                every "now" line (the step lines cover the changing buffer only)
//
// Lines: "step S hash H" after step S; "now S hash H" (hash of the buffer after step S,
// without a step) whenever SIGUSR1 arrives. Step 0 is the initial fill. The buffer after step S
// is x_S[i] = x_{S-1}[i] * A + S + i (mod 2^64), x_0[i] = mix(i), and H = sum over i of
// mix(x[i] ^ i) (mod 2^64): the same numbers on any run, whatever the thread schedule.
#include <cuda_runtime.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                                     \
  do {                                                                                  \
    cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) {                                                          \
      fprintf(stderr, "workload: %s failed: %s (%d) at %s:%d\n", #call,                \
              cudaGetErrorString(err_), (int)err_, __FILE__, __LINE__);                 \
      exit(2);                                                                          \
    }                                                                                   \
  } while (0)

#define KMUL 6364136223846793005ULL

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

__global__ void fill_kernel(unsigned long long *x, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = mix64(i);
}

__global__ void fill_static_kernel(unsigned long long *x, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = mix64(i ^ 0x5151515151515151ULL);
}

__global__ void step_kernel(unsigned long long *x, size_t n, unsigned long long step) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = x[i] * KMUL + step + i;
}

__global__ void hash_kernel(const unsigned long long *x, size_t n, unsigned long long *out) {
  unsigned long long acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    acc += mix64(x[i] ^ i);
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}

static volatile sig_atomic_t hash_now = 0;
static void on_usr1(int sig) {
  (void)sig;
  hash_now = 1;
}

static unsigned long long device_hash(const unsigned long long *x, size_t n,
                                      unsigned long long *d_sum, int blocks) {
  unsigned long long h = 0;
  CHECK(cudaMemset(d_sum, 0, sizeof(*d_sum)));
  hash_kernel<<<blocks, 256>>>(x, n, d_sum);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(&h, d_sum, sizeof(h), cudaMemcpyDeviceToHost));
  return h;
}

static void emit(const char *out, const char *what, unsigned long long step,
                 unsigned long long h) {
  FILE *f = strcmp(out, "-") == 0 ? stdout : fopen(out, "a");
  if (!f) {
    perror(out);
    exit(3);
  }
  fprintf(f, "%s %llu hash %016llx\n", what, step, h);
  if (f == stdout)
    fflush(f);
  else
    fclose(f);
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  // An interrupted sleep (SIGUSR1) ends early: the next step comes a little sooner.
  nanosleep(&ts, NULL);
}

int main(int argc, char **argv) {
  if (argc != 5 && argc != 6) {
    fprintf(stderr, "usage: %s GIB STEPS SLEEP_MS OUT [STATIC_GIB]\n", argv[0]);
    return 1;
  }
  double gib = atof(argv[1]);
  unsigned long long steps = strtoull(argv[2], NULL, 10);
  long pause_ms = atol(argv[3]);
  const char *out = argv[4];
  size_t n = (size_t)(gib * 1073741824.0) / sizeof(unsigned long long);
  size_t ns = argc == 6 ? (size_t)(atof(argv[5]) * 1073741824.0) / sizeof(unsigned long long) : 0;
  if (n == 0) {
    fprintf(stderr, "workload: GIB must be > 0\n");
    return 1;
  }

  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_usr1;
  sigaction(SIGUSR1, &sa, NULL);

  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int blocks = sms * 8;
  unsigned long long *x = NULL, *d_sum = NULL;
  CHECK(cudaMalloc((void **)&x, n * sizeof(*x)));
  CHECK(cudaMalloc((void **)&d_sum, sizeof(*d_sum)));
  unsigned long long *w = NULL;
  if (ns > 0) {
    CHECK(cudaMalloc((void **)&w, ns * sizeof(*w)));
    fill_static_kernel<<<blocks, 256>>>(w, ns);
    CHECK(cudaGetLastError());
  }
  fill_kernel<<<blocks, 256>>>(x, n);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  fprintf(stderr, "workload: %zu bytes of device memory, %llu steps, %ld ms pause, out %s\n",
          n * sizeof(*x), steps, pause_ms, out);
  if (w) emit(out, "static", 0, device_hash(w, ns, d_sum, blocks));
  emit(out, "step", 0, device_hash(x, n, d_sum, blocks));

  for (unsigned long long s = 1; steps == 0 || s <= steps; s++) {
    step_kernel<<<blocks, 256>>>(x, n, s);
    CHECK(cudaGetLastError());
    emit(out, "step", s, device_hash(x, n, d_sum, blocks));
    if (hash_now) {
      hash_now = 0;
      emit(out, "now", s, device_hash(x, n, d_sum, blocks));
      if (w) emit(out, "static", 0, device_hash(w, ns, d_sum, blocks));
    }
    if (pause_ms > 0) sleep_ms(pause_ms);
    if (hash_now) {
      hash_now = 0;
      emit(out, "now", s, device_hash(x, n, d_sum, blocks));
      if (w) emit(out, "static", 0, device_hash(w, ns, d_sum, blocks));
    }
  }
  CHECK(cudaFree(x));
  CHECK(cudaFree(d_sum));
  return 0;
}
