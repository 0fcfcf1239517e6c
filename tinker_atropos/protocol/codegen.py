"""Regenerate the Python stubs from the .proto files: ``python -m tinker_atropos.protocol.codegen``.

The stubs are checked in so that the package imports without grpcio-tools; a test regenerates them into a
temporary folder and fails if the checked-in ones differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).parent / "v1"
REPO_ROOT = Path(__file__).parents[2]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto under protocol/v1, writing the package tree under ``out_dir``."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(REPO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / PROTO_DIR.relative_to(REPO_ROOT)).glob("*_pb2*.py*"))


def main() -> None:
    written = generate(REPO_ROOT)
    print("\n".join(str(p.relative_to(REPO_ROOT)) for p in written))


if __name__ == "__main__":
    sys.exit(main())
