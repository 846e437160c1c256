// Fingerprint values, their comparison and the message that explains a mismatch.
#include "reducer/fingerprint.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <map>
#include <sstream>

namespace fastddp::reducer {

uint64_t fp_mix(uint64_t h, int64_t v) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((static_cast<uint64_t>(v) >> (8 * i)) & 0xff)) * 1099511628211ULL;
  return h;
}

bool fingerprints_differ(const std::vector<Fingerprint>& per_rank) {
  const Fingerprint* first = nullptr;
  for (const auto& f : per_rank) {
    if (f.is_wildcard()) continue;
    if (!first) {
      first = &f;
    } else if (f.words != first->words) {
      return true;
    }
  }
  return false;
}

int64_t packed_detail_words(int64_t params) { return kFingerprintWords + 3 * params; }

std::vector<int64_t> pack_detail(const DesyncDetail& d) {
  const int64_t n = static_cast<int64_t>(d.requires_grad.size());
  std::vector<int64_t> out(d.fingerprint.words.begin(), d.fingerprint.words.end());
  out.reserve(packed_detail_words(n));
  for (const auto* bits : {&d.requires_grad, &d.missing, &d.unused})
    for (int64_t i = 0; i < n; ++i) out.push_back(i < static_cast<int64_t>(bits->size()) ? (*bits)[i] : 0);
  return out;
}

DesyncDetail unpack_detail(const int64_t* words, int64_t params) {
  DesyncDetail d;
  std::copy(words, words + kFingerprintWords, d.fingerprint.words.begin());
  words += kFingerprintWords;
  for (auto* bits : {&d.requires_grad, &d.missing, &d.unused}) {
    bits->assign(static_cast<size_t>(params), 0);
    for (int64_t i = 0; i < params; ++i) (*bits)[i] = words[i] != 0;
    words += params;
  }
  return d;
}

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t k = 0; k < ranks.size(); ++k) out += (k ? ", " : "") + std::to_string(ranks[k]);
  return out;
}

// "rank 1 <verb> <value 1>, ranks 0, 2 <value 0>": the ranks grouped by a value, the smallest
// group (the odd one out) first, equal sizes in rank order.
template <typename Describe>
std::string by_value(const std::vector<int>& ranks, const std::vector<int64_t>& values, Describe describe) {
  std::map<int64_t, std::vector<int>> groups;
  for (int r : ranks) groups[values[r]].push_back(r);
  std::vector<std::pair<int64_t, std::vector<int>>> ordered(groups.begin(), groups.end());
  std::stable_sort(ordered.begin(), ordered.end(),
                   [](const auto& a, const auto& b) {
                     return a.second.size() != b.second.size() ? a.second.size() < b.second.size()
                                                                : a.second.front() < b.second.front();
                   });
  std::string out;
  for (size_t k = 0; k < ordered.size(); ++k)
    out += (k ? ", " : "") + rank_list(ordered[k].second) + " " + describe(ordered[k].first, k == 0);
  return out;
}

// Parameters whose bit is set on some compared ranks but not all, grouped by the ranks it is
// set on: "rank 1: c.weight, c.bias; rank 2: d.weight".
std::vector<std::pair<std::vector<int>, std::string>> odd_parameters(const std::vector<DesyncDetail>& d,
                                                                     const std::vector<int>& ranks,
                                                                     std::vector<char> DesyncDetail::*bits,
                                                                     const std::vector<std::string>& names) {
  std::map<std::vector<int>, std::pair<std::string, int>> groups;  // ranks -> (names, count)
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<int> set;
    for (int r : ranks)
      if ((d[r].*bits)[i]) set.push_back(r);
    if (set.empty() || set.size() == ranks.size()) continue;
    auto& g = groups[set];
    if (g.second++ < 8) g.first += (g.first.empty() ? "" : ", ") + names[i];
  }
  std::vector<std::pair<std::vector<int>, std::string>> out;
  for (auto& [set, g] : groups)
    out.emplace_back(set, g.first + (g.second > 8 ? " and " + std::to_string(g.second - 8) + " more" : ""));
  return out;
}

std::string odd_list(const std::vector<std::pair<std::vector<int>, std::string>>& groups, const char* where) {
  std::string out;
  for (const auto& [set, list] : groups)
    out += (out.empty() ? "" : "; ") + list + " " + where + " " + rank_list(set) + " only";
  return out;
}

std::string autocast_name(int64_t v) {
  if (v == 0) return "no autocast";
  const auto dtype = static_cast<c10::ScalarType>(v - 1);
  const char* name = dtype == c10::kBFloat16 ? "bfloat16"
                     : dtype == c10::kHalf   ? "float16"
                     : dtype == c10::kFloat  ? "float32"
                     : dtype == c10::kDouble ? "float64"
                                             : c10::toString(dtype);
  return std::string("autocast(") + name + ")";
}

}  // namespace

std::string explain_desync(const std::vector<DesyncDetail>& d, const std::vector<std::string>& names,
                           bool find_unused) {
  std::vector<int> ranks, joined;
  for (int r = 0; r < static_cast<int>(d.size()); ++r) (d[r].fingerprint.is_wildcard() ? joined : ranks).push_back(r);
  auto word = [&](int w) {
    std::vector<int64_t> v(d.size(), 0);
    for (int r : ranks) v[r] = d[r].fingerprint.words[w];
    return v;
  };
  auto differs = [&](int w) {
    const auto v = word(w);
    for (int r : ranks)
      if (v[r] != v[ranks.front()]) return true;
    return false;
  };
  std::vector<std::string> parts;
  if (differs(kFpStep)) {
    parts.push_back(by_value(ranks, word(kFpStep), [](int64_t v, bool) {
      return "is at reducing step " + std::to_string(v + 1);
    }) + " (a rank ran more or fewer training steps than the others: give every rank the same number of "
         "batches, or wrap the loop in model.join() for uneven inputs)");
  }
  if (differs(kFpRequiresGrad)) {
    std::vector<int64_t> counts(d.size(), 0);
    for (int r : ranks) counts[r] = std::count(d[r].requires_grad.begin(), d[r].requires_grad.end(), 1);
    parts.push_back("requires_grad differs: " + by_value(ranks, counts, [](int64_t v, bool) {
      return "reduces " + std::to_string(v) + " parameters";
    }) + " (" + odd_list(odd_parameters(d, ranks, &DesyncDetail::requires_grad, names), "requires grad on") +
                    "); change requires_grad on every rank alike, then wrap the model again");
  }
  if (differs(kFpMissing)) {
    for (const auto& [set, list] : odd_parameters(d, ranks, &DesyncDetail::missing, names))
      parts.push_back(rank_list(set) + " produced no gradient for " + list + " (unused on " + rank_list(set) +
                      " only" + (find_unused ? ")" : "; if parameters are legitimately unused in some iterations, "
                                                     "pass find_unused_parameters=True)"));
  }
  if (differs(kFpNoSync)) {
    parts.push_back(by_value(ranks, word(kFpNoSync), [](int64_t v, bool) {
      return v == 0 ? std::string("ran none") : "ran " + std::to_string(v) + " step" + (v == 1 ? "" : "s");
    }) + " under no_sync() before this reduction (every rank must accumulate the same number of "
         "micro-batches between reductions)");
  }
  if (differs(kFpAutocast)) {
    parts.push_back(by_value(ranks, word(kFpAutocast), [](int64_t v, bool) { return "runs " + autocast_name(v); }) +
                    " in the reducing forward (enter the same torch.autocast context on every rank)");
  }
  if (differs(kFpUnused)) {
    parts.push_back("the forward used different parameters (find_unused_parameters=True, with the used set "
                    "compared): " + odd_list(odd_parameters(d, ranks, &DesyncDetail::unused, names), "unused on") +
                    "; set FASTDDP_FINGERPRINT=1 if ranks may legitimately use different parameters");
  }
  if (differs(kFpBuckets) || differs(kFpLayout)) {
    parts.push_back("the bucket layouts differ: " + by_value(ranks, word(kFpBuckets), [](int64_t v, bool) {
      return "has " + std::to_string(v) + " buckets";
    }) + " (the wrapped models differ; build the same model on every rank)");
  }
  if (parts.empty() && differs(kFpSeq)) {
    parts.push_back(by_value(ranks, word(kFpSeq), [](int64_t v, bool) {
      return "issued " + std::to_string(v) + " bucket all-reduces";
    }) + " (the ranks issued different collectives before this reduction)");
  }
  if (parts.empty()) parts.push_back("the ranks' reductions do not match (no detail differs; a rank issued a "
                                     "different collective)");
  std::ostringstream msg;
  msg << "DDPWrapper: the ranks are out of step in this gradient reduction";
  if (!ranks.empty() && !differs(kFpStep))
    msg << " (reducing step " << d[ranks.front()].fingerprint.words[kFpStep] + 1 << ")";
  msg << ": ";
  for (size_t k = 0; k < parts.size(); ++k) msg << (k ? "; " : "") << parts[k];
  if (!joined.empty()) msg << "; " << rank_list(joined) << (joined.size() == 1 ? " has" : " have")
                           << " joined (uneven inputs) and stand" << (joined.size() == 1 ? "s" : "") << " in";
  msg << ". Every rank raises this error. FASTDDP_FINGERPRINT=0 turns the check off.";
  return msg.str();
}

}  // namespace fastddp::reducer
