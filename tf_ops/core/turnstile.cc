// The graph-mode turnstile: the MaTEx collectives of one TF1 Session.run
// execute in the order Python's scheduler (matex/legacy/_schedule.py) gave,
// the same on every rank, whatever order TensorFlow's executor starts them
// in. Mechanism only: the order and what is in it are decided in Python.
//
// A kernel whose turn has not come is queued, not blocked: its closure runs
// later on the turnstile's own thread, so no executor thread waits (with one
// inter-op thread per rank a blocked thread would deadlock the run).
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "matex_core.h"

namespace matex {
namespace {

struct Turnstile {
  std::mutex mutex;
  std::condition_variable ready;
  bool active = false;                       // a scheduled run is in progress
  std::vector<std::string> order;            // its collectives, in turn order
  std::unordered_map<std::string, size_t> position;   // name -> index in order
  size_t next = 0;                           // index of the collective whose turn it is
  std::unordered_map<std::string, std::function<void()>> queued;
  bool thread_started = false;
};

Turnstile& State() {
  static Turnstile* t = new Turnstile();   // never destroyed: the thread outlives exit
  return *t;
}

void Loop() {
  Turnstile& t = State();
  std::unique_lock<std::mutex> lock(t.mutex);
  for (;;) {
    t.ready.wait(lock, [&t] {
      return t.active && t.next < t.order.size() && t.queued.count(t.order[t.next]) > 0;
    });
    auto it = t.queued.find(t.order[t.next]);
    std::function<void()> run = std::move(it->second);
    t.queued.erase(it);
    ++t.next;
    lock.unlock();
    run();   // the collective, then its kernel's done callback
    lock.lock();
  }
}

}  // namespace

void BeginGraphRun(std::vector<std::string> order) {
  Turnstile& t = State();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.order = std::move(order);
  t.position.clear();
  for (size_t i = 0; i < t.order.size(); ++i) t.position[t.order[i]] = i;
  t.next = 0;
  t.active = true;
  if (!t.thread_started) {
    t.thread_started = true;
    std::thread(Loop).detach();
  }
}

int EndGraphRun() {
  Turnstile& t = State();
  std::lock_guard<std::mutex> lock(t.mutex);
  const int ran = static_cast<int>(t.next);
  t.active = false;
  t.order.clear();
  t.position.clear();
  t.next = 0;
  return ran;
}

Turn TakeTurn(const std::string& name, std::function<void()> run) {
  Turnstile& t = State();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    if (!t.active) return Turn::kNow;
    auto at = t.position.find(name);
    if (at == t.position.end() || at->second < t.next || t.queued.count(name) > 0) {
      return Turn::kUnscheduled;
    }
    t.queued.emplace(name, std::move(run));
  }
  t.ready.notify_one();
  return Turn::kQueued;
}

bool Withdraw(const std::string& name) {
  Turnstile& t = State();
  std::lock_guard<std::mutex> lock(t.mutex);
  return t.queued.erase(name) > 0;
}

}  // namespace matex
