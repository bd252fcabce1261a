"""The committed generated code matches protos/ (regenerated with the pinned grpcio-tools)."""

from __future__ import annotations

from hybridserve import protogen


def test_generated_code_is_up_to_date(capsys):
    assert protogen.main(["--check"]) == 0, capsys.readouterr().out
