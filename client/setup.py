"""Builds tessera-client with its own tessera.v1 stubs, compiled from ../protos by grpcio-tools
(build-system.requires), so that `pip install ./client` needs no tessera-common.

An editable install compiles nothing: in the dev venv (`make install`) tessera.v1 is
tessera-common's (protos/generate.py writes it into common/tessera/v1), shared through the
`tessera` namespace.
"""
from __future__ import annotations

import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PROTOS = HERE.parent / "protos"


class BuildWithStubs(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        self.compile_stubs(pathlib.Path(self.build_lib))

    @staticmethod
    def compile_stubs(out: pathlib.Path) -> None:
        from grpc_tools import protoc  # build-system.requires

        sources = sorted((PROTOS / "tessera" / "v1").glob("*.proto"))
        if not sources:
            raise SystemExit(f"tessera-client: no .proto files under {PROTOS / 'tessera' / 'v1'} "
                             "(build from the repository's client/ directory: pip builds it in place)")
        include = pathlib.Path(protoc.__file__).parent / "_proto"
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}",
                          f"--grpc_python_out={out}", f"--pyi_out={out}",
                          *(str(p.relative_to(PROTOS)) for p in sources)])
        if rc != 0:
            raise SystemExit("tessera-client: protoc failed on ../protos")
        (out / "tessera" / "v1" / "__init__.py").write_text('"""Generated from protos/ at build time."""\n')


setup(cmdclass={"build_py": BuildWithStubs})
