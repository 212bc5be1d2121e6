/* gpucr GPU end-to-end: drives the CUDA driver's checkpoint API on another process by hand,
 * for the stock (runc + CRIU) comparison runs. No cuda.h: the few declarations are our own.
 *
 *   drive ACTION... PID      ACTION: state lock checkpoint restore unlock
 *                            quiesce (= lock checkpoint)  resume (= restore unlock)
 *   e.g. drive quiesce 1234; drive state 1234
 * Each action prints "drive: ACTION pid=P rc=R ms=T state=S" and the program stops at the
 * first failure (exit 1). Lock timeout: $DRIVE_LOCK_TIMEOUT_MS (default 10000).
 * Build: gcc -O2 -o drive drive.c -ldl
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int cu_result;
/* Every checkpoint args struct is 64 bytes; reserved fields must be zero. */
typedef struct {
  unsigned int timeout_ms;
  unsigned int reserved0;
  uint64_t reserved1[7];
} lock_args;
typedef struct {
  uint64_t reserved[8];
} plain_args;

typedef cu_result (*fn_init)(unsigned int);
typedef cu_result (*fn_state)(int, int *);
typedef cu_result (*fn_lock)(int, lock_args *);
typedef cu_result (*fn_args)(int, plain_args *);
typedef cu_result (*fn_errstr)(cu_result, const char **);

static fn_init cu_init;
static fn_state get_state;
static fn_lock do_lock;
static fn_args do_checkpoint, do_restore, do_unlock;
static fn_errstr err_name;

static const char *state_name(int s) {
  switch (s) {
    case 0: return "running";
    case 1: return "locked";
    case 2: return "checkpointed";
    case 3: return "failed";
    default: return "unknown";
  }
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void *need(void *lib, const char *name) {
  void *f = dlsym(lib, name);
  if (!f) {
    fprintf(stderr, "drive: libcuda.so.1 has no %s (driver r570+ needed)\n", name);
    exit(2);
  }
  return f;
}

static int run(const char *action, int pid) {
  cu_result rc;
  double t0 = now_ms();
  if (strcmp(action, "state") == 0) {
    rc = 0;
  } else if (strcmp(action, "lock") == 0) {
    lock_args a;
    const char *t = getenv("DRIVE_LOCK_TIMEOUT_MS");
    memset(&a, 0, sizeof(a));
    a.timeout_ms = t ? (unsigned int)strtoul(t, NULL, 10) : 10000;
    rc = do_lock(pid, &a);
  } else {
    plain_args a;
    memset(&a, 0, sizeof(a));
    if (strcmp(action, "checkpoint") == 0) {
      rc = do_checkpoint(pid, &a);
    } else if (strcmp(action, "restore") == 0) {
      rc = do_restore(pid, &a);
    } else if (strcmp(action, "unlock") == 0) {
      rc = do_unlock(pid, &a);
    } else {
      fprintf(stderr, "drive: unknown action %s\n", action);
      exit(2);
    }
  }
  double ms = now_ms() - t0;
  int st = -1;
  cu_result src = get_state(pid, &st);
  const char *ename = NULL;
  if (rc != 0 && err_name) err_name(rc, &ename);
  /* Fields: drive: ACTION pid=P rc=R ms=T state=S [error=NAME] */
  printf("drive: %s pid=%d rc=%d ms=%.1f state=%s%s%s\n", action, pid, rc, ms,
         src == 0 ? state_name(st) : "unknown", ename ? " error=" : "", ename ? ename : "");
  fflush(stdout);
  return rc;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s ACTION... PID\n", argv[0]);
    return 2;
  }
  int pid = atoi(argv[argc - 1]);
  if (pid <= 0) {
    fprintf(stderr, "drive: bad pid %s\n", argv[argc - 1]);
    return 2;
  }
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "drive: dlopen libcuda.so.1: %s\n", dlerror());
    return 2;
  }
  cu_init = (fn_init)dlsym(lib, "cuInit");
  err_name = (fn_errstr)dlsym(lib, "cuGetErrorName");
  get_state = (fn_state)need(lib, "cuCheckpointProcessGetState");
  do_lock = (fn_lock)need(lib, "cuCheckpointProcessLock");
  do_checkpoint = (fn_args)need(lib, "cuCheckpointProcessCheckpoint");
  do_restore = (fn_args)need(lib, "cuCheckpointProcessRestore");
  do_unlock = (fn_args)need(lib, "cuCheckpointProcessUnlock");

  for (int i = 1; i < argc - 1; i++) {
    const char *a = argv[i];
    const char *seq[3] = {a, NULL, NULL};
    if (strcmp(a, "quiesce") == 0) {
      seq[0] = "lock";
      seq[1] = "checkpoint";
    } else if (strcmp(a, "resume") == 0) {
      seq[0] = "restore";
      seq[1] = "unlock";
    }
    for (int j = 0; seq[j]; j++) {
      /* The driver documents that restore needs persistence mode or cuInit in the caller. */
      if (strcmp(seq[j], "restore") == 0 && cu_init) cu_init(0);
      if (run(seq[j], pid) != 0) return 1;
    }
  }
  return 0;
}
