"""`routereplay env` on an install without a C compiler: every kernel reads "not built", none a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

# a sys.meta_path finder that makes the three C extensions missing, as on an install without a compiler
WITHOUT_KERNELS = """
import importlib.abc, sys
HIDDEN = {"routereplay.codec._set_kernel", "routereplay.wire._base64_kernel", "routereplay._json_scan"}
class NotBuilt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NotBuilt())
import numpy as np
from routereplay import RouteTrace, decode, encode
from routereplay.cli.main import main
trace = RouteTrace(np.array([[[0, 3], [1, 2]]] * 5), 8, (0, 1))
assert decode(encode(trace)) == trace, "the numpy set codec serves without the kernel"
sys.exit(main(["env", "--json"]))
"""


def test_env_without_a_compiler_says_not_built_for_every_kernel() -> None:
    """Issue 30 item 20: with the set kernel's extension missing, `env` said "cannot import name '_set_kernel'
    from partially initialized module 'routereplay.codec' (most likely due to a circular import)": the
    `from routereplay.codec import _set_kernel` form ran while the package was still initialising."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_KERNELS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["set_codec_kernel"].startswith("not built (no C compiler at install time)")
    assert "circular" not in info["set_codec_kernel"] and "partially" not in info["set_codec_kernel"]
    assert info["base64_kernel"].startswith("not built") and info["json_prescan"].startswith("not built")
