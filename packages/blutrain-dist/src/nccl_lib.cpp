// nccl_lib.cpp: dlopen of libnccl (see nccl_lib.h) and the error messages of failed calls.
#include "nccl_lib.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace bt::dist {
namespace {
std::mutex g_mutex;  // guards everything below
std::vector<std::string> g_candidates;
nccl::Funcs g_funcs;
bool g_loaded = false;
std::string g_error, g_path;

void load_locked() {
  if (g_loaded || !g_error.empty()) return;
  std::vector<std::string> paths;
  if (const char* env = std::getenv("BLUTRAIN_NCCL_LIBRARY"); env && *env) paths.push_back(env);
  paths.insert(paths.end(), g_candidates.begin(), g_candidates.end());
  paths.push_back("libnccl.so.2");
  std::string tried;
  void* h = nullptr;
  for (const auto& p : paths) {
    // RTLD_GLOBAL: NCCL's plugins (net, tuner) resolve symbols from the loaded library.
    h = dlopen(p.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (h) {
      g_path = p;
      break;
    }
    const char* e = dlerror();
    tried += "\n  " + p + ": " + (e ? e : "not found");
  }
  if (!h) {
    g_error =
        "libnccl could not be loaded (pip install nvidia-nccl-cu13, or set "
        "BLUTRAIN_NCCL_LIBRARY to the file). Tried:" +
        tried;
    return;
  }
#define BT_NCCL_SYM(name)                                                   \
  g_funcs.name = reinterpret_cast<decltype(g_funcs.name)>(dlsym(h, #name)); \
  if (!g_funcs.name) {                                                      \
    g_error = "the NCCL library " + g_path + " lacks " #name;               \
    return;                                                                 \
  }
  BT_NCCL_FUNCS(BT_NCCL_SYM)
#undef BT_NCCL_SYM
  g_funcs.ncclGetLastError =
      reinterpret_cast<decltype(g_funcs.ncclGetLastError)>(dlsym(h, "ncclGetLastError"));
  g_funcs.ncclCommFinalize =
      reinterpret_cast<decltype(g_funcs.ncclCommFinalize)>(dlsym(h, "ncclCommFinalize"));
  g_loaded = true;
}
}  // namespace

void nccl_set_candidates(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_candidates = paths;
}

std::string nccl_library_path() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_path;
}

namespace nccl {

const Funcs& lib(const char* op) {
  std::lock_guard<std::mutex> lock(g_mutex);
  load_locked();
  if (!g_loaded) fail(BT_DIST_ENCCL, std::string("[") + op + "] " + g_error);
  return g_funcs;
}

void throw_nccl_error(const char* op, const char* expr, ncclResult_t r, const char* file,
                      int line) {
  const Funcs& f = g_funcs;  // loaded: the failing call came from it
  std::string msg = std::string("[") + op + "] NCCL error " + std::to_string(int(r)) + " (" +
                    (f.ncclGetErrorString ? f.ncclGetErrorString(r) : "?") + ")";
  if (f.ncclGetLastError) {
    const char* last = f.ncclGetLastError(nullptr);
    if (last && *last) msg += ": " + std::string(last);
  }
  msg += " in " + std::string(expr) + " at " + file + ":" + std::to_string(line);
  fail(BT_DIST_ENCCL, msg);
}

void throw_cuda_error(const char* op, const char* expr, cudaError_t e, const char* file, int line) {
  cudaGetLastError();  // clear a sticky-less error so the next call starts clean
  fail(BT_DIST_ECUDA, std::string("[") + op + "] CUDA error " + cudaGetErrorName(e) + " (" +
                          cudaGetErrorString(e) + ") in " + expr + " at " + file + ":" +
                          std::to_string(line));
}

}  // namespace nccl

int nccl_version() {
  int v = 0;
  BT_NCCL_CHECK("nccl_version", nccl::lib("nccl_version").ncclGetVersion(&v));
  return v;
}

}  // namespace bt::dist
