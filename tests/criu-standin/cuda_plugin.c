/*
 * A stand-in for NVIDIA's CRIU CUDA plugin (CRIU's plugins/cuda/cuda_plugin.c, installed
 * as cuda_plugin.so), for tests on machines without a GPU. It registers under the same
 * name, "cuda_plugin", and behaves as NVIDIA's does where `cuda-checkpoint` is not on
 * PATH (it ships in neither the driver nor the toolkit): init disables it, and every hook
 * answers -ENOTSUP. Each call is appended to $GPUCR_STANDIN_LOG, so a test sees that CRIU
 * loaded it next to gpucr's plugin and what it was asked.
 *
 * Built by tests/tests/gpu_fake.rs with the system C compiler; the descriptor is declared
 * here with the layout of CRIU 4.x's criu-plugin.h (version 0x200, 12 hooks).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HOOK_RESUME_DEVICES_LATE 9
#define HOOK_PAUSE_DEVICES 10
#define HOOK_CHECKPOINT_DEVICES 11
#define MAX_HOOKS 12

struct cr_plugin_desc {
	const char *name;
	int (*init)(int stage);
	void (*exit)(int stage, int ret);
	unsigned int version;
	unsigned int max_hooks;
	void *hooks[MAX_HOOKS];
};

static int disabled = 1;

static void note(const char *what, int arg)
{
	const char *path = getenv("GPUCR_STANDIN_LOG");
	FILE *f;

	if (!path)
		return;
	f = fopen(path, "a");
	if (!f)
		return;
	fprintf(f, "%s %d%s\n", what, arg, disabled ? " disabled" : "");
	fclose(f);
}

/* NVIDIA's plugin runs `cuda-checkpoint -h`; here: is it on PATH at all. */
static int cuda_checkpoint_on_path(void)
{
	const char *path = getenv("PATH");
	char buf[4096];
	const char *p;

	if (!path)
		return 0;
	for (p = path; *p;) {
		const char *end = strchr(p, ':');
		size_t len = end ? (size_t)(end - p) : strlen(p);

		if (len && len < sizeof(buf) - 20) {
			memcpy(buf, p, len);
			strcpy(buf + len, "/cuda-checkpoint");
			if (access(buf, X_OK) == 0)
				return 1;
		}
		if (!end)
			break;
		p = end + 1;
	}
	return 0;
}

static int standin_init(int stage)
{
	disabled = !cuda_checkpoint_on_path();
	note("init", stage);
	return 0;
}

static void standin_exit(int stage, int ret)
{
	(void)ret;
	note("exit", stage);
}

static int pause_devices(int pid)
{
	note("pause_devices", pid);
	return -ENOTSUP;
}

static int checkpoint_devices(int pid)
{
	note("checkpoint_devices", pid);
	return -ENOTSUP;
}

static int resume_devices_late(int pid)
{
	note("resume_devices_late", pid);
	return -ENOTSUP;
}

struct cr_plugin_desc CR_PLUGIN_DESC = {
	.name = "cuda_plugin",
	.init = standin_init,
	.exit = standin_exit,
	.version = 0x200,
	.max_hooks = MAX_HOOKS,
	.hooks = {
		[HOOK_RESUME_DEVICES_LATE] = resume_devices_late,
		[HOOK_PAUSE_DEVICES] = pause_devices,
		[HOOK_CHECKPOINT_DEVICES] = checkpoint_devices,
	},
};
