"""The checked-in stubs are exactly what `make proto` generates from the .proto files."""

from pathlib import Path

from tinker_atropos.protocol import codegen


def test_checked_in_stubs_are_up_to_date(tmp_path: Path) -> None:
    generated = codegen.generate(tmp_path)
    assert generated, "protoc generated nothing"
    checked_in = codegen.PROTO_DIR
    names = {p.name for p in generated}
    assert names == {p.name for p in checked_in.glob("*_pb2*.py*")}, "stub files differ; run `make proto`"
    for fresh in generated:
        stale = (checked_in / fresh.name).read_text()
        assert stale == fresh.read_text(), f"{fresh.name} is out of date; run `make proto`"
