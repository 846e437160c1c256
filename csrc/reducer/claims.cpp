#include "reducer/claims.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace fastddp::reducer::claims {

namespace {

struct Registry {
  std::mutex mutex;
  // parameter -> the reducers hooking it
  std::unordered_map<const c10::TensorImpl*, std::vector<std::pair<const Reducer*, std::weak_ptr<Reducer>>>> by_param;
  // reducer -> its parameters
  std::unordered_map<const Reducer*, std::vector<const c10::TensorImpl*>> by_reducer;
  std::atomic<int64_t> contested{0};  // parameters hooked by more than one reducer
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: reducers may outlive static destruction
  return *r;
}

}  // namespace

void add(const std::shared_ptr<Reducer>& reducer, const std::vector<at::Tensor>& params) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& mine = r.by_reducer[reducer.get()];
  for (const auto& p : params) {
    const auto* impl = p.unsafeGetTensorImpl();
    auto& holders = r.by_param[impl];
    holders.emplace_back(reducer.get(), reducer);
    if (holders.size() == 2) ++r.contested;
    mine.push_back(impl);
  }
}

void remove(const Reducer* reducer) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_reducer.find(reducer);
  if (it == r.by_reducer.end()) return;
  for (const auto* impl : it->second) {
    auto& holders = r.by_param[impl];
    holders.erase(std::remove_if(holders.begin(), holders.end(),
                                 [reducer](const auto& h) { return h.first == reducer; }),
                  holders.end());
    if (holders.size() == 1) --r.contested;
    if (holders.empty()) r.by_param.erase(impl);
  }
  r.by_reducer.erase(it);
}

std::vector<std::shared_ptr<Reducer>> sharing(const Reducer* reducer) {
  auto& r = registry();
  std::vector<std::shared_ptr<Reducer>> out;
  if (r.contested.load() == 0) return out;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.by_reducer.find(reducer);
    if (it == r.by_reducer.end()) return out;
    for (const auto* impl : it->second)
      for (const auto& [other, weak] : r.by_param[impl])
        if (other != reducer) out.push_back(weak.lock());  // kept: a last reference dies unlocked
  }
  out.erase(std::remove(out.begin(), out.end(), nullptr), out.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace fastddp::reducer::claims
