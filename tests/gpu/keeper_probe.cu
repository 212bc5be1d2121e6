// Probe (issue 4, the <= 1 s leave-running pause): can device memory stay on the GPU across
// the driver's checkpoint/restore of a process when ANOTHER process holds it?
//
//   keeper_probe MODE GIB      MODE: fdonly | import
//
// A "workload" child (forked before any CUDA call) allocates GIB x 1 GiB with the VMM API and
// requestedHandleTypes = POSIX_FD, maps them into one reservation, fills them, exports one fd
// per allocation, sends the fds to the parent (SCM_RIGHTS), unmaps and releases everything
// but keeps the VA reservation, and waits. The parent (the "keeper") holds the fds
// (fdonly) or also imports them into its own context (import: then snapshots them D2D and
// copies the snapshot to the host while the child goes through the driver), runs the driver's
// lock + checkpoint + restore + unlock on the child, and sends the fds back. The child imports
// them, maps them at the SAME addresses and checks the contents. Every step is timed;
// the last line is "probe mode=M gib=G result=PASS|FAIL ...".
// Build: nvcc -O2 -o keeper_probe keeper_probe.cu -lcuda
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAXA 128
static const char *who = "parent";

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int check(CUresult r, const char *what) {
  if (r == CUDA_SUCCESS) return 0;
  const char *name = "?";
  cuGetErrorName(r, &name);
  printf("%s: %s failed: %s (%d)\n", who, what, name, (int)r);
  fflush(stdout);
  return 1;
}
#define TRY(call)                    \
  do {                               \
    if (check((call), #call)) exit(3); \
  } while (0)

static void send_fds(int sock, const int *fds, int n) {
  char byte = 'F';
  struct iovec iov = {&byte, 1};
  char ctl[CMSG_SPACE(sizeof(int) * MAXA)];
  memset(ctl, 0, sizeof ctl);
  struct msghdr m = {0};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = CMSG_SPACE(sizeof(int) * n);
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * n);
  memcpy(CMSG_DATA(c), fds, sizeof(int) * n);
  if (sendmsg(sock, &m, 0) != 1) { perror("sendmsg"); exit(3); }
}

static int recv_fds(int sock, int *fds) {
  char byte;
  struct iovec iov = {&byte, 1};
  char ctl[CMSG_SPACE(sizeof(int) * MAXA)];
  struct msghdr m = {0};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  if (recvmsg(sock, &m, 0) != 1) { perror("recvmsg"); exit(3); }
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  if (!c || c->cmsg_type != SCM_RIGHTS) { printf("%s: no fds received\n", who); exit(3); }
  int n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
  memcpy(fds, CMSG_DATA(c), sizeof(int) * n);
  return n;
}

static void say(int sock, char c) {
  if (write(sock, &c, 1) != 1) { perror("write"); exit(3); }
}
static char hear(int sock) {
  char c = 0;
  if (read(sock, &c, 1) != 1) { printf("%s: peer gone\n", who); exit(3); }
  return c;
}

static const size_t GIB = 1ull << 30;
static const size_t SAMPLE = 1ull << 20;

// The child: the workload.
static int workload(int sock, int n) {
  who = "child";
  CUdevice dev;
  CUcontext ctx;
  TRY(cuInit(0));
  TRY(cuDeviceGet(&dev, 0));
  TRY(cuDevicePrimaryCtxRetain(&ctx, dev));
  TRY(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUdeviceptr va;
  TRY(cuMemAddressReserve(&va, n * GIB, 0, 0, 0));
  CUmemGenericAllocationHandle h[MAXA];
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (int i = 0; i < n; i++) {
    TRY(cuMemCreate(&h[i], GIB, &prop, 0));
    TRY(cuMemMap(va + i * GIB, GIB, 0, h[i], 0));
  }
  TRY(cuMemSetAccess(va, n * GIB, &acc, 1));
  // Contents: each GiB a different word, and a 1 MiB random block at the start of each.
  unsigned char *rnd = (unsigned char *)malloc(SAMPLE * n);
  srand(42);
  for (size_t i = 0; i < SAMPLE * n; i++) rnd[i] = rand() & 0xff;
  for (int i = 0; i < n; i++) {
    TRY(cuMemsetD32(va + i * GIB, 0x5eed0000u + i, GIB / 4));
    TRY(cuMemcpyHtoD(va + i * GIB, rnd + i * SAMPLE, SAMPLE));
  }
  TRY(cuCtxSynchronize());
  size_t free0, total;
  TRY(cuMemGetInfo(&free0, &total));
  printf("child: filled %d GiB at va=0x%llx, device free %.1f GiB\n", n, (unsigned long long)va, free0 / 1073741824.0);

  double t0 = now_ms();
  int fds[MAXA];
  for (int i = 0; i < n; i++)
    TRY(cuMemExportToShareableHandle(&fds[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  double t_export = now_ms();
  send_fds(sock, fds, n);
  TRY(cuMemUnmap(va, n * GIB));
  for (int i = 0; i < n; i++) {
    TRY(cuMemRelease(h[i]));
    close(fds[i]);
  }
  double t_release = now_ms();
  size_t free1;
  TRY(cuMemGetInfo(&free1, &total));
  printf("child: export %.1f ms, unmap+release %.1f ms; device free after release %.1f GiB\n", t_export - t0,
         t_release - t_export, free1 / 1073741824.0);
  fflush(stdout);
  say(sock, 'R');
  // The parent runs the driver's cycle on this process now; it sends the fds back after.
  int got = recv_fds(sock, fds);
  double t_back = now_ms();
  if (got != n) { printf("child: got %d fds, want %d\n", got, n); return 1; }
  for (int i = 0; i < n; i++) {
    if (check(cuMemImportFromShareableHandle(&h[i], (void *)(uintptr_t)fds[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
              "import")) return 1;
    if (check(cuMemMap(va + i * GIB, GIB, 0, h[i], 0), "map at the same address")) return 1;
    close(fds[i]);
  }
  if (check(cuMemSetAccess(va, n * GIB, &acc, 1), "set access")) return 1;
  double t_mapped = now_ms();
  // Can memory imported from an fd be exported again (for the next keep)?
  int again = -1;
  CUresult rc = cuMemExportToShareableHandle(&again, h[0], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  const char *rc_name = "?";
  cuGetErrorName(rc, &rc_name);
  printf("child: export of an imported handle: %s\n", rc_name);
  if (rc == CUDA_SUCCESS) close(again);
  // Check: the random block and the word pattern at the end of each GiB.
  unsigned char *got_b = (unsigned char *)malloc(SAMPLE);
  uint32_t *tail = (uint32_t *)malloc(SAMPLE);
  int bad = 0;
  for (int i = 0; i < n; i++) {
    TRY(cuMemcpyDtoH(got_b, va + i * GIB, SAMPLE));
    if (memcmp(got_b, rnd + i * SAMPLE, SAMPLE)) bad++;
    TRY(cuMemcpyDtoH(tail, va + (i + 1) * GIB - SAMPLE, SAMPLE));
    for (size_t k = 0; k < SAMPLE / 4; k++)
      if (tail[k] != 0x5eed0000u + i) { bad++; break; }
  }
  // The memory is usable: write and read it again.
  TRY(cuMemsetD32(va, 0xabcdef01u, SAMPLE / 4));
  TRY(cuMemcpyDtoH(tail, va, SAMPLE));
  if (tail[7] != 0xabcdef01u) bad++;
  printf("child: import+map %d fds at the same addresses %.1f ms; contents %s (%d bad samples)\n", n, t_mapped - t_back,
         bad ? "DIFFER" : "exact", bad);
  fflush(stdout);
  say(sock, bad ? 'B' : 'G');
  return bad ? 1 : 0;
}

struct snap {
  CUcontext ctx;
  CUdeviceptr src;
  int n;
  double d2d_ms, d2h_ms;
  int rc;
};

// In the keeper: snapshot the held memory D2D, then copy the snapshot to the host through a
// pinned buffer (as the image copy-out would), while the workload goes through the driver.
static void *snapshot(void *arg) {
  struct snap *s = (struct snap *)arg;
  s->rc = 1;
  if (check(cuCtxSetCurrent(s->ctx), "snapshot ctx")) return NULL;
  CUdeviceptr copy;
  double t0 = now_ms();
  if (check(cuMemAlloc(&copy, s->n * GIB), "snapshot alloc")) return NULL;
  if (check(cuMemcpyDtoD(copy, s->src, s->n * GIB), "D2D")) return NULL;
  if (check(cuCtxSynchronize(), "D2D sync")) return NULL;
  double t1 = now_ms();
  void *pin;
  size_t piece = 256ull << 20;
  if (check(cuMemAllocHost(&pin, piece), "pinned")) return NULL;
  for (size_t off = 0; off < s->n * GIB; off += piece)
    if (check(cuMemcpyDtoH(pin, copy + off, piece), "D2H")) return NULL;
  double t2 = now_ms();
  cuMemFreeHost(pin);
  cuMemFree(copy);
  s->d2d_ms = t1 - t0;
  s->d2h_ms = t2 - t1;
  s->rc = 0;
  return NULL;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "import";
  int n = argc > 2 ? atoi(argv[2]) : 16;
  if (n < 1 || n > MAXA) return 2;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 2; }
  pid_t child = fork();
  if (child == 0) {
    close(sv[0]);
    _exit(workload(sv[1], n));
  }
  close(sv[1]);
  int sock = sv[0];
  int fds[MAXA];
  int got = recv_fds(sock, fds);
  if (hear(sock) != 'R') return 3;
  double t0 = now_ms();
  TRY(cuInit(0));
  struct snap s;
  memset(&s, 0, sizeof s);
  pthread_t th;
  int importing = !strcmp(mode, "import");
  CUmemGenericAllocationHandle h[MAXA];
  if (importing) {
    CUdevice dev;
    TRY(cuDeviceGet(&dev, 0));
    TRY(cuDevicePrimaryCtxRetain(&s.ctx, dev));
    TRY(cuCtxSetCurrent(s.ctx));
    CUdeviceptr va;
    TRY(cuMemAddressReserve(&va, got * GIB, 0, 0, 0));
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int i = 0; i < got; i++) {
      TRY(cuMemImportFromShareableHandle(&h[i], (void *)(uintptr_t)fds[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      TRY(cuMemMap(va + i * GIB, GIB, 0, h[i], 0));
    }
    TRY(cuMemSetAccess(va, got * GIB, &acc, 1));
    printf("parent: imported and mapped %d allocations in %.1f ms\n", got, now_ms() - t0);
    s.src = va;
    s.n = got;
    pthread_create(&th, NULL, snapshot, &s);
  }
  // The driver's cycle on the child, timed per call.
  CUcheckpointLockArgs la;
  memset(&la, 0, sizeof la);
  la.timeoutMs = 20000;
  CUcheckpointCheckpointArgs ca;
  memset(&ca, 0, sizeof ca);
  CUcheckpointRestoreArgs ra;
  memset(&ra, 0, sizeof ra);
  CUcheckpointUnlockArgs ua;
  memset(&ua, 0, sizeof ua);
  double a = now_ms();
  int fail = check(cuCheckpointProcessLock(child, &la), "cuCheckpointProcessLock");
  double b = now_ms();
  if (!fail) fail = check(cuCheckpointProcessCheckpoint(child, &ca), "cuCheckpointProcessCheckpoint");
  double c = now_ms();
  CUprocessState st = CU_PROCESS_STATE_FAILED;
  cuCheckpointProcessGetState(child, &st);
  if (!fail) fail = check(cuCheckpointProcessRestore(child, &ra), "cuCheckpointProcessRestore");
  double d = now_ms();
  if (!fail) fail = check(cuCheckpointProcessUnlock(child, &ua), "cuCheckpointProcessUnlock");
  double e = now_ms();
  printf("parent: driver lock %.1f ms, checkpoint %.1f ms (state then %d), restore %.1f ms, unlock %.1f ms\n", b - a,
         c - b, (int)st, d - c, e - d);
  if (importing) {
    pthread_join(th, NULL);
    printf("parent: snapshot D2D %.1f ms (%.1f GB/s), snapshot to host %.1f ms (%.1f GB/s), rc %d\n", s.d2d_ms,
           got * GIB / s.d2d_ms / 1e6, s.d2h_ms, got * GIB / s.d2h_ms / 1e6, s.rc);
  }
  double f = now_ms();
  send_fds(sock, fds, got);
  char verdict = hear(sock);
  double g = now_ms();
  if (importing) {
    // The child holds its own references now; the keeper lets go.
    for (int i = 0; i < got; i++) cuMemRelease(h[i]);
  }
  for (int i = 0; i < got; i++) close(fds[i]);
  int status = 0;
  waitpid(child, &status, 0);
  printf("probe mode=%s gib=%d result=%s driver_cycle_ms=%.0f back_ms=%.0f child_exit=%d\n", mode, n,
         (!fail && verdict == 'G' && WIFEXITED(status) && WEXITSTATUS(status) == 0) ? "PASS" : "FAIL", e - a, g - f,
         WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return 0;
}
