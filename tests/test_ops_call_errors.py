"""A bad call of one_hot cumsum var std stack squeeze unsqueeze einsum
gather scatter_add maxpool1d avgpool1d interpolate is one FlowError at the
call's file:line:col that says what is wrong, when the model is built."""
from __future__ import annotations

import pytest

import flowgrad as fg

HEAD = ("input x: f32[2, 3]\ninput t: f32[2, 1, 3]\ninput i: i32[2, 3]\ninput s: f32[2, 3, 7]\n"
        "input img: f32[1, 2, 3, 4]\n")
LINE = HEAD.count("\n") + 1

BAD = [
    ('einsum("ij,jk->ik", x)', ["equation 'ij,jk->ik' has 2 operands, but 1 tensor was given"]),
    ('einsum("i1", x)', ["operand 0's subscripts 'i1' hold '1'", "letters"]),
    ('einsum("ij->k", x)', ["output subscript k is no operand's subscript"]),
    ('einsum("ij,jk", x, t)', ["operand 1's subscripts 'jk' name 2 axes", "[2, 1, 3]", "'...'"]),
    ('einsum("ij,kj->ik", x, s)', ["operand 1", "[2, 3, 7]"]),
    ('einsum("ij,jk->ik", x, x)', ["subscript j has size 2 in operand 1 and 3 before it"]),
    ('einsum("ij->ii", x)', ["the output subscripts 'ii' name i twice"]),
    ('einsum("i...j...", t)', ["operand 0's subscripts 'i...j...' hold more than one '...'"]),
    ('einsum("ii", x)', ["subscript i repeats in operand 0 with sizes 2 and 3"]),
    ('einsum("ij", i)', ["float", "i32[2,3]"]),
    ("gather(x, 2, i)", ["gather: axis 2 is out of range for a tensor of rank 2"]),
    ("gather(x, 1, x)", ["index must be i32, got f32[2,3]"]),
    ("gather(t, 2, i)", ["index i32[2,3] and x f32[2,1,3] must have the same rank"]),
    ("gather(x, 1, reshape(i, [3, 2]))", ["index i32[3,2] is larger than x f32[2,3] on axis 0", "every axis but axis 1"]),
    ("scatter_add(x, 1, i, i)", ["x and src", "f32[2,3]", "i32[2,3]"]),
    ("scatter_add(x, 1, i, slice(x, 1, 0, 2))", ["index i32[2,3] is larger than src f32[2,2] on axis 1"]),
    ("one_hot(i, 0)", ["n=0 must be a positive number of classes"]),
    ("one_hot(x, 3)", ["i must be i32, got f32[2,3]"]),
    ("one_hot(i, 3, dtype=i32)", ["dtype=i32 must be a float dtype"]),
    ("var(t, axis=1)", ["correction=1 leaves no degrees of freedom: it reduces 1 element"]),
    ("std(x, correction=6)", ["correction=6 leaves no degrees of freedom: it reduces 6 elements"]),
    ("var(i)", ["float", "i32[2,3]"]),
    ("cumsum(x, 2)", ["cumsum: axis 2 is out of range for a tensor of rank 2"]),
    ("cumsum(x)", ["missing its argument 'axis'"]),
    ("squeeze(t, axis=3)", ["axis 3 is out of range for a tensor of rank 3"]),
    ("squeeze(t, axis=[1, -2])", ["names the same axis twice"]),
    ("unsqueeze(x, 3)", ["axis 3 is out of range for unsqueezing a tensor of rank 2 (valid: -3..2)"]),
    ("stack(x, t)", ["tensors must have one shape", "f32[2,3]", "f32[2,1,3]"]),
    ("stack(x, x, axis=-4)", ["axis -4 is out of range for unsqueezing a tensor of rank 2"]),
    ("maxpool1d(img, 2)", ["x must be [batch, channels, length], got f32[1,2,3,4]"]),
    ("maxpool1d(s, 9)", ["kernel_size=9 does not fit in the padded length 7"]),
    ("avgpool1d(s, 2, padding=2)", ["padding=2 must be at most half of kernel_size=2"]),
    ("maxpool1d(s, [2, 2])", ["kernel_size=[2, 2] must be an int"]),
    ("interpolate(img, size=2, scale_factor=2)", ["give size or scale_factor (one of them)"]),
    ("interpolate(img)", ["give size or scale_factor (one of them)"]),
    ('interpolate(img, size=2, mode="bicubic")', ["mode='bicubic' must be \"nearest\" or \"bilinear\""]),
    ("interpolate(s, size=2)", ["x must be [batch, channels, height, width], got f32[2,3,7]"]),
    ("interpolate(img, scale_factor=0.2)", ["scale_factor=0.2 leaves no pixel", "[0, 0]"]),
    ("interpolate(img, size=[2, 0])", ["size=[2, 0] must be a positive int or a list of two"]),
]


@pytest.mark.parametrize("call, shows", BAD, ids=[b[0] for b in BAD])
def test_a_bad_call_is_an_error_at_the_call(call, shows):
    with pytest.raises(fg.FlowError) as e:
        fg.loads(f"{HEAD}y = {call}\noutput y\n", file="bad.flow")
    assert e.value.span.where() == f"bad.flow:{LINE}:5", str(e.value)
    op = call.partition("(")[0]
    assert e.value.message.startswith(f"{op}"), e.value.message
    for fragment in shows:
        assert fragment in e.value.message, f"{fragment!r} missing from: {e.value.message}"
