// Linked into optim's fused CPU kernel on Linux (setup.py), which links libstdc++ statically: the libstdc++.a of a
// toolchain on a newer glibc refers to glibc symbol versions that manylinux_2_28 (GLIBC_2.28) does not allow.
#include <pthread.h>

extern "C" {

// GLIBC_2.32, absent before. libstdc++ skips atomic reference counts where glibc says the process has one thread;
// 0 (it may have several) always counts atomically, as libstdc++ does under glibc before 2.32.
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

#ifdef OPTIM_WRAP_PTHREAD_ONCE
// pthread_once@GLIBC_2.34 (glibc 2.34 moved it from libpthread into libc): -Wl,--wrap=pthread_once sends every call
// here, to the same function at its first version, which every glibc has.
#if defined(__x86_64__)
#define OPTIM_GLIBC_FIRST "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define OPTIM_GLIBC_FIRST "GLIBC_2.17"
#else
#error "OPTIM_WRAP_PTHREAD_ONCE: no first glibc version known for this architecture"
#endif
int optim_pthread_once_first(pthread_once_t* once, void (*init)(void));
__asm__(".symver optim_pthread_once_first, pthread_once@" OPTIM_GLIBC_FIRST);
__attribute__((visibility("hidden"))) int __wrap_pthread_once(pthread_once_t* once, void (*init)(void)) {
  return optim_pthread_once_first(once, init);
}
#endif

}  // extern "C"
