// thread_pool.cpp: run_on_threads (thread_pool.h). One pool per process: its threads park
// on a condition variable between calls. A forked child has none of its parent's threads,
// so it builds a pool of its own; at unload the idle threads are stopped and joined.
#include "backends/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

namespace pyfa_cpu {

namespace {

// Requests for more threads than this start the extra ones for the call alone.
constexpr int kMostPooled = 256;

using Job = std::function<void(int)>;

// Runs job(0) on the caller and job(t), 0 < t < n, on threads started now; returns how
// many ran (the caller included), with the first exception any of them threw in *err.
int run_on_fresh_threads(int n, const Job& job, std::exception_ptr* err) {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(static_cast<size_t>(std::max(n, 1)));
    for (int t = 1; t < n; ++t) {
        try {
            threads.emplace_back([&job, &errors, t] {
                try {
                    job(t);
                } catch (...) {
                    errors[static_cast<size_t>(t)] = std::current_exception();
                }
            });
        } catch (const std::exception&) {
            break;  // fewer threads: the same results, later
        }
    }
    try {
        job(0);
    } catch (...) {
        errors[0] = std::current_exception();
    }
    for (std::thread& th : threads) th.join();
    for (const std::exception_ptr& e : errors)
        if (e && !*err) *err = e;
    return static_cast<int>(threads.size()) + 1;
}

class Pool {
public:
    explicit Pool(pid_t pid) : pid_(pid) {}
    const pid_t pid_;

    // Runs the call on the pool's threads; false, with nothing run, when another call
    // holds the pool.
    bool try_run(int n, const Job& job, int* ran) {
        std::unique_lock<std::mutex> call(busy_, std::try_to_lock);
        if (!call.owns_lock()) return false;
        int helpers = 0;
        {
            std::lock_guard<std::mutex> lk(m_);
            try {
                threads_.reserve(static_cast<size_t>(n - 1));
                // A thread's first generation is passed in: started now, it must not take
                // the one this call is about to publish for its own start.
                while (static_cast<int>(threads_.size()) < n - 1)
                    threads_.emplace_back(&Pool::loop, this, static_cast<int>(threads_.size()) + 1, generation_);
            } catch (const std::exception&) {
                // fewer threads: the same results, later
            }
            helpers = std::min(n - 1, static_cast<int>(threads_.size()));
            job_ = &job;
            wanted_ = helpers + 1;
            pending_ = helpers;
            error_ = nullptr;
            ++generation_;
        }
        if (helpers > 0) wake_.notify_all();
        std::exception_ptr err;
        try {
            job(0);
        } catch (...) {
            err = std::current_exception();
        }
        {
            std::unique_lock<std::mutex> lk(m_);
            done_.wait(lk, [this] { return pending_ == 0; });
            job_ = nullptr;
            if (!err) err = error_;
            error_ = nullptr;
        }
        *ran = helpers + 1;
        if (err) std::rethrow_exception(err);
        return true;
    }

    // Stops and joins the parked threads, unless a call is running (then it leaves them).
    void shut_down() {
        std::unique_lock<std::mutex> call(busy_, std::try_to_lock);
        if (!call.owns_lock()) return;
        {
            std::lock_guard<std::mutex> lk(m_);
            quit_ = true;
        }
        wake_.notify_all();
        for (std::thread& th : threads_)
            if (th.joinable()) th.join();
        threads_.clear();
        std::lock_guard<std::mutex> lk(m_);
        quit_ = false;  // a later call starts threads anew
    }

private:
    // Pool thread t (>= 1): one job(t) per generation that wants it.
    void loop(int t, unsigned long long seen) {
        std::unique_lock<std::mutex> lk(m_);
        for (;;) {
            wake_.wait(lk, [&] { return quit_ || generation_ != seen; });
            if (quit_) return;
            seen = generation_;
            if (t >= wanted_) continue;
            const Job* job = job_;
            lk.unlock();
            std::exception_ptr err;
            try {
                (*job)(t);
            } catch (...) {
                err = std::current_exception();
            }
            lk.lock();
            if (err && !error_) error_ = err;
            if (--pending_ == 0) done_.notify_one();
        }
    }

    std::mutex busy_;  // held by the call using the pool, for the whole call
    std::mutex m_;     // guards everything below
    std::condition_variable wake_, done_;
    std::vector<std::thread> threads_;  // threads_[k] runs job(k + 1)
    const Job* job_ = nullptr;
    unsigned long long generation_ = 0;  // one per call
    int wanted_ = 0;                      // job(t) runs for t < wanted_
    int pending_ = 0;                     // pool threads still in this call's job
    bool quit_ = false;
    std::exception_ptr error_;
};

// Never deleted: a pool of the parent left in a forked child must not be destroyed there
// (its threads do not exist), and one of this process is only shut down at unload.
std::atomic<Pool*> g_pool{nullptr};

Pool* this_process_pool() {
    const pid_t pid = getpid();
    Pool* p = g_pool.load(std::memory_order_acquire);
    if (p && p->pid_ == pid) return p;
    Pool* fresh = new Pool(pid);
    if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
    delete fresh;  // another thread of this process installed one first
    return p;
}

__attribute__((destructor)) void stop_pool() {
    Pool* p = g_pool.load(std::memory_order_acquire);
    if (p && p->pid_ == getpid()) p->shut_down();
}

}  // namespace

int run_on_threads(int n, const Job& job) {
    n = std::max(n, 1);
    if (n == 1) {
        job(0);
        return 1;
    }
    std::exception_ptr err;
    int ran = 0;
    if (n - 1 > kMostPooled || !this_process_pool()->try_run(n, job, &ran))
        ran = run_on_fresh_threads(n, job, &err);
    if (err) std::rethrow_exception(err);
    return ran;
}

}  // namespace pyfa_cpu
