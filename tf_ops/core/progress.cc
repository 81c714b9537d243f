// A background thread that keeps MPI's progress engine turning.
//
// Open MPI's ULFM heartbeat failure detector, run without its own thread
// (whose early first heartbeat can crash a peer still in MPI_Init: a NULL
// callback in the shared-memory transport), sends and checks heartbeats only
// while some thread is inside MPI. During long computation no thread is, so
// live ranks would be declared dead. This thread enters MPI (a probe on
// MPI_COMM_SELF, which matches nothing) every interval.
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include <mpi.h>

#include "matex_core.h"

namespace matex {
namespace {

std::mutex progress_mutex;
std::thread* progress_thread = nullptr;   // never destroyed while running
std::atomic<bool> progress_running{false};

void ProgressLoop(double interval_seconds) {
  const auto interval = std::chrono::duration<double>(interval_seconds);
  while (progress_running.load()) {
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_SELF, &flag, MPI_STATUS_IGNORE);
    std::this_thread::sleep_for(interval);
  }
}

}  // namespace

void StartProgressThread(double interval_seconds) {
  std::lock_guard<std::mutex> lock(progress_mutex);
  if (progress_thread != nullptr) return;
  progress_running = true;
  progress_thread = new std::thread(ProgressLoop, interval_seconds);
}

void StopProgressThread() {
  std::lock_guard<std::mutex> lock(progress_mutex);
  if (progress_thread == nullptr) return;
  progress_running = false;
  progress_thread->join();
  delete progress_thread;
  progress_thread = nullptr;
}

bool ProgressThreadRunning() {
  std::lock_guard<std::mutex> lock(progress_mutex);
  return progress_thread != nullptr;
}

}  // namespace matex
