"""The source printer (flowgrad.dsl.printer): any valid program printed and
parsed back is the same syntax tree, builds the same graph, and gets the
same `flowgrad check` output. Programs come from the fuzzer's generators
(grammar-generated, mostly well-typed, and mutated example models), drawn
by hypothesis; only those that build count."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import random
import re
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import flowgrad as fg
from flowgrad import cli, dsl
from flowgrad.dsl.printer import to_source
from flowgrad.errors import FlowError

ROOT = Path(__file__).resolve().parent.parent


def load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz", ROOT / "scripts" / "fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FUZZ = load_fuzz()
EXAMPLES = FUZZ.example_texts()


def tree(node):
    """A syntax tree without its positions, for comparing two parses."""
    if isinstance(node, tuple):
        return tuple(tree(x) for x in node)
    if attrs.has(type(node)):
        return (type(node).__name__,) + tuple(tree(getattr(node, f.name)) for f in attrs.fields(type(node))
                                               if f.name not in ("pos", "func_pos"))
    return node


def builds(text: str) -> bool:
    try:
        fg.loads(text).build()
    except FlowError:
        return False
    return True


def check_output(text: str, path: Path) -> tuple[int, str, str]:
    """What `flowgrad check` prints, with positions in messages masked (the
    printed file lays the same program out on other lines)."""
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["check", str(path)])
    errors = [re.sub(r":\d+:\d+", ":L:C", line) for line in err.getvalue().splitlines() if line.startswith("error:")]
    return rc, out.getvalue(), "\n".join(errors)


def ir(text: str) -> str:
    """The graph in the IR printer's form, without the `# file:line` comments."""
    return "\n".join(line.split("   # ")[0] for line in str(fg.loads(text).build()).splitlines())


def assert_round_trips(text: str, tmp: Path) -> None:
    printed = to_source(dsl.parse(text))
    assert tree(dsl.parse(printed).stmts) == tree(dsl.parse(text).stmts), printed
    assert to_source(dsl.parse(printed)) == printed
    assert ir(printed) == ir(text), printed
    assert check_output(printed, tmp / "m.flow") == check_output(text, tmp / "m.flow"), printed


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_model_round_trips(name, tmp_path):
    assert_round_trips(EXAMPLES[name], tmp_path)


@st.composite
def valid_programs(draw):
    """A program that builds: from the grammar generator, the well-typed
    generator, or an example model mutated until one builds (else as is)."""
    kind = draw(st.sampled_from(["grammar", "typed", "mutated"]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    for _ in range(40):
        if kind == "mutated":
            text = FUZZ.mutate(rng, rng.choice(sorted(EXAMPLES.values())))
        else:
            text = (FUZZ.gen_program if kind == "grammar" else FUZZ.gen_typed)(rng)
        if builds(text):
            return text
    return rng.choice(sorted(EXAMPLES.values()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(text=valid_programs())
def test_any_valid_program_round_trips_through_the_printer(text, tmp_path):
    assert_round_trips(text, tmp_path)


def test_the_printer_brackets_only_where_precedence_needs_it():
    for text in ["y = -x ** 2 - (b - c) - -d * (e + f) @ g ** -h ** i\n", "y = (-x) ** 2 + (x ** y) ** z\n",
                 "y = a - (b + c)\n", "y = f(a, [1, 2.5, 'q\\n'], k=-1e-05)\n"]:
        assert to_source(dsl.parse(text)) == text
