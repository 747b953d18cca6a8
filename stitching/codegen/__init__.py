"""Code generation: Schedule -> kernel source text (TF-free).

Backends side by side over one shared lowering::

    lower/     what every backend shares: op -> expression and reductions (exprs.py),
               the base emitter and source writer (emitter.py), the shape function
               as data (shape_program.py) and its interpreter (shape_interp.py), and
               the shape-generic twin a spec compiles as (specialize.py)
    cpu/       the CPU backend: loop nests over rows / column blocks (emit.py), the
               helper namespace generated code calls (rt.py), vectorizable fast
               math (fastmath.py) and LLVM intrinsics (intrinsics.py)
    cuda/      the CUDA backend: kernels per schedule kind (emit.py), launch
               choice (launch.py), the device helper namespace (rt.py with gpu.py /
               sim.py leaves) and a float64 reference interpreter (ref.py)

The contract, the same for each backend: ``<backend>.emit(schedule)`` returns the
module text, its error messages and its shape program (``lower.emitter.KernelSource``
for the CPU, ``cuda.emit.CudaSource`` for CUDA).  Turning that text into machine code,
caching it and running it is the next layer, ``stitching.compile``.
"""
