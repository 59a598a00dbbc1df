"""The api-side modules and the client never import jax (the api process must not)."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["jaxserve.api.detokenizer", "jaxserve.api.stop_strings",
           "jaxserve.api.incremental_output", "jaxserve.api.validation", "jaxserve.validation",
           "jaxserve.proto.convert", "jaxserve.proto.generate_pb2_grpc", "jaxserve.client"]


def test_no_jax_import():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib')))\n"
            + "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
