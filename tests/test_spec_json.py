"""KernelSpec.to_json, the text a spec's hash is of: built without to_dict (the
planner hashes every candidate region's spec), it must stay the canonical JSON of
to_dict byte for byte, or every kernel name, cache entry and shipped index changes."""
import hashlib
import json

import pytest

from stitching.ir.builder import SpecBuilder
from stitching.plan import planner


def _reference(spec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _specs():
    b = SpecBuilder()
    x = b.input("float32", (-1, 768))
    g = b.input("float32", (768,))
    m = b.Mean(x, axes=[1], keep_dims=True)
    c = b.Sub(x, m)
    v = b.Mean(b.Square(c), axes=[1], keep_dims=True)
    y = b.Mul(b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-5)))), g)
    yield b.build([y])
    yield b.build([y, m], rows_per_task=4, col_block=256, scratch=1)
    b = SpecBuilder()
    x = b.input("float32", [-1, 2, 8, 4])
    z = b.input("float32", [-1, 8, 2, 4])
    yield b.build([b.Transpose(b.Neg(x), perm=[0, 2, 1, 3]), b.Exp(z)],
                  same_dims=(((0, 0), (1, 0)),))
    b = SpecBuilder()
    x = b.input("float32", (16, 32))
    yield b.build([b.Maximum(x, b.const(float("-inf"))), b.Minimum(x, b.const(float("inf")))])
    from irbuild import encoder
    yield from (r.spec for r in planner.plan(encoder(2), lambda s: None).regions)


@pytest.mark.parametrize("spec", list(_specs()), ids=lambda s: s.hash[:8])
def test_to_json_is_the_canonical_json_of_to_dict(spec):
    text = _reference(spec)
    assert spec.to_json() == text
    assert spec.hash == hashlib.sha256(text.encode()).hexdigest()[:24]
    assert type(spec).from_json(text).hash == spec.hash


def test_a_non_finite_float_inside_a_list_is_still_refused():
    from stitching.ir.spec import KernelSpec, SpecNode
    from stitching.ir.graph import TensorType
    t = TensorType("float32", (2,))
    spec = KernelSpec((t,), (SpecNode("Const", (), {"value": [1.0, float("nan")]}, t),), (0,))
    with pytest.raises(ValueError):
        _reference(spec)
    with pytest.raises(ValueError):
        spec.to_json()
