// The Vulkan registry with its devices' functions behind a C++ `catch`.
//
// ggml-vulkan sets a device up on first use (`ggml_vk_get_device`, from
// `init_backend`, `get_buffer_type`, `supports_op`, ...) and throws a C++
// exception when the device cannot be used: "Unsupported device" for one
// without 16-bit storage (older GPUs, software devices such as SwiftShader),
// "Shared memory size too small for matrix multiplication", a
// `vk::SystemError` from the driver. Thrown into sdhost's Rust frames, the
// exception ends the process in `std::terminate` (an abort, with ggml's
// backtrace). And ggml keeps the half-made device: a second call would
// return it as if it worked.
//
// `sdhost_vk_reg` returns ggml's registry with each device's functions
// replaced by trampolines that call the original inside `try`. The first
// exception marks the device failed: that call and every later one return
// "nothing" (no backend, no buffer type, no op supported) without reaching
// ggml again, and the registry's `get_proc_address` answers
// `sdhost_device_error` with a function that gives the reason, so the host
// says in one line why the device cannot start. Written in C++ because
// only C++ can catch a C++ exception (Rust cannot: a foreign exception
// through `catch_unwind` aborts).

#include "ggml-backend-impl.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

extern "C" ggml_backend_reg_t ggml_backend_vk_reg(void);

namespace {

struct Guarded {
    ggml_backend_device_i orig;
    // A call that sets the device up has returned: no more capturing.
    std::atomic<bool> ready{false};
    std::atomic<bool> failed{false};
    // Written once, before `failed` is set (release); read after it is seen
    // set (acquire).
    std::string reason;
};

// Filled once, under `fill`, before the registry is handed to the host; only
// read (and the flags set) after.
std::unordered_map<ggml_backend_dev_t, Guarded> table;
std::once_flag fill;
std::mutex reason_lock;
void * (*orig_proc_address)(ggml_backend_reg_t, const char *) = nullptr;

Guarded * find(ggml_backend_dev_t dev) {
    auto it = table.find(dev);
    return it == table.end() ? nullptr : &it->second;
}

void fail(Guarded * g, const std::string & what) {
    std::lock_guard<std::mutex> lock(reason_lock);
    if (!g->failed.load(std::memory_order_acquire)) {
        g->reason = what;
        g->failed.store(true, std::memory_order_release);
    }
}

// What ggml-vulkan writes to `std::cerr` while a device is set up, caught
// so that a failure's explanation ("device Vulkan0 does not support 16-bit
// storage.") becomes part of its reason rather than a second line before
// sdhost's error; passed on to `std::cerr` where the call succeeds. Only
// around the calls that set a device up (not `supports_op`, which runs per
// node) and until one has returned; the outermost only, where ggml calls
// the device's functions from inside them. ggml-vulkan writes to
// `std::cerr` from no other thread then.
class Capture {
  public:
    explicit Capture(bool want) : on(want && depth == 0) {
        depth++;
        if (on) {
            lock = std::unique_lock<std::mutex>(capture_lock);
            old = std::cerr.rdbuf(text.rdbuf());
        }
    }
    ~Capture() {
        release(true);
        depth--;
    }
    // Ends the capture; the text goes on to `std::cerr` where `pass`.
    std::string release(bool pass) {
        if (!on) {
            return {};
        }
        on = false;
        std::cerr.rdbuf(old);
        std::string t = text.str();
        if (pass) {
            std::cerr << t;
        }
        return t;
    }
  private:
    static std::mutex capture_lock;
    static thread_local int depth;
    bool on;
    std::unique_lock<std::mutex> lock;
    std::ostringstream text;
    std::streambuf * old = nullptr;
};
std::mutex Capture::capture_lock;
thread_local int Capture::depth = 0;

// The text ggml wrote before throwing (its lines joined, without the
// "ggml_vulkan: " prefix and a last full stop) and then `what`, on one line:
// "device Vulkan0 does not support 16-bit storage (Unsupported device)".
std::string reason_of(const char * what, const std::string & said) {
    const std::string prefix = "ggml_vulkan: ";
    std::string lines;
    std::istringstream in(said);
    for (std::string line; std::getline(in, line);) {
        if (line.compare(0, prefix.size(), prefix) == 0) {
            line.erase(0, prefix.size());
        }
        while (!line.empty() && (line.back() == '.' || line.back() == ' ' || line.back() == '\r')) {
            line.pop_back();
        }
        if (!line.empty()) {
            lines += lines.empty() ? line : "; " + line;
        }
    }
    return lines.empty() ? std::string(what) : lines + " (" + what + ")";
}

// Calls `f(orig)` unless the device has failed, and returns `none` where it
// has or where `f` throws. `sets_up`: a call that may set the device up
// (its text on `std::cerr` is caught, above).
template <typename R, typename F> R guarded(ggml_backend_dev_t dev, R none, bool sets_up, F f) {
    Guarded * g = find(dev);
    if (g == nullptr || g->failed.load(std::memory_order_acquire)) {
        return none;
    }
    Capture said(sets_up && !g->ready.load(std::memory_order_acquire));
    try {
        R r = f(g->orig);
        if (sets_up) {
            g->ready.store(true, std::memory_order_release);
        }
        return r;
    } catch (const std::exception & e) {
        fail(g, reason_of(e.what(), said.release(false)));
    } catch (...) {
        fail(g, reason_of("an unknown C++ exception", said.release(false)));
    }
    return none;
}

const char * device_error(ggml_backend_dev_t dev) {
    Guarded * g = find(dev);
    if (g == nullptr || !g->failed.load(std::memory_order_acquire)) {
        return nullptr;
    }
    return g->reason.c_str();
}

void get_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    *free = 0;
    *total = 0;
    guarded(dev, 0, false, [&](const ggml_backend_device_i & o) {
        o.get_memory(dev, free, total);
        return 0;
    });
}

ggml_backend_t init_backend(ggml_backend_dev_t dev, const char * params) {
    return guarded(dev, (ggml_backend_t) nullptr, true,
                   [&](const ggml_backend_device_i & o) { return o.init_backend(dev, params); });
}

ggml_backend_buffer_type_t get_buffer_type(ggml_backend_dev_t dev) {
    return guarded(dev, (ggml_backend_buffer_type_t) nullptr, true,
                   [&](const ggml_backend_device_i & o) { return o.get_buffer_type(dev); });
}

ggml_backend_buffer_type_t get_host_buffer_type(ggml_backend_dev_t dev) {
    return guarded(dev, (ggml_backend_buffer_type_t) nullptr, true,
                   [&](const ggml_backend_device_i & o) { return o.get_host_buffer_type(dev); });
}

ggml_backend_buffer_t buffer_from_host_ptr(ggml_backend_dev_t dev, void * ptr, size_t size, size_t max_tensor_size) {
    return guarded(dev, (ggml_backend_buffer_t) nullptr, true, [&](const ggml_backend_device_i & o) {
        return o.buffer_from_host_ptr(dev, ptr, size, max_tensor_size);
    });
}

bool supports_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    return guarded(dev, false, false, [&](const ggml_backend_device_i & o) { return o.supports_op(dev, op); });
}

bool supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    return guarded(dev, false, false, [&](const ggml_backend_device_i & o) { return o.supports_buft(dev, buft); });
}

bool offload_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    return guarded(dev, false, true, [&](const ggml_backend_device_i & o) { return o.offload_op(dev, op); });
}

ggml_backend_event_t event_new(ggml_backend_dev_t dev) {
    return guarded(dev, (ggml_backend_event_t) nullptr, true,
                   [&](const ggml_backend_device_i & o) { return o.event_new(dev); });
}

void * get_proc_address(ggml_backend_reg_t reg, const char * name) {
    if (name != nullptr && std::strcmp(name, "sdhost_device_error") == 0) {
        return (void *) &device_error;
    }
    return orig_proc_address == nullptr ? nullptr : orig_proc_address(reg, name);
}

void guard(ggml_backend_reg_t reg) {
    orig_proc_address = reg->iface.get_proc_address;
    reg->iface.get_proc_address = get_proc_address;
    size_t n = reg->iface.get_device_count(reg);
    for (size_t i = 0; i < n; i++) {
        ggml_backend_dev_t dev = reg->iface.get_device(reg, i);
        if (dev == nullptr || table.count(dev) != 0) {
            continue;
        }
        ggml_backend_device_i & f = dev->iface;
        table[dev].orig = f;
        // Only the functions the backend has (a null one stays null: ggml
        // treats it as absent).
        if (f.get_memory) f.get_memory = get_memory;
        if (f.init_backend) f.init_backend = init_backend;
        if (f.get_buffer_type) f.get_buffer_type = get_buffer_type;
        if (f.get_host_buffer_type) f.get_host_buffer_type = get_host_buffer_type;
        if (f.buffer_from_host_ptr) f.buffer_from_host_ptr = buffer_from_host_ptr;
        if (f.supports_op) f.supports_op = supports_op;
        if (f.supports_buft) f.supports_buft = supports_buft;
        if (f.offload_op) f.offload_op = offload_op;
        if (f.event_new) f.event_new = event_new;
    }
}

} // namespace

// ggml's Vulkan registry, its devices guarded (above); null where ggml's is
// (no Vulkan 1.2 loader, a bad GGML_VK_VISIBLE_DEVICES: ggml catches those
// itself).
extern "C" ggml_backend_reg_t sdhost_vk_reg(void) {
    try {
        ggml_backend_reg_t reg = ggml_backend_vk_reg();
        if (reg != nullptr) {
            std::call_once(fill, [&] { guard(reg); });
        }
        return reg;
    } catch (const std::exception & e) {
        std::fprintf(stderr, "ggml_vulkan: %s\n", e.what());
    } catch (...) {
        std::fprintf(stderr, "ggml_vulkan: an unknown C++ exception\n");
    }
    return nullptr;
}
