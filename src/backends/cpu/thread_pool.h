// thread_pool.h: the cpu backend's OS threads, kept from one call to the next.
//
// Why not a thread per call: a fresh thread often started on the core of the thread that
// created it and waited there until the scheduler moved it, a few ms on calls of 5 to 15 ms
// (measured: two-thread forwards at N = 1024 used 1.3 of the 2 cores). A parked thread
// wakes where it last ran, which is the idle core.
#pragma once

#include <functional>

namespace pyfa_cpu {

// Runs job(t) for t = 0, 1, ..., up to n - 1 concurrently and returns when every one has
// returned: job(0) on the calling thread, the others on the pool's threads (or on threads
// started for this call when another call holds the pool). Fewer than n may run when
// threads cannot be started; the job must not depend on how many do. Returns how many ran.
// An exception thrown by a job(t) on another thread is rethrown here after all returned.
int run_on_threads(int n, const std::function<void(int t)>& job);

}  // namespace pyfa_cpu
