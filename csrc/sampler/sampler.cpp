#include "sampler/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randperm.h>
#include <c10/util/Exception.h>

#include <limits>

namespace fastddp::sampler {
namespace {

// Grain for at::parallel_for: big enough that thread start-up is amortised.
constexpr int64_t kGrain = 1 << 15;

// ---- stateless order: a keyed bijection of [0, 2^bits) with cycle walking ----
// Each round is a composition of bijections of Z/2^bits (xor with a key, multiply by an odd
// number, xorshift within the width), so the whole map is a bijection of the power-of-two
// domain; cycle walking (re-applying it until the value lands below `length`) turns that
// into a bijection of [0, length). With bits = ceil(log2(length)) the domain is under twice
// the length, so fewer than two applications are needed per index on average.
inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser: a strong 64-bit mixer for keys
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

class HashPermutation {
 public:
  HashPermutation(int64_t length, uint64_t key) : length_(static_cast<uint64_t>(length)) {
    int bits = 1;
    while (bits < 64 && (uint64_t{1} << bits) < length_) ++bits;
    bits_ = bits;
    mask_ = bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
    shift_ = bits_ / 2 + 1;
    for (int r = 0; r < kRounds; ++r) {
      xor_keys_[r] = mix64(key + 0x9e3779b97f4a7c15ULL * (2 * r + 1)) & mask_;
      multipliers_[r] = mix64(key + 0x9e3779b97f4a7c15ULL * (2 * r + 2)) | 1;  // odd
    }
  }

  uint64_t operator()(uint64_t x) const {
    do {
      x = encrypt(x);
    } while (x >= length_);
    return x;
  }

 private:
  static constexpr int kRounds = 4;

  uint64_t encrypt(uint64_t x) const {
    for (int r = 0; r < kRounds; ++r) {
      x ^= xor_keys_[r];
      x = (x * multipliers_[r]) & mask_;
      x ^= x >> shift_;
      x = (x * 0x2545f4914f6cdd1dULL) & mask_;
      x ^= x >> (shift_ > 2 ? shift_ - 2 : 1);
    }
    return x;
  }

  uint64_t length_;
  int bits_ = 1;
  uint64_t mask_ = 1;
  int shift_ = 1;
  uint64_t xor_keys_[kRounds] = {};
  uint64_t multipliers_[kRounds] = {};
};

template <typename perm_t>
void gather_strided(const perm_t* perm, int64_t* out, int64_t count, int64_t rank,
                    int64_t replicas, int64_t length) {
  // Position p of the padded epoch holds perm[p % length]: torch pads by wrapping the list
  // around (as often as needed when length < replicas), and truncation never reaches it.
  at::parallel_for(0, count, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = static_cast<int64_t>(perm[(rank + i * replicas) % length]);
  });
}

}  // namespace

int64_t num_samples(int64_t length, int64_t replicas, bool drop_last) {
  if (drop_last && length % replicas != 0) {
    // torch: ceil((length - replicas) / replicas), which is 0 or less when length < replicas
    const int64_t num = length - replicas;
    return num <= 0 ? 0 : (num + replicas - 1) / replicas;
  }
  return (length + replicas - 1) / replicas;
}

at::Tensor epoch_indices(const Plan& plan) {
  TORCH_CHECK(plan.length >= 0, "DistributedSampler: dataset length must be >= 0, got ", plan.length);
  TORCH_CHECK(plan.replicas > 0, "DistributedSampler: num_replicas must be > 0, got ", plan.replicas);
  TORCH_CHECK(plan.rank >= 0 && plan.rank < plan.replicas, "DistributedSampler: rank must be in [0, ",
              plan.replicas, "), got ", plan.rank);
  const int64_t count = num_samples(plan.length, plan.replicas, plan.drop_last);
  at::Tensor out = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  if (count == 0) return out;
  int64_t* dst = out.data_ptr<int64_t>();
  const int64_t n = plan.length;

  if (!plan.shuffle) {
    at::parallel_for(0, count, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dst[i] = (plan.rank + i * plan.replicas) % n;
    });
    return out;
  }

  if (plan.order == Order::kStateless) {
    const HashPermutation perm(n, mix64(static_cast<uint64_t>(plan.seed)) ^
                                         mix64(static_cast<uint64_t>(plan.epoch) + 0x632be59bd9b4e019ULL));
    at::parallel_for(0, count, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        dst[i] = static_cast<int64_t>(perm(static_cast<uint64_t>((plan.rank + i * plan.replicas) % n)));
    });
    return out;
  }

  // torch order: torch.randperm(n, generator=Generator().manual_seed(seed + epoch)). manual_seed
  // takes seed + epoch modulo 2^64, which unsigned addition of the two bit patterns gives
  // without signed overflow. The permutation depends only on the generator's draws, not on
  // the output dtype, so int32 halves the memory of the one full-size tensor whenever the
  // indices fit.
  const uint64_t torch_seed = static_cast<uint64_t>(plan.seed) + static_cast<uint64_t>(plan.epoch);
  auto gen = at::detail::createCPUGenerator(torch_seed);
  const bool narrow = n <= std::numeric_limits<int32_t>::max();
  at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(narrow ? at::kInt : at::kLong));
  if (narrow) {
    gather_strided(perm.data_ptr<int32_t>(), dst, count, plan.rank, plan.replicas, n);
  } else {
    gather_strided(perm.data_ptr<int64_t>(), dst, count, plan.rank, plan.replicas, n);
  }
  return out;
}

}  // namespace fastddp::sampler
