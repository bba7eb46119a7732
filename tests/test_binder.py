"""The one argument binder: Python's matching rules, and which rule a bad call broke."""
import pytest

from flowgrad.binder import REQUIRED, BindError, Signature, did_you_mean, suggest

SIG = Signature([("x", REQUIRED), ("axis", None), ("keepdims", False)])


def test_binds_positionals_keywords_and_defaults():
    assert SIG.bind((1,), {"keepdims": True}) == {"x": 1, "axis": None, "keepdims": True}
    assert Signature([("in", REQUIRED)]).bind((), {"in": 3}) == {"in": 3}  # any name a model can spell


@pytest.mark.parametrize("args, kwargs, kind, name, index", [
    ((1, 2, 3, 4), {}, "too-many", None, 3),
    ((1,), {"axes": 0}, "unknown", "axes", None),
    ((1,), {"x": 2}, "twice", "x", None),
    ((), {"axis": 0}, "missing", "x", None),
])
def test_says_which_rule_broke(args, kwargs, kind, name, index):
    with pytest.raises(BindError) as e:
        SIG.bind(args, kwargs)
    assert (e.value.kind, e.value.name, e.value.index) == (kind, name, index)


def test_positional_limit_and_variadic():
    sig = Signature([("lr", 0.1), ("clip", None)], positional=1)
    with pytest.raises(BindError) as e:
        sig.bind((0.1, 1.0), {})
    assert e.value.kind == "too-many" and e.value.limit == 1
    cat = Signature([("xs", REQUIRED), ("axis", -1)], variadic="xs")
    assert cat.bind((1, 2, 3), {}) == {"xs": (1, 2, 3), "axis": -1}
    assert cat.bind((), {"xs": [1, 2]}) == {"xs": ([1, 2],), "axis": -1}


def test_did_you_mean():
    assert did_you_mean("relo", ["relu", "gelu", "exp"]) == "did you mean relu?"
    assert did_you_mean("zzz", ["relu"]) is None
    assert suggest("relo", ["relu"]) == " (did you mean relu?)" and suggest("zzz", ["relu"]) == ""
