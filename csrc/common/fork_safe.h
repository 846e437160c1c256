// State a forked child inherits but must not tear down. A child made by fork() (a DataLoader
// worker, a multiprocessing pool) has a copy of every object of the parent and none of its
// threads; Python collects, in the child, what was garbage at the fork (reference cycles). A
// condition variable that a parent thread was waiting on is then destroyed there, and glibc's
// pthread_cond_destroy waits for that waiter, which never comes: the child hangs.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <memory>
#include <utility>

namespace fastddp {

// Owns a T on the heap; destroyed in the process that made it, it destroys the T, and in a
// forked child it leaves the T alone (the memory goes with the child).
template <typename T>
class ParentOnly {
 public:
  template <typename... Args>
  explicit ParentOnly(Args&&... args) : owner_(getpid()), value_(std::make_unique<T>(std::forward<Args>(args)...)) {}
  ~ParentOnly() {
    if (!in_owner()) (void)value_.release();
  }
  ParentOnly(const ParentOnly&) = delete;
  ParentOnly& operator=(const ParentOnly&) = delete;

  T& operator*() const { return *value_; }
  // Whether this is the process that made it (not a forked child).
  bool in_owner() const { return getpid() == owner_; }

 private:
  pid_t owner_;
  std::unique_ptr<T> value_;
};

}  // namespace fastddp
