// The fingerprint every reduction of the DDPWrapper carries: what this rank believes the
// reduction is (which reducing step, which bucket layout, which parameters, how many no_sync
// steps before it, under which autocast). Ranks compare fingerprints as a by-product of the
// reduction itself, beside the last bucket (launched only once every gradient of the backward
// arrived): a slot per rank in the shared-memory mapping; on the process group, a slot per rank
// in a header after a CPU fp32/fp64 bucket's gradients, gathered by the bucket's own SUM, else
// one small MAX all-reduce over (f, -f). A desynchronised rank is named in one error on every
// rank instead of training on silently mismatched gradients or hanging.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace fastddp::reducer {

enum FingerprintWord : int {
  kFpStep = 0,      // reductions this reducer took part in before this one (joined stand-ins too)
  kFpBuckets,       // number of buckets
  kFpLayout,        // hash of the buckets' parameters (shapes, dtypes) in bucket order
  kFpRequiresGrad,  // hash of which reduced parameters require grad now
  kFpUnused,        // find_unused_parameters with the used set compared: hash of the unused set
  kFpNoSync,        // forwards under no_sync() since the last reduction
  kFpAutocast,      // the reducing forward's autocast: 0 off, else 1 + dtype
  kFpMissing,       // hash of the parameters that got no gradient in this backward (0: none)
  kFpSeq,           // bucket collectives this reducer issued before this reduction
  kFingerprintWords
};

// Values stay within 62 bits, so -x is representable and MAX over (x, -x) gives max and min;
// a rank that stands in for the others (join()) contributes kFpWildcard, below every value.
constexpr int64_t kFpMask = (int64_t{1} << 62) - 1;
constexpr int64_t kFpWildcard = std::numeric_limits<int64_t>::min();

struct Fingerprint {
  std::array<int64_t, kFingerprintWords> words{};
  static Fingerprint wildcard() {
    Fingerprint f;
    f.words.fill(kFpWildcard);
    return f;
  }
  bool is_wildcard() const { return words[0] == kFpWildcard; }
};

// FNV-1a over 64-bit values, masked to kFpMask.
uint64_t fp_mix(uint64_t h, int64_t v);
constexpr uint64_t kFpSeed = 1469598103934665603ULL;
inline int64_t fp_finish(uint64_t h) { return static_cast<int64_t>(h & static_cast<uint64_t>(kFpMask)); }

// Whether the non-wildcard fingerprints differ.
bool fingerprints_differ(const std::vector<Fingerprint>& per_rank);

// What each rank tells the others once fingerprints differ (gathered on the error path only):
// its fingerprint and, per reduced parameter, whether it requires grad, got no gradient in
// this backward, and was unused in the reducing forward (find_unused_parameters).
struct DesyncDetail {
  Fingerprint fingerprint;
  std::vector<char> requires_grad;
  std::vector<char> missing;
  std::vector<char> unused;
};

// Packs a detail into int64 words (for an all_gather) and back.
std::vector<int64_t> pack_detail(const DesyncDetail& d);
DesyncDetail unpack_detail(const int64_t* words, int64_t params);
int64_t packed_detail_words(int64_t params);

// One message saying how the ranks differ, naming ranks and parameters; `names` are the
// reduced parameters' names. Ranks with a wildcard fingerprint are reported as joined.
std::string explain_desync(const std::vector<DesyncDetail>& per_rank, const std::vector<std::string>& names,
                           bool find_unused);

}  // namespace fastddp::reducer
