/* Diagnostic preload for gpu_diag.py: on SIGSEGV/SIGABRT prints the native stack as
 * "library +offset (symbol)" lines (addr2line turns offsets into source lines), then exits. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig, siginfo_t* si, void* ctx) {
  (void)ctx;
  char buf[1024];
  int len = snprintf(buf, sizeof buf, "NATIVE FAULT signal %d at address %p\n", sig, si->si_addr);
  write(2, buf, (size_t)len);
  void* frames[64];
  int n = backtrace(frames, 64);
  for (int i = 0; i < n; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) && info.dli_fname) {
      len = snprintf(buf, sizeof buf, "  #%d %s +0x%lx (%s)\n", i, info.dli_fname,
                     (unsigned long)((char*)frames[i] - (char*)info.dli_fbase),
                     info.dli_sname ? info.dli_sname : "?");
    } else {
      len = snprintf(buf, sizeof buf, "  #%d %p\n", i, frames[i]);
    }
    write(2, buf, (size_t)len);
  }
  _exit(139);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
