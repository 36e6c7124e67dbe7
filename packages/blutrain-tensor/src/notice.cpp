// notice.cpp: one-time notices (notice.h).
#include "notice.h"

#include <cstdio>
#include <mutex>
#include <unordered_set>

namespace bt {

namespace {
std::mutex g_mu;
std::unordered_set<std::string>& seen() {                  // guarded by g_mu
  static auto* s = new std::unordered_set<std::string>();  // never destroyed: exit-safe
  return *s;
}
std::vector<std::string>& texts() {  // guarded by g_mu
  static auto* v = new std::vector<std::string>();
  return *v;
}
}  // namespace

bool notice_once(const std::string& key, const std::string& text) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!seen().insert(key).second) return false;
  texts().push_back(text);
  std::fprintf(stderr, "blutrain.tensor: %s\n", text.c_str());
  std::fflush(stderr);
  return true;
}

std::vector<std::string> notices() {
  std::lock_guard<std::mutex> lock(g_mu);
  return texts();
}

}  // namespace bt
