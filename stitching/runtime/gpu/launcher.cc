// The GPU launcher (launcher.h has the design).  Built on its own as a small shared
// library for ctypes (stitching/runtime/gpu_build.py) and compiled into the op library's
// GPU build.
#include "launcher.h"

#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <type_traits>
#include <unordered_map>

namespace stitching {
namespace gpu {

constexpr int kAbiVersion = 1;

namespace {

constexpr int kMaxTensors = 1024;          // as the CPU op
constexpr int kMaxRank = 64;
constexpr int kMaxArgs = 4096;             // parameter slots of one kernel
constexpr int kMaxSteps = 64;              // launches of one plan (the codegen stops at 9)
constexpr int64_t kMaxBlock = 1024;        // CUDA: threads per block
constexpr int64_t kMaxGrid = 2147483647;   // CUDA: gridDim.x
constexpr int64_t kStaticSmem = 48 << 10;  // dynamic shared bytes without the opt-in
constexpr int64_t kMaxSmem = 227 << 10;    // sm_90's most per block
constexpr int64_t kWsAlign = 256;          // workspace offsets in the temp buffer
constexpr size_t kMaxImage = 64u << 20;    // sanity bound on a kernel image

// ---- text parsing (manifests, layouts and plans are data from outside) ----------------

std::vector<std::string> Tokens(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string t; in >> t;) out.push_back(t);
  return out;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) {
    if (!Tokens(l).empty()) out.push_back(l);
  }
  return out;
}

bool ParseInt(const std::string& s, int64_t lo, int64_t hi, int64_t* v) {
  if (s.empty() || s.size() > 20) return false;
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size() || x < lo || x > hi) return false;
  *v = x;
  return true;
}

bool Identifier(const std::string& s) {
  if (s.empty() || s.size() > 1024) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '$' || c == '.'))
      return false;
  }
  return true;
}

// Bytes per element of a dtype's device buffer (bool as a byte, bfloat16 as its bits).
int64_t ItemSize(const std::string& dtype) {
  static const std::map<std::string, int64_t> sizes = {
      {"float16", 2}, {"bfloat16", 2}, {"float32", 4}, {"float64", 8},
      {"int32", 4},   {"int64", 8},    {"bool", 1}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

std::string Join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return "[" + s + "]";
}

// ---- the CUDA driver, opened at first use ------------------------------------------------

#define STITCHING_STR2(x) #x
#define STITCHING_STR(x) STITCHING_STR2(x)   // the name after cuda.h's version macros

struct Driver {
  decltype(&::cuInit) Init = nullptr;
  decltype(&::cuGetErrorString) GetErrorString = nullptr;
  decltype(&::cuCtxGetCurrent) CtxGetCurrent = nullptr;
  decltype(&::cuModuleLoadDataEx) ModuleLoadDataEx = nullptr;
  decltype(&::cuModuleGetFunction) ModuleGetFunction = nullptr;
  decltype(&::cuFuncGetAttribute) FuncGetAttribute = nullptr;
  decltype(&::cuFuncSetAttribute) FuncSetAttribute = nullptr;
  decltype(&::cuLaunchKernel) LaunchKernel = nullptr;
  decltype(&::cuStreamBeginCapture) StreamBeginCapture = nullptr;
  decltype(&::cuStreamEndCapture) StreamEndCapture = nullptr;
  decltype(&::cuGraphInstantiate) GraphInstantiate = nullptr;
  decltype(&::cuGraphLaunch) GraphLaunch = nullptr;
  decltype(&::cuGraphDestroy) GraphDestroy = nullptr;
  decltype(&::cuGraphExecDestroy) GraphExecDestroy = nullptr;
  std::string error;   // why the driver could not be opened

  std::string Check(CUresult r, const char* what) const {
    if (r == CUDA_SUCCESS) return "";
    const char* s = nullptr;
    if (GetErrorString == nullptr || GetErrorString(r, &s) != CUDA_SUCCESS || !s) s = "?";
    return std::string(what) + " failed: " + s + " (CUresult " + std::to_string(r) + ")";
  }
};

const Driver& GetDriver() {
  static const Driver* d = [] {
    auto* d = new Driver;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d->error = std::string("the CUDA driver (libcuda.so.1) could not be opened: ") +
                 dlerror();
      return d;
    }
    bool ok = true;
    auto sym = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_reference_t<decltype(*fn)>>(dlsym(lib, name));
      if (*fn == nullptr && ok) {
        ok = false;
        d->error = std::string("the CUDA driver has no ") + name;
      }
    };
    sym(&d->Init, STITCHING_STR(cuInit));
    sym(&d->GetErrorString, STITCHING_STR(cuGetErrorString));
    sym(&d->CtxGetCurrent, STITCHING_STR(cuCtxGetCurrent));
    sym(&d->ModuleLoadDataEx, STITCHING_STR(cuModuleLoadDataEx));
    sym(&d->ModuleGetFunction, STITCHING_STR(cuModuleGetFunction));
    sym(&d->FuncGetAttribute, STITCHING_STR(cuFuncGetAttribute));
    sym(&d->FuncSetAttribute, STITCHING_STR(cuFuncSetAttribute));
    sym(&d->LaunchKernel, STITCHING_STR(cuLaunchKernel));
    sym(&d->StreamBeginCapture, STITCHING_STR(cuStreamBeginCapture));
    sym(&d->StreamEndCapture, STITCHING_STR(cuStreamEndCapture));
    sym(&d->GraphInstantiate, STITCHING_STR(cuGraphInstantiate));
    sym(&d->GraphLaunch, STITCHING_STR(cuGraphLaunch));
    sym(&d->GraphDestroy, STITCHING_STR(cuGraphDestroy));
    sym(&d->GraphExecDestroy, STITCHING_STR(cuGraphExecDestroy));
    if (ok) {
      std::string e = d->Check(d->Init(0), "cuInit");
      if (!e.empty()) d->error = e;
    }
    return d;
  }();
  return *d;
}

// ---- loaded functions, per (kernel, context) ----------------------------------------------

struct Loaded {
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  int max_threads = 0;
  int64_t smem_opt_in = kStaticSmem;   // dynamic shared bytes the function may take
};

std::mutex g_loaded_mu;
std::map<std::pair<const Kernel*, CUcontext>, Loaded> g_loaded;   // never unloaded

std::string Load(const Driver& drv, const Kernel& k, Loaded** out) {
  CUcontext ctx = nullptr;
  std::string e = drv.Check(drv.CtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!e.empty()) return e;
  if (ctx == nullptr) return "no CUDA context is current on the launching thread";
  std::lock_guard<std::mutex> lock(g_loaded_mu);
  auto key = std::make_pair(&k, ctx);
  auto it = g_loaded.find(key);
  if (it != g_loaded.end()) {
    *out = &it->second;
    return "";
  }
  Loaded l;
  char log[4096] = {0};
  CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* vals[] = {log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof(log) - 1))};
  CUresult r = drv.ModuleLoadDataEx(&l.module, k.image.c_str(), 2, opts, vals);
  if (r != CUDA_SUCCESS) {
    return drv.Check(r, "cuModuleLoadDataEx") + " for kernel " + k.name + ": " + log;
  }
  e = drv.Check(drv.ModuleGetFunction(&l.fn, l.module, k.entry.c_str()),
                "cuModuleGetFunction");
  if (!e.empty()) return e + " (entry " + k.entry + " of kernel " + k.name + ")";
  e = drv.Check(drv.FuncGetAttribute(&l.max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                                     l.fn), "cuFuncGetAttribute");
  if (!e.empty()) return e;
  *out = &g_loaded.emplace(key, l).first->second;
  return "";
}

// One launch's parameter storage: numba's flattened 1-D array model, then scalars.
struct ArrayArg {
  void* meminfo;
  void* parent;
  int64_t nitems, itemsize;
  void* data;
  int64_t shape0, stride0;
};

}  // namespace

// ---- modules ------------------------------------------------------------------------------

class Module {
 public:
  explicit Module(Signature sig) : sig_(std::move(sig)) {}

  const Signature& sig() const { return sig_; }

  std::string AddKernel(std::shared_ptr<const Kernel> k) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = kernels_.find(k->name);
    if (it != kernels_.end()) {
      return it->second->image == k->image && it->second->entry == k->entry
                 ? ""
                 : "kernel " + k->name + " is already registered with other code";
    }
    kernels_.emplace(k->name, std::move(k));
    return "";
  }

  std::shared_ptr<const Kernel> FindKernel(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = kernels_.find(name);
    return it == kernels_.end() ? nullptr : it->second;
  }

  void SetPlan(std::shared_ptr<const Plan> p) {
    std::lock_guard<std::mutex> lock(mu_);
    plans_[p->in_dims] = std::move(p);
  }

  std::shared_ptr<const Plan> FindPlan(const std::vector<int64_t>& dims) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(dims);
    return it == plans_.end() ? nullptr : it->second;
  }

 private:
  const Signature sig_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const Kernel>> kernels_;
  std::map<std::vector<int64_t>, std::shared_ptr<const Plan>> plans_;
};

namespace {

std::mutex g_mu;
std::unordered_map<std::string, std::shared_ptr<Module>> g_modules;
std::atomic<PlannerFn> g_planner{nullptr};
std::atomic<CompilerFn> g_compiler{nullptr};

bool ValidHash(const std::string& h) {
  if (h.size() != 24) return false;
  for (char c : h) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// "stitching-gpu 1" then "in <dtype> <rank> <dims...>" and "out <dtype> <rank>" lines.
std::string ParseManifest(const std::string& text, Signature* sig) {
  std::vector<std::string> lines = Lines(text);
  if (lines.empty() || Tokens(lines[0]) != std::vector<std::string>{"stitching-gpu", "1"}) {
    return "manifest must start with 'stitching-gpu 1'";
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    std::vector<std::string> t = Tokens(lines[i]);
    int64_t rank = 0;
    const bool in = t[0] == "in";
    if ((!in && t[0] != "out") || t.size() < 3 || ItemSize(t[1]) == 0 ||
        !ParseInt(t[2], 0, kMaxRank, &rank) ||
        t.size() != static_cast<size_t>(in ? 3 + rank : 3)) {
      return "manifest line " + std::to_string(i + 1) + " is not 'in <dtype> <rank> "
             "<dims>' or 'out <dtype> <rank>' with a known dtype: " + lines[i].substr(0, 200);
    }
    (in ? sig->in_dtypes : sig->out_dtypes).push_back(t[1]);
    (in ? sig->in_ranks : sig->out_ranks).push_back(static_cast<int>(rank));
    for (int64_t d = 0; in && d < rank; ++d) {
      int64_t v = 0;
      if (!ParseInt(t[3 + d], -1, INT64_MAX, &v)) {
        return "manifest line " + std::to_string(i + 1) + ": bad static dim " + t[3 + d];
      }
      sig->in_static.push_back(v);
    }
  }
  if (sig->out_dtypes.empty()) return "manifest declares no outputs";
  if (sig->in_dtypes.size() > kMaxTensors || sig->out_dtypes.size() > kMaxTensors) {
    return "manifest declares too many tensors";
  }
  return "";
}

bool SameSignature(const Signature& a, const Signature& b) {
  return a.in_dtypes == b.in_dtypes && a.out_dtypes == b.out_dtypes &&
         a.in_ranks == b.in_ranks && a.out_ranks == b.out_ranks &&
         a.in_static == b.in_static;
}

// "i<j>" input j, "o<m>" output m, "w<n>" workspace n, "s" the step's next scalar; a
// trailing "!" marks an array accessed 16 bytes at a time.
std::string ParseArgs(const std::string& text, const Signature& sig, Kernel* k) {
  std::vector<std::string> t = Tokens(text);
  if (t.size() > kMaxArgs) return "too many kernel arguments";
  for (std::string a : t) {
    Arg arg{Arg::kScalar, 0, false};
    if (a == "s") {
      arg.index = k->scalars++;
      k->args.push_back(arg);
      continue;
    }
    if (a.size() > 1 && a.back() == '!') {
      arg.aligned16 = true;
      a.pop_back();
    }
    int64_t idx = 0;
    const char c = a.empty() ? '?' : a[0];
    const int64_t limit = c == 'i' ? static_cast<int64_t>(sig.in_dtypes.size()) - 1
                          : c == 'o' ? static_cast<int64_t>(sig.out_dtypes.size()) - 1
                                     : kMaxTensors;
    if ((c != 'i' && c != 'o' && c != 'w') || !ParseInt(a.substr(1), 0, limit, &idx)) {
      return "kernel " + k->name + ": bad argument '" + a + "' (i<input>, o<output>, "
             "w<workspace> or s, within the signature)";
    }
    arg.kind = c == 'i' ? Arg::kInput : c == 'o' ? Arg::kOutput : Arg::kWorkspace;
    arg.index = static_cast<int>(idx);
    k->args.push_back(arg);
  }
  return "";
}

std::string ParseStep(Module& m, const std::vector<std::string>& t, const Plan& p,
                      Step* s) {
  if (t.size() < 6) return "a step is 'step <kernel> <alt|-> <grid> <block> <smem> <scalars>'";
  s->kernel = m.FindKernel(t[1]);
  if (!s->kernel) return "step names kernel " + t[1] + ", which is not registered";
  if (t[2] != "-") {
    s->alt = m.FindKernel(t[2]);
    if (!s->alt) return "step names kernel " + t[2] + ", which is not registered";
  }
  if (!ParseInt(t[3], 1, kMaxGrid, &s->grid) || !ParseInt(t[4], 1, kMaxBlock, &s->block) ||
      !ParseInt(t[5], 0, kMaxSmem, &s->smem)) {
    return "step of " + t[1] + ": grid must be in [1, 2^31), block in [1, 1024], shared "
           "bytes in [0, 227 KiB]";
  }
  for (size_t i = 6; i < t.size(); ++i) {
    int64_t v = 0;
    if (!ParseInt(t[i], INT64_MIN, INT64_MAX, &v)) return "bad scalar " + t[i];
    s->scalars.push_back(v);
  }
  for (const auto& k : {s->kernel, s->alt}) {
    if (!k) continue;
    if (k->scalars != static_cast<int>(s->scalars.size())) {
      return "step of " + k->name + " gives " + std::to_string(s->scalars.size()) +
             " scalars; the kernel takes " + std::to_string(k->scalars);
    }
    for (const Arg& a : k->args) {
      if (a.kind == Arg::kWorkspace && a.index >= static_cast<int>(p.ws_elems.size())) {
        return "kernel " + k->name + " uses workspace " + std::to_string(a.index) +
               "; the plan has " + std::to_string(p.ws_elems.size());
      }
    }
  }
  return "";
}

// "out <dims>" per output, "ws <itemsize> <elements>" per workspace, "step ..." per launch.
std::string ParsePlan(Module& m, const std::string& text, Plan* p) {
  const Signature& sig = m.sig();
  for (const std::string& line : Lines(text)) {
    std::vector<std::string> t = Tokens(line);
    if (t[0] == "out") {
      std::vector<int64_t> dims;
      for (size_t i = 1; i < t.size(); ++i) {
        int64_t v = 0;
        if (!ParseInt(t[i], 0, INT64_MAX, &v)) return "bad output dim " + t[i];
        dims.push_back(v);
      }
      p->out_dims.push_back(dims);
    } else if (t[0] == "ws" && t.size() == 3) {
      int64_t item = 0, n = 0;
      if (!ParseInt(t[1], 1, 16, &item) || !ParseInt(t[2], 1, int64_t{1} << 40, &n)) {
        return "bad workspace line: " + line.substr(0, 200);
      }
      p->ws_offset.push_back(p->temp_bytes);
      p->ws_itemsize.push_back(item);
      p->ws_elems.push_back(n);
      p->temp_bytes += (item * n + kWsAlign - 1) / kWsAlign * kWsAlign;
    } else if (t[0] == "step") {
      if (p->steps.size() >= kMaxSteps) return "too many steps";
      Step s;
      std::string e = ParseStep(m, t, *p, &s);
      if (!e.empty()) return e;
      p->steps.push_back(std::move(s));
    } else {
      return "plan line is not out/ws/step: " + line.substr(0, 200);
    }
  }
  if (p->out_dims.size() != sig.out_dtypes.size()) {
    return "plan gives " + std::to_string(p->out_dims.size()) + " output shapes; the "
           "kernel has " + std::to_string(sig.out_dtypes.size()) + " outputs";
  }
  for (size_t i = 0; i < p->out_dims.size(); ++i) {
    if (static_cast<int>(p->out_dims[i].size()) != sig.out_ranks[i]) {
      return "plan's output " + std::to_string(i) + " has rank " +
             std::to_string(p->out_dims[i].size()) + "; the kernel's has " +
             std::to_string(sig.out_ranks[i]);
    }
  }
  return "";
}

int64_t Elements(const std::vector<int64_t>& dims, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= dims[i];
  return n;
}

// The parameter array of one launch of kernel `k`: numba's array model per array
// argument, then the int64 scalars, each slot pointing into storage held here.
struct Params {
  std::vector<ArrayArg> arrays;
  std::vector<int64_t> scalars;
  std::vector<void*> slots;

  Params(const Kernel& k, const Step& s, const Plan& p, const void* const* ins,
         void* const* outs, void* temp) {
    arrays.reserve(k.args.size());   // no reallocation: slots point into these
    scalars.reserve(k.args.size());
    for (const Arg& a : k.args) {
      if (a.kind == Arg::kScalar) {
        scalars.push_back(s.scalars[a.index]);
        slots.push_back(&scalars.back());
        continue;
      }
      ArrayArg arr{nullptr, nullptr, 0, 0, nullptr, 0, 0};
      if (a.kind == Arg::kInput) {
        arr = {nullptr, nullptr, p.in_elems[a.index], p.in_item[a.index],
               const_cast<void*>(ins[a.index]), 0, 0};
      } else if (a.kind == Arg::kOutput) {
        arr = {nullptr, nullptr, p.out_elems[a.index], p.out_item[a.index], outs[a.index],
               0, 0};
      } else {
        arr = {nullptr, nullptr, p.ws_elems[a.index], p.ws_itemsize[a.index],
               static_cast<char*>(temp) + p.ws_offset[a.index], 0, 0};
      }
      arr.shape0 = arr.nitems;
      arr.stride0 = arr.itemsize;
      arrays.push_back(arr);
      ArrayArg& r = arrays.back();
      for (void* f : {static_cast<void*>(&r.meminfo), static_cast<void*>(&r.parent),
                      static_cast<void*>(&r.nitems), static_cast<void*>(&r.itemsize),
                      static_cast<void*>(&r.data), static_cast<void*>(&r.shape0),
                      static_cast<void*>(&r.stride0)}) {
        slots.push_back(f);
      }
    }
  }
};

bool Aligned(const Kernel& k, const void* const* ins, void* const* outs, void* temp,
             const Plan& p) {
  for (const Arg& a : k.args) {
    if (!a.aligned16) continue;
    const void* ptr = a.kind == Arg::kInput    ? ins[a.index]
                      : a.kind == Arg::kOutput ? outs[a.index]
                                               : static_cast<char*>(temp) + p.ws_offset[a.index];
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  }
  return true;
}

}  // namespace

// ---- the C++ API ---------------------------------------------------------------------------

std::string Register(const std::string& hash, const std::string& manifest) {
  if (!ValidHash(hash)) return "spec hash must be 24 lowercase hex digits, got '" +
                               hash.substr(0, 40) + "'";
  Signature sig;
  std::string e = ParseManifest(manifest, &sig);
  if (!e.empty()) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_modules.find(hash);
  if (it != g_modules.end()) {
    return SameSignature(it->second->sig(), sig)
               ? ""
               : "spec " + hash + " is already registered with another signature";
  }
  g_modules.emplace(hash, std::make_shared<Module>(std::move(sig)));
  return "";
}

std::shared_ptr<Module> Find(const std::string& hash) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_modules.find(hash);
  return it == g_modules.end() ? nullptr : it->second;
}

const Signature& GetSignature(const Module& m) { return m.sig(); }

std::string AddKernel(const std::string& hash, const std::string& name,
                      const std::string& image, const std::string& entry,
                      const std::string& args) {
  std::shared_ptr<Module> m = Find(hash);
  if (!m) return "spec " + hash.substr(0, 40) + " is not registered";
  if (!Identifier(name) || !Identifier(entry)) return "bad kernel or entry name";
  if (image.empty() || image.size() > kMaxImage) return "kernel " + name + ": bad image size";
  auto k = std::make_shared<Kernel>();
  k->name = name;
  k->entry = entry;
  // cuModuleLoadData reads PTX up to its NUL: keep one at the end
  k->image = image.back() == '\0' ? image : image + '\0';
  std::string e = ParseArgs(args, m->sig(), k.get());
  if (!e.empty()) return e;
  return m->AddKernel(std::move(k));
}

std::string SetPlan(const std::string& hash, const std::vector<int64_t>& in_dims,
                    const std::string& text) {
  std::shared_ptr<Module> m = Find(hash);
  if (!m) return "spec " + hash.substr(0, 40) + " is not registered";
  const Signature& sig = m->sig();
  if (in_dims.size() != sig.in_static.size()) {
    return "plan key has " + std::to_string(in_dims.size()) + " input dims; the kernel's "
           "inputs have " + std::to_string(sig.in_static.size());
  }
  auto p = std::make_shared<Plan>();
  p->in_dims = in_dims;
  std::string e = ParsePlan(*m, text, p.get());
  if (!e.empty()) return "plan for input dims " + Join(in_dims) + ": " + e;
  for (size_t i = 0, at = 0; i < sig.in_ranks.size(); at += sig.in_ranks[i], ++i) {
    p->in_elems.push_back(Elements(in_dims, at, at + sig.in_ranks[i]));
    p->in_item.push_back(ItemSize(sig.in_dtypes[i]));
  }
  for (size_t i = 0; i < p->out_dims.size(); ++i) {
    p->out_elems.push_back(Elements(p->out_dims[i], 0, p->out_dims[i].size()));
    p->out_item.push_back(ItemSize(sig.out_dtypes[i]));
  }
  m->SetPlan(std::move(p));
  return "";
}

std::string CheckInputs(const Module& m, const std::vector<std::string>& in_dtypes,
                        const std::vector<int>& in_ranks,
                        const std::vector<int64_t>& in_dims,
                        const std::vector<std::string>& out_dtypes) {
  const Signature& sig = m.sig();
  if (in_dtypes.size() != sig.in_dtypes.size() || out_dtypes.size() != sig.out_dtypes.size()) {
    return "got " + std::to_string(in_dtypes.size()) + " inputs and " +
           std::to_string(out_dtypes.size()) + " outputs; the kernel has " +
           std::to_string(sig.in_dtypes.size()) + " and " +
           std::to_string(sig.out_dtypes.size());
  }
  size_t k = 0;
  for (size_t i = 0; i < in_dtypes.size(); ++i) {
    if (in_dtypes[i] != sig.in_dtypes[i]) {
      return "input " + std::to_string(i) + " has dtype " + in_dtypes[i].substr(0, 40) +
             "; the kernel expects " + sig.in_dtypes[i];
    }
    if (in_ranks[i] != sig.in_ranks[i]) {
      return "input " + std::to_string(i) + " has rank " + std::to_string(in_ranks[i]) +
             "; the kernel expects " + std::to_string(sig.in_ranks[i]);
    }
    for (int d = 0; d < in_ranks[i]; ++d, ++k) {
      if (k >= in_dims.size() || in_dims[k] < 0) return "input dims are short or negative";
      if (sig.in_static[k] >= 0 && in_dims[k] != sig.in_static[k]) {
        return "input " + std::to_string(i) + " dim " + std::to_string(d) + " must be " +
               std::to_string(sig.in_static[k]) + ", got " + std::to_string(in_dims[k]);
      }
    }
  }
  if (k != in_dims.size()) return "more input dims than the inputs' ranks";
  for (size_t i = 0; i < out_dtypes.size(); ++i) {
    if (out_dtypes[i] != sig.out_dtypes[i]) {
      return "output " + std::to_string(i) + " has dtype " + out_dtypes[i].substr(0, 40) +
             "; the kernel produces " + sig.out_dtypes[i];
    }
  }
  return "";
}

std::string GetPlan(Module& m, const std::string& hash, const std::vector<int64_t>& in_dims,
                    std::shared_ptr<const Plan>* out) {
  *out = m.FindPlan(in_dims);
  if (*out) return "";
  PlannerFn planner = g_planner.load();
  if (planner == nullptr) {
    return "no launch plan for input dims " + Join(in_dims) + " and no planner installed";
  }
  if (planner(hash.c_str(), in_dims.data(), static_cast<int64_t>(in_dims.size())) != 0) {
    return "the planner failed for input dims " + Join(in_dims);
  }
  *out = m.FindPlan(in_dims);
  return *out ? "" : "the planner returned without a plan for input dims " + Join(in_dims);
}

std::string Launch(const Plan& p, const void* const* ins, void* const* outs, void* temp,
                   void* stream) {
  const Driver& drv = GetDriver();
  if (!drv.error.empty()) return drv.error;
  if (p.temp_bytes > 0 && temp == nullptr) return "the plan needs a temp buffer";
  for (const Step& s : p.steps) {
    const Kernel* k = s.kernel.get();
    if (s.alt && !Aligned(*k, ins, outs, temp, p)) k = s.alt.get();
    Loaded* l = nullptr;
    std::string e = Load(drv, *k, &l);
    if (!e.empty()) return e;
    if (s.block > l->max_threads) {
      return "kernel " + k->name + " launches at most " + std::to_string(l->max_threads) +
             " threads per block; the plan asks " + std::to_string(s.block);
    }
    if (s.smem > l->smem_opt_in) {
      std::lock_guard<std::mutex> lock(g_loaded_mu);
      e = drv.Check(drv.FuncSetAttribute(l->fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         static_cast<int>(s.smem)), "cuFuncSetAttribute");
      if (!e.empty()) return e + " (" + std::to_string(s.smem) + " shared bytes)";
      l->smem_opt_in = s.smem;
    }
    Params params(*k, s, p, ins, outs, temp);
    e = drv.Check(drv.LaunchKernel(l->fn, static_cast<unsigned>(s.grid), 1, 1,
                                   static_cast<unsigned>(s.block), 1, 1,
                                   static_cast<unsigned>(s.smem),
                                   static_cast<CUstream>(stream), params.slots.data(),
                                   nullptr), "cuLaunchKernel");
    if (!e.empty()) return e + " (kernel " + k->name + ")";
  }
  return "";
}

void SetPlanner(PlannerFn fn) { g_planner.store(fn); }
void SetCompiler(CompilerFn fn) { g_compiler.store(fn); }
CompilerFn GetCompiler() { return g_compiler.load(); }

// ---- a whole function's launches, replayed directly or as one CUDA graph ---------------
//
// PyGraph's idea at the launcher's level: the calls of one function (each a plan with
// its buffers) are recorded once; a run launches them all, either one cuLaunchKernel
// per step or, once captured, one cuGraphLaunch for the lot.  The graph holds the
// buffers' addresses, so the caller keeps the same buffers (static inputs and outputs,
// as CUDA graphs in PyTorch do).

struct Function {
  struct Call {
    std::shared_ptr<const Plan> plan;
    std::vector<const void*> ins;
    std::vector<void*> outs;
    void* temp;
  };
  std::vector<Call> calls;
  CUgraphExec exec = nullptr;
};

namespace {

std::string RunCalls(const Function& f, void* stream) {
  for (const Function::Call& c : f.calls) {
    std::string e = Launch(*c.plan, c.ins.data(), c.outs.data(), c.temp, stream);
    if (!e.empty()) return e;
  }
  return "";
}

}  // namespace

std::string RunFunction(Function& f, void* stream, bool graph) {
  if (!graph) return RunCalls(f, stream);
  const Driver& drv = GetDriver();
  if (!drv.error.empty()) return drv.error;
  if (f.exec == nullptr) {
    CUstream s = static_cast<CUstream>(stream);
    std::string e = drv.Check(drv.StreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                              "cuStreamBeginCapture");
    if (!e.empty()) return e + " (capture needs a stream other than the legacy default)";
    std::string launched = RunCalls(f, stream);
    CUgraph g = nullptr;
    e = drv.Check(drv.StreamEndCapture(s, &g), "cuStreamEndCapture");
    if (!launched.empty() || !e.empty()) {
      if (g != nullptr) drv.GraphDestroy(g);
      return launched.empty() ? e : launched;
    }
    e = drv.Check(drv.GraphInstantiate(&f.exec, g, 0), "cuGraphInstantiate");
    drv.GraphDestroy(g);
    if (!e.empty()) return e;
  }
  return drv.Check(drv.GraphLaunch(f.exec, static_cast<CUstream>(stream)), "cuGraphLaunch");
}

void FreeFunction(Function* f) {
  if (f->exec != nullptr && GetDriver().error.empty()) GetDriver().GraphExecDestroy(f->exec);
  delete f;
}

}  // namespace gpu
}  // namespace stitching

// ---- C ABI (ctypes; the same image the op library loads) ----------------------------------
//
// Every int-returning entry point returns 0 on success, else 1 with the message in
// stitching_gpu_last_error() (per thread).

namespace {

thread_local std::string tls_error;

int Report(const std::string& e) {
  tls_error = e;
  return e.empty() ? 0 : 1;
}

std::vector<int64_t> Dims(const int64_t* d, int64_t n) {
  return n > 0 && d != nullptr ? std::vector<int64_t>(d, d + n) : std::vector<int64_t>();
}

std::string Resolve(const char* hash, const int64_t* in_dims, int64_t n,
                    std::shared_ptr<const stitching::gpu::Plan>* plan) {
  namespace g = stitching::gpu;
  if (hash == nullptr || n < 0 || n > 1 << 16) return "bad arguments";
  std::shared_ptr<g::Module> m = g::Find(hash);
  if (!m) return std::string("spec ") + std::string(hash).substr(0, 40) + " is not registered";
  return g::GetPlan(*m, hash, Dims(in_dims, n), plan);
}

}  // namespace

extern "C" {

int stitching_gpu_abi_version() { return stitching::gpu::kAbiVersion; }

const char* stitching_gpu_last_error() { return tls_error.c_str(); }

int stitching_gpu_register(const char* hash, const char* manifest) {
  if (hash == nullptr || manifest == nullptr) return Report("null argument");
  return Report(stitching::gpu::Register(hash, manifest));
}

int stitching_gpu_add_kernel(const char* hash, const char* name, const char* image,
                             int64_t image_bytes, const char* entry, const char* args) {
  if (!hash || !name || !image || !entry || !args || image_bytes <= 0) {
    return Report("null argument or empty image");
  }
  return Report(stitching::gpu::AddKernel(hash, name, std::string(image, image_bytes), entry,
                                          args));
}

int stitching_gpu_set_plan(const char* hash, const int64_t* in_dims, int64_t n,
                           const char* plan) {
  if (hash == nullptr || plan == nullptr || n < 0) return Report("null argument");
  return Report(stitching::gpu::SetPlan(hash, Dims(in_dims, n), plan));
}

void stitching_gpu_set_planner(stitching::gpu::PlannerFn fn) { stitching::gpu::SetPlanner(fn); }

void stitching_gpu_set_compiler(stitching::gpu::CompilerFn fn) {
  stitching::gpu::SetCompiler(fn);
}

// Output dims (flattened, at most `cap` words) and temp bytes of the plan for in_dims.
int stitching_gpu_plan_info(const char* hash, const int64_t* in_dims, int64_t n,
                            int64_t* out_dims, int64_t cap, int64_t* temp_bytes) {
  std::shared_ptr<const stitching::gpu::Plan> plan;
  std::string e = Resolve(hash, in_dims, n, &plan);
  if (!e.empty()) return Report(e);
  int64_t k = 0;
  for (const auto& dims : plan->out_dims) {
    for (int64_t d : dims) {
      if (k >= cap) return Report("out_dims buffer too small");
      out_dims[k++] = d;
    }
  }
  *temp_bytes = plan->temp_bytes;
  return Report("");
}

// Checks the tensors against the spec's signature, then launches its plan on `stream`.
int stitching_gpu_launch(const char* hash, int n_in, const char* const* in_dtypes,
                         const int* in_ranks, const int64_t* in_dims, const void* const* ins,
                         int n_out, const char* const* out_dtypes, void* const* outs,
                         void* temp, int64_t temp_bytes, void* stream) {
  namespace g = stitching::gpu;
  if (hash == nullptr || n_in < 0 || n_out < 0 || n_in > 1024 || n_out > 1024) {
    return Report("bad arguments");
  }
  std::shared_ptr<g::Module> m = g::Find(hash);
  if (!m) return Report(std::string("spec ") + std::string(hash).substr(0, 40) +
                        " is not registered");
  std::vector<std::string> ti, to;
  std::vector<int> ranks;
  int64_t ndims = 0;
  for (int i = 0; i < n_in; ++i) {
    if (in_ranks[i] < 0 || in_ranks[i] > 64 || in_dtypes[i] == nullptr) {
      return Report("bad input rank or dtype");
    }
    ti.emplace_back(in_dtypes[i]);
    ranks.push_back(in_ranks[i]);
    ndims += in_ranks[i];
  }
  for (int i = 0; i < n_out; ++i) {
    if (out_dtypes[i] == nullptr) return Report("null output dtype");
    to.emplace_back(out_dtypes[i]);
  }
  std::vector<int64_t> dims = Dims(in_dims, ndims);
  std::string e = g::CheckInputs(*m, ti, ranks, dims, to);
  if (!e.empty()) return Report(e);
  std::shared_ptr<const g::Plan> plan;
  e = g::GetPlan(*m, hash, dims, &plan);
  if (!e.empty()) return Report(e);
  if (temp_bytes < plan->temp_bytes) {
    return Report("the plan needs " + std::to_string(plan->temp_bytes) + " temp bytes, got " +
                  std::to_string(temp_bytes));
  }
  return Report(g::Launch(*plan, ins, outs, temp, stream));
}

void* stitching_gpu_function_new() { return new stitching::gpu::Function; }

void stitching_gpu_function_free(void* fn) {
  if (fn != nullptr) stitching::gpu::FreeFunction(static_cast<stitching::gpu::Function*>(fn));
}

// Records one call (a registered spec's plan for in_dims, with its buffers).
int stitching_gpu_function_add(void* fn, const char* hash, const int64_t* in_dims, int64_t n,
                               const void* const* ins, void* const* outs, void* temp) {
  auto* f = static_cast<stitching::gpu::Function*>(fn);
  if (f == nullptr) return Report("null function");
  if (f->exec != nullptr) return Report("the function was already captured into a graph");
  std::shared_ptr<const stitching::gpu::Plan> plan;
  std::string e = Resolve(hash, in_dims, n, &plan);
  if (!e.empty()) return Report(e);
  if (plan->temp_bytes > 0 && temp == nullptr) return Report("the plan needs a temp buffer");
  stitching::gpu::Function::Call c{plan,
                                   std::vector<const void*>(ins, ins + plan->in_elems.size()),
                                   std::vector<void*>(outs, outs + plan->out_elems.size()),
                                   temp};
  f->calls.push_back(std::move(c));
  return Report("");
}

// Launches every recorded call on `stream`: one launch per step (graph = 0) or one
// replay of the graph captured at the first graph run (graph = 1).
int stitching_gpu_function_run(void* fn, void* stream, int graph) {
  auto* f = static_cast<stitching::gpu::Function*>(fn);
  if (f == nullptr) return Report("null function");
  return Report(stitching::gpu::RunFunction(*f, stream, graph != 0));
}

}  // extern "C"
