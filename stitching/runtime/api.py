"""``stitched_kernel``: put one StitchedKernel op into the current TF program.

Design
------
Given a compiled kernel object, the kernel is registered *before* the op is created
(eagerly: before it runs; in ``tf.function``: at trace time), so the op's constructor
always finds it without a compiler callback.  Given only a spec string, the op relies
on an earlier registration or on the compiler installed with ``set_compiler``.

Output dtypes and static shapes default to what the kernel (or the spec, parsed with
the TF-free IR) says; they become the node's ``Tout``/``output_shapes`` attributes,
which the op's shape function reports to graph shape inference.
"""
from __future__ import annotations

import hashlib

from .registry import load, no_autograph, register, registered_kernel, spec_of


@no_autograph
def stitched_kernel(inputs, kernel_or_spec_json, out_dtypes=None, out_shapes=None,
                    label: str = ""):
    """Run a compiled kernel (or a spec resolved by the registry) on ``inputs``.

    ``out_dtypes``: dtype names or ``tf.DType``s; ``out_shapes``: shapes with ``None``
    (or -1) for dims unknown until run time.  Returns a list of tensors.
    """
    import tensorflow as tf

    module = load()
    spec, kernel = _resolve(kernel_or_spec_json)
    if out_dtypes is None:
        out_dtypes = _default_dtypes(spec, kernel)
    if out_shapes is None:
        out_shapes = _default_shapes(spec, kernel)
    if len(out_shapes) != len(out_dtypes):
        raise ValueError(f"{len(out_dtypes)} output dtypes but {len(out_shapes)} shapes")
    return module.stitched_kernel(
        args=list(inputs), spec=spec,
        spec_hash=hashlib.sha256(spec.encode("utf-8")).hexdigest()[:24],   # op.cc checks it
        Tout=[tf.as_dtype(d) for d in out_dtypes],
        output_shapes=[tf.TensorShape(_shape_dims(s)) for s in out_shapes],
        label=label)


def _resolve(kernel_or_spec_json):
    """(spec string, kernel object or None); registers a kernel object first."""
    if isinstance(kernel_or_spec_json, (str, bytes)):
        spec = kernel_or_spec_json
        if isinstance(spec, bytes):
            spec = spec.decode("utf-8")
        return spec, registered_kernel(spec)
    kernel = kernel_or_spec_json
    register(kernel)
    spec = spec_of(kernel)
    return spec, kernel


def _default_dtypes(spec, kernel):
    if kernel is not None:
        return list(kernel.out_dtypes)
    return [t.dtype for t in _parse(spec).output_types]


def _default_shapes(spec, kernel):
    if kernel is not None and hasattr(kernel.spec, "output_types"):
        return [t.shape for t in kernel.spec.output_types]
    if kernel is not None:  # no static knowledge beyond the ranks
        return [[None] * r for r in kernel.out_ranks]
    return [t.shape for t in _parse(spec).output_types]


def _parse(spec):
    from stitching.ir import KernelSpec
    try:
        return KernelSpec.from_json(spec)
    except ValueError as e:
        raise ValueError(f"out_dtypes/out_shapes not given and the spec does not parse: "
                         f"{e}") from None


def _shape_dims(shape):
    if shape is None:
        return None
    return [None if d is None or d < 0 else int(d) for d in shape]
