// A node's TF function, instantiated where it can be found and run on the caller's
// thread: what StitchedKernel (op.cc: its original ops, for a fallback, a guard or an
// autotune comparison) and StitchedAttention (attention.cc: its unfused ops, for the
// autotune comparison) share.  Header-only: the two ops live in separate libraries
// (build.py), each compiles its own copy.
#ifndef STITCHING_RUNTIME_FUNCTIONS_H_
#define STITCHING_RUNTIME_FUNCTIONS_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/common_runtime/process_function_library_runtime.h"
#include "tensorflow/core/framework/function.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace stitching_fn {

// The name a SavedModel's loader gave the library function `name`: it registers each
// one as a ConcreteFunction, `__inference_<name>_<uid>`, and renames the func-typed
// attrs that call it, not a string attr like `_stitching_original` (a saved
// stitching.function's guard then found no function, and a call the kernel was not
// built for -- a batch of 1 that broadcasts -- failed where TF answers).  `name`
// itself where no such function is there.
inline std::string LoadedName(const tensorflow::FunctionLibraryDefinition& lib,
                              const std::string& name) {
  const std::string prefix = absl::StrCat("__inference_", name, "_");
  for (const std::string& f : lib.ListFunctionNames()) {
    if (f.size() > prefix.size() && f.compare(0, prefix.size(), prefix) == 0 &&
        std::all_of(f.begin() + prefix.size(), f.end(),
                    [](char c) { return c >= '0' && c <= '9'; })) {
      return f;
    }
  }
  return name;
}

// Where one node instantiates functions it names by a string attr.  Instantiate puts
// `fn` in `flib`, the running graph's function library, and says which library
// runtime holds it (`used`).  Where that library lacks it -- named by a string attr,
// the function is not reachable from the graph, and TF prunes a graph's library to
// what its nodes reach -- in a copy of the process's library, where stitching defined
// it (tf/function.py _define_fallbacks) or a SavedModel's loader registered it.  The
// copy costs time in proportion to the process's library, once per node.  Called by
// one thread at a time.
class NamedFunctions {
 public:
  absl::Status Instantiate(tensorflow::FunctionLibraryRuntime* flib,
                           const tensorflow::NameAttrList& fn,
                           tensorflow::FunctionLibraryRuntime** used,
                           tensorflow::FunctionLibraryRuntime::Handle* handle) {
    const tensorflow::FunctionLibraryDefinition* own = flib->GetFunctionLibraryDefinition();
    std::string name = fn.name();
    if (own == nullptr || !own->Contains(name)) {
      if (process_flr_ == nullptr) {
        absl::Status cloned = flib->Clone(&process_lib_def_, &process_pflr_, &process_flr_);
        if (!cloned.ok()) return cloned;
      }
      flib = process_flr_;
      if (!process_lib_def_->Contains(name)) name = LoadedName(*process_lib_def_, name);
    }
    *used = flib;
    return flib->Instantiate(name, tensorflow::AttrSlice(&fn.attr()), handle);
  }

 private:
  std::unique_ptr<tensorflow::FunctionLibraryDefinition> process_lib_def_;
  std::unique_ptr<tensorflow::ProcessFunctionLibraryRuntime> process_pflr_;
  tensorflow::FunctionLibraryRuntime* process_flr_ = nullptr;
};

// Runs function `handle` of `flib` on the node's inputs and sets its outputs.
inline absl::Status RunInline(tensorflow::OpKernelContext* ctx,
                              tensorflow::FunctionLibraryRuntime* flib,
                              tensorflow::FunctionLibraryRuntime::Handle handle,
                              const std::string& who) {
  tensorflow::FunctionLibraryRuntime::Options opts(ctx->step_id());
  opts.rendezvous = ctx->rendezvous();
  opts.cancellation_manager = ctx->cancellation_manager();
  opts.step_container = ctx->step_container();
  opts.collective_executor = ctx->collective_executor();
  // The function's ops run on this thread (inline), not queued to ctx->runner(), the
  // inter-op pool this Compute already holds a thread of and blocks in RunSync:
  // several nodes doing so at once (a training step's held tier-1 kernels,
  // Entry::hold) took every pool thread and waited for ops queued behind them -- a
  // hang, seen on 2 cores.  Each op still uses the intra-op pool for its own work.
  static std::function<void(std::function<void()>)> inline_runner =
      [](std::function<void()> fn) { fn(); };
  opts.runner = &inline_runner;
  std::vector<tensorflow::Tensor> args, rets;
  for (int i = 0; i < ctx->num_inputs(); ++i) args.push_back(ctx->input(i));
  TF_RETURN_IF_ERROR(flib->RunSync(opts, handle, args, &rets));
  if (static_cast<int>(rets.size()) != ctx->num_outputs()) {
    return absl::InternalError(absl::StrCat(who, ": its function returned ", rets.size(),
                                            " tensors, expected ", ctx->num_outputs()));
  }
  for (int i = 0; i < ctx->num_outputs(); ++i) ctx->set_output(i, rets[i]);
  return absl::OkStatus();
}

}  // namespace stitching_fn

#endif  // STITCHING_RUNTIME_FUNCTIONS_H_
