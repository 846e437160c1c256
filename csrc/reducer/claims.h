// Which live reducers hook each parameter. torch DDP lets two wrappers of one module (a wrapper
// around a wrapper, or a second wrapper built while the first one's forward awaits its backward)
// both reduce a backward's gradients: each averages the same local values. fastddp's reducers
// reduce large gradients in place in .grad and lend .grad as views of their buckets, which two
// reducers at once would race on. So a reducer armed for a backward disarms the other reducers
// that hook one of its parameters and whose backward has not started (Reducer::
// yield_unstarted_reduction): each gradient is reduced once, to the average torch's two give.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace fastddp::reducer {

class Reducer;

namespace claims {

// `reducer` hooks `params` (called when it registers its hooks).
void add(const std::shared_ptr<Reducer>& reducer, const std::vector<at::Tensor>& params);
// `reducer` hooks nothing any more (its hooks were removed, or it is being destroyed).
void remove(const Reducer* reducer);
// The other live reducers hooking one of `reducer`'s parameters; empty at once (no lock) when no
// parameter of the process is hooked by two reducers.
std::vector<std::shared_ptr<Reducer>> sharing(const Reducer* reducer);

}  // namespace claims
}  // namespace fastddp::reducer
