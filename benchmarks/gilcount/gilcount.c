/* Counts the GIL hand-overs of each thread: an LD_PRELOAD shim over PyEval_SaveThread, which every extension's
 * Py_BEGIN_ALLOW_THREADS / pybind11 gil_scoped_release calls through the PLT (libpython's own calls do not pass
 * here: os.pwrite and time.sleep are not counted). Built and used by benchmarks/gilcalls.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void *(*save_t)(void);
static save_t real_save;
static atomic_long counts[1 << 16];

void *PyEval_SaveThread(void) {
    if (!real_save)
        real_save = (save_t)dlsym(RTLD_NEXT, "PyEval_SaveThread");
    atomic_fetch_add(&counts[syscall(SYS_gettid) & 0xffff], 1);
    return real_save();
}

long gilcount_of(long tid) { return atomic_load(&counts[tid & 0xffff]); }
