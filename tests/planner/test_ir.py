"""Op text round-trips, program golden-file format, and the planner's torch-free import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxkfac.planner.problem.errors import PlanFormatError
from fxkfac.planner.problem.ir import (
    OP_FIELDS,
    Capture,
    LayerTiming,
    Op,
    OpKind,
    format_program,
    format_programs,
    parse_program,
    parse_programs,
)

EXAMPLES = {
    "F s1 m0": Op(OpKind.FWD, 1, 0),
    "B s3 m2 p1": Op(OpKind.BWD, 3, 2, pipe=1),
    "W s0 m1": Op(OpKind.BWD_W, 0, 1),
    "W s0 m1 p1 fc2": Op(OpKind.BWD_W, 0, 1, pipe=1, layer="fc2"),
    "W s2 m0 bert.encoder.layer.0.output.dense": Op(OpKind.BWD_W, 2, 0, layer="bert.encoder.layer.0.output.dense"),
    "SEND_ACT s1 m0 >r2": Op(OpKind.SEND_ACT, 1, 0, peer=2),
    "RECV_GRAD s1 m0 <r2": Op(OpKind.RECV_GRAD, 1, 0, peer=2),
    "STATS s1 m3 A bert.encoder.layer.0.output.dense": Op(
        OpKind.STATS, 1, 3, layer="bert.encoder.layer.0.output.dense", part="A"
    ),
    "SYNC_STATS s1 B fc1": Op(OpKind.SYNC_STATS, 1, layer="fc1", part="B"),
    "DECOMP s1 A 0": Op(OpKind.DECOMP, 1, layer="0", part="A"),
    "DECOMP s1 A 1/3 fc": Op(OpKind.DECOMP, 1, layer="fc", part="A", piece=(1, 3)),
    "BCAST s1 A @r3 fc": Op(OpKind.BCAST, 1, layer="fc", part="A", root=3),
    "APPLY s1": Op(OpKind.APPLY, 1),
    "APPLY s1 fc": Op(OpKind.APPLY, 1, layer="fc"),
    "BCAST s1 A @r2 {0,2} fc": Op(OpKind.BCAST, 1, layer="fc", part="A", root=2, group=(0, 2)),
    "BCAST_PREC s0 @r1 {1,3} fc": Op(OpKind.BCAST_PREC, 0, layer="fc", root=1, group=(1, 3)),
    "ALLREDUCE_GRAD s1": Op(OpKind.ALLREDUCE_GRAD, 1),
    "OPT_STEP": Op(OpKind.OPT_STEP),
}


@pytest.mark.parametrize("text", sorted(EXAMPLES))
def test_documented_spellings(text: str) -> None:
    assert str(EXAMPLES[text]) == text
    assert Op.parse(text) == EXAMPLES[text]


def test_ambiguous_layer_names_are_quoted() -> None:
    for layer in ("A", "s1", "m0", "p2", "0/2", ">r1", "has space", 'quo"te', "ünï"):
        op = Op(OpKind.STATS, 0, 1, layer=layer, part="B")
        assert Op.parse(str(op)) == op
        assert str(op).endswith(json.dumps(layer))


_VALUES = {
    "stage": st.integers(0, 200),
    "mb": st.integers(0, 200),
    "pipe": st.integers(1, 3),
    "layer": st.text(min_size=1, max_size=12),
    "part": st.sampled_from("ABDLR"),
    "peer": st.integers(0, 99),
    "root": st.integers(0, 99),
    "group": st.sets(st.integers(0, 99), min_size=2, max_size=5),
    "piece": st.integers(2, 9).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
}


@st.composite
def ops(draw: st.DrawFn) -> Op:
    """Any op its kind allows: every required field, and each allowed one or not."""
    kind = draw(st.sampled_from(list(OpKind)))
    required, allowed = OP_FIELDS[kind]
    fields = {name: draw(_VALUES[name]) for name in sorted(required)}
    fields.update({name: draw(_VALUES[name]) for name in sorted(allowed) if draw(st.booleans())})
    if "group" in fields:  # a broadcast's group holds its root
        fields["group"] = tuple(sorted(fields["group"] | {fields["root"]}))
    return Op(kind, **fields)


_UNTIMED = settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
"""Round trips do not depend on speed; on a shared 2-core machine generation alone can take seconds."""


@_UNTIMED
@given(ops())
def test_round_trip(op: Op) -> None:
    assert Op.parse(str(op)) == op
    assert "\n" not in str(op)


@_UNTIMED
@given(st.dictionaries(st.integers(0, 7), st.lists(st.lists(ops(), max_size=4), min_size=1, max_size=3), max_size=4))
def test_programs_round_trip(programs: dict[int, list[list[Op]]]) -> None:
    assert parse_programs(format_programs(programs)) == programs
    for program in programs.values():
        assert parse_program(format_program(program)) == program


@pytest.mark.parametrize(
    "text",
    ["X s1", "F s1 two words", "F s1 m0 <r2", "F s1 m0 bad name!", 'DECOMP s0 A "unterminated', "SEND_ACT s0 <r1"],
)
def test_bad_text_is_refused(text: str) -> None:
    with pytest.raises(PlanFormatError):
        Op.parse(text)


def test_bad_fields_are_refused() -> None:
    with pytest.raises(PlanFormatError):
        Op(OpKind.FWD, -1, 0)
    with pytest.raises(PlanFormatError, match="one capital letter"):
        Op(OpKind.STATS, 0, 0, part="ab")
    with pytest.raises(PlanFormatError, match=r"BCAST needs \['root', 'stage'\]"):
        Op(OpKind.BCAST, 0, part="A")
    with pytest.raises(PlanFormatError, match="F.*may have \\['pipe'\\], got \\['mb', 'root', 'stage'\\]"):
        Op(OpKind.FWD, 0, 0, root=1)
    for piece in ((2, 2), (0, 1), (-1, 2), (0, 2, 1)):
        with pytest.raises(PlanFormatError, match="Op.piece must be"):
            Op(OpKind.DECOMP, 0, part="A", piece=piece)  # type: ignore[arg-type]  # malformed pieces are the point
    with pytest.raises(PlanFormatError, match="may have"):
        Op(OpKind.BCAST, 0, part="A", root=0, piece=(0, 2))
    with pytest.raises(PlanFormatError):
        parse_programs("F s0 m0\n")


def test_typed_accessors_return_named_fields_and_refuse_absent_ones() -> None:
    op = Op.parse("STATS s1 m3 A fc")
    assert (op.stage_id, op.mb_id, op.layer_name, op.part_name) == (1, 3, "fc", "A")
    assert Op.parse("SEND_ACT s0 m1 >r2").peer_rank == 2
    whole = Op.parse("DECOMP s1")  # every layer and part of the stage
    with pytest.raises(PlanFormatError, match="DECOMP s1 names no layer"):
        _ = whole.layer_name
    with pytest.raises(PlanFormatError, match="names no mb"):
        _ = whole.mb_id


def test_layer_timing_fields() -> None:
    timing = LayerTiming(period=3, curv_step=1, use_offset=2, capture="deferred")
    assert timing.period == 3 and timing.capture is Capture.DEFERRED
    with pytest.raises(PlanFormatError, match="'fused', 'deferred'"):
        LayerTiming(1, 0, 0, "lazy")


def test_planner_does_not_import_torch() -> None:
    code = (
        "import sys, importlib, pkgutil, fxkfac.planner as p\n"
        "for m in pkgutil.iter_modules(p.__path__):\n"
        "    importlib.import_module('fxkfac.planner.' + m.name)\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
