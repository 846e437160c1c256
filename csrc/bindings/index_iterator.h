// The iterator type behind DistributedSampler.__iter__ (see index_iterator.cpp).
#pragma once

#include "bindings/registry.h"

namespace fastddp::bindings {

// Adds the type IndexIterator and the factory index_iterator(indices, start) to `m`.
void add_index_iterator(pybind11::module_& m);

}  // namespace fastddp::bindings
