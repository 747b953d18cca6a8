"""stitching.Options: every field checked for type and range, the field named in the
error (Options(background_compile="no") used to turn the option on)."""
import dataclasses
import math

import pytest

import stitching
from stitching.options import Options


def test_defaults_construct():
    o = Options()
    assert o.planner == "search" and o.min_ops == 2 and o.autotune_margin == 1.3
    assert dataclasses.replace(o, autotune=True, autotune_margin=math.inf).autotune


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Options)])
def test_every_field_refuses_an_arbitrary_object_and_names_itself(field):
    """Also the guard for a new field: one added without a check fails here."""
    with pytest.raises((TypeError, ValueError), match=rf"Options\.{field}\b"):
        Options(**{field: object()})


@pytest.mark.parametrize("kw, error", [
    ({"background_compile": "no"}, TypeError),
    ({"autotune": "yes"}, TypeError),
    ({"gemm": 1}, TypeError),
    ({"verify": None}, TypeError),          # only progress takes None
    ({"progress": "auto"}, TypeError),
    ({"min_ops": 0}, ValueError),
    ({"min_ops": 2.0}, TypeError),
    ({"min_ops": True}, TypeError),
    ({"planner": "xla"}, ValueError),
    ({"planner": 3}, ValueError),
    ({"autotune_margin": 0.99}, ValueError),
    ({"dump_dir": 5}, TypeError),
    ({"exclude": ("Softmax", 3)}, TypeError),
    ({"exclude": {"Softmax"}}, TypeError),      # a set has no order: the first match names
    ({"exclude": b"Softmax"}, TypeError),
    ({"exclude": ""}, ValueError),
    ({"exclude": ["Softmax", ""]}, ValueError),
])
def test_bad_values_raise_naming_the_field(kw, error):
    (name, _), = kw.items()
    with pytest.raises(error, match=rf"Options\.{name}"):
        Options(**kw)


def test_exclude_takes_one_entry_or_a_list_as_a_tuple():
    assert Options(exclude="Softmax").exclude == ("Softmax",)
    assert Options(exclude=["Softmax", "model/block3*"]).exclude == \
        ("Softmax", "model/block3*")
    assert Options().exclude == () and Options(exclude=()).exclude == ()
    hash(Options(exclude=["a"]))                 # frozen: still hashable


def test_good_values_pass():
    import numpy as np
    Options(progress=None, min_ops=np.int64(1), autotune_margin=math.inf,
            planner="full", dump_dir=None)
    assert stitching.Options is Options
