// The emulated accelerator's device guard: which device index is current (per thread, as CUDA's
// is), how many devices there are, and streams and events that complete at once.
//
// Why C++: PyTorch's Python-level device guard (torch._C._acc.DeviceGuard) hard-codes one device
// with index 0, so torch.accelerator.set_device_index is a no-op and autograd, which starts one
// worker thread per device the guard reports, fails an internal assert on a tensor on index 1.
// Loading this library registers the guard for PrivateUse1 before the Python one would be.
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <chrono>

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<c10::DeviceIndex> device_count{1};
thread_local c10::DeviceIndex current_index = 0;

struct FakeGpuGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }

  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(type(), current_index); }
  void setDevice(c10::Device d) const override {
    // CUDA's wording for an index past the last device.
    TORCH_CHECK(d.index() < device_count.load(), "fakegpu error: invalid device ordinal ",
                static_cast<int>(d.index()), " (", static_cast<int>(device_count.load()), " devices)");
    uncheckedSetDevice(d);
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) current_index = d.index();  // -1 means "the current one"
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count.load(); }

  // One stream a device: work is done when it is issued, so every stream is the default one.
  c10::Stream defaultStream(c10::Device d) const noexcept {
    return c10::Stream(c10::Stream::DEFAULT, d.index() < 0 ? getDevice() : d);
  }
  c10::Stream getStream(c10::Device d) const noexcept override { return defaultStream(d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return defaultStream(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return defaultStream(d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return defaultStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return defaultStream(s.device()); }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}

  // An event is the time it was recorded at, so that elapsed_time works as on a GPU.
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new Clock::time_point();
    *static_cast<Clock::time_point*>(*event) = Clock::now();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void synchronizeEvent(void*) const override {}
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Clock::time_point*>(event);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "Both events must be recorded before calculating elapsed time.");
    auto delta = *static_cast<Clock::time_point*>(end) - *static_cast<Clock::time_point*>(start);
    return std::chrono::duration<double, std::milli>(delta).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGpuGuard);

}  // namespace

extern "C" void hpcr1_fakegpu_set_device_count(int count) {
  device_count.store(static_cast<c10::DeviceIndex>(count));
}
