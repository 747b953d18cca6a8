// The GPU launcher: runs numba-cuda's compiled kernels of a stitched spec on a CUDA
// stream, from C++ (the TF op's DEVICE_GPU kernel) or through its C ABI (ctypes).
//
// Design
// ------
// Python compiles, C++ launches (docs/gpu.md).  For one spec (keyed by its 24-hex
// SHA-256 prefix, the `spec_hash` the rewrite records) Python registers:
//
//   * a signature (the manifest): input dtypes, ranks and static dims, output dtypes
//     and ranks, checked against every launch as the CPU op checks its node;
//   * kernels, one at a time as plans need them: a name, a PTX (or cubin) image, the
//     mangled entry name in it, and the argument layout (which input/output/workspace
//     array or which scalar of the step goes in each slot; arrays that a 16-byte
//     access needs aligned are marked);
//   * plans, one per tuple of input dims: output dims, workspaces, and the steps
//     (kernel, its scalar-access twin, grid, block, dynamic shared bytes, scalars).
//     A plan depends only on input dims, so a steady-state call is a map lookup and
//     never takes Python's GIL; a miss asks the planner callback once.
//
// A kernel image is loaded with cuModuleLoadDataEx once per CUDA context (the context
// current on the launching thread) and its CUfunction cached.  Launches go to the
// caller's stream with cuLaunchKernel; nothing synchronizes.  numba-cuda passes a 1-D
// array argument as its data model flattened (meminfo, parent, nitems, itemsize, data,
// shape[0], strides[0]; the first two null), then each int64 scalar: the launcher packs
// its parameter array that way.
//
// The CUDA driver is opened with dlopen at the first launch, so a library holding the
// launcher loads on a machine without a GPU driver and fails only when asked to run.
//
// Every entry point validates what it is given (the manifest, kernel layouts and plans
// come through Python from a graph file's spec, so they are data from outside) and
// returns an error message; the empty string is success.
#ifndef STITCHING_RUNTIME_GPU_LAUNCHER_H_
#define STITCHING_RUNTIME_GPU_LAUNCHER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace stitching {
namespace gpu {

// What a kernel's parameter slot holds.
struct Arg {
  enum Kind { kInput, kOutput, kWorkspace, kScalar } kind;
  int index;          // input / output / workspace number, or scalar position in a step
  bool aligned16;     // the kernel moves this array 16 bytes at a time
};

struct Kernel {
  std::string name, entry;
  std::string image;  // PTX text or a cubin, as handed to cuModuleLoadDataEx
  std::vector<Arg> args;
  int scalars = 0;    // scalar slots in args
};

struct Step {
  std::shared_ptr<const Kernel> kernel, alt;  // alt: same results, no 16-byte alignment
  int64_t grid = 0, block = 0, smem = 0;
  std::vector<int64_t> scalars;
};

struct Plan {
  std::vector<int64_t> in_dims;               // the key
  std::vector<std::vector<int64_t>> out_dims;
  std::vector<int64_t> ws_offset, ws_itemsize, ws_elems;   // workspaces in the temp buffer
  int64_t temp_bytes = 0;
  std::vector<Step> steps;
  // elements and bytes per element of each input / output buffer, for the array model
  std::vector<int64_t> in_elems, in_item, out_elems, out_item;
};

struct Signature {
  std::vector<std::string> in_dtypes, out_dtypes;   // "float32", "bool", ...
  std::vector<int> in_ranks, out_ranks;
  std::vector<int64_t> in_static;                   // flattened like in_dims; -1 unknown
};

class Module;  // one spec: signature, kernels, plans (launcher.cc)

// Registration (Python, through the C ABI).  Re-registering a spec keeps the first
// signature if it is identical and refuses a different one.
std::string Register(const std::string& hash, const std::string& manifest);
std::string AddKernel(const std::string& hash, const std::string& name,
                      const std::string& image, const std::string& entry,
                      const std::string& args);
std::string SetPlan(const std::string& hash, const std::vector<int64_t>& in_dims,
                    const std::string& plan);

std::shared_ptr<Module> Find(const std::string& hash);
const Signature& GetSignature(const Module& m);

// Checks the caller's tensors against the signature: counts, dtypes, ranks, static dims.
std::string CheckInputs(const Module& m, const std::vector<std::string>& in_dtypes,
                        const std::vector<int>& in_ranks,
                        const std::vector<int64_t>& in_dims,
                        const std::vector<std::string>& out_dtypes);

// The plan for these input dims (asking the planner callback on a miss).
std::string GetPlan(Module& m, const std::string& hash, const std::vector<int64_t>& in_dims,
                    std::shared_ptr<const Plan>* out);

// Launches every step of `plan` on `stream` (a CUstream; null is the legacy stream).
std::string Launch(const Plan& plan, const void* const* ins, void* const* outs, void* temp,
                   void* stream);

// Callbacks: the planner answers a plan miss with SetPlan; the compiler answers a spec
// miss (given the spec text) with Register and AddKernel.  Both return 0 on success and
// may take Python's GIL.
using PlannerFn = int (*)(const char* hash, const int64_t* in_dims, int64_t n);
using CompilerFn = int (*)(const char* spec);
void SetPlanner(PlannerFn fn);
void SetCompiler(CompilerFn fn);
CompilerFn GetCompiler();

// A whole function's launches (launcher.cc): recorded once, run one launch per step or
// as one CUDA graph captured on the first graph run.  C ABI: stitching_gpu_function_*.
struct Function;
std::string RunFunction(Function& f, void* stream, bool graph);
void FreeFunction(Function* f);

}  // namespace gpu
}  // namespace stitching

#endif  // STITCHING_RUNTIME_GPU_LAUNCHER_H_
