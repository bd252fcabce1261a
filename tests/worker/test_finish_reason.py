"""The engine's finish reasons map to the wire enum through one table."""

from __future__ import annotations

import enum

import pytest

from gpu_worker.api.service import FINISH_REASON_PB, finish_reason_to_pb
from hybridserve.v1 import generation_pb2 as pb


class _Reason(enum.StrEnum):  # the shape of the engine's finish reason
    LENGTH = "length"
    EOS = "eos"


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("", pb.FINISH_REASON_UNSPECIFIED),
        ("length", pb.FINISH_REASON_LENGTH),
        ("stop", pb.FINISH_REASON_STOP),
        ("eos", pb.FINISH_REASON_EOS),
        ("abort", pb.FINISH_REASON_ABORT),
        ("error", pb.FINISH_REASON_ERROR),
        (_Reason.LENGTH, pb.FINISH_REASON_LENGTH),
        (_Reason.EOS, pb.FINISH_REASON_EOS),
    ],
)
def test_engine_reason_maps_to_wire_enum(reason, expected):
    assert finish_reason_to_pb(reason) == expected


def test_every_wire_value_has_one_engine_name():
    assert sorted(FINISH_REASON_PB.values()) == sorted(pb.FinishReason.values())
