"""The optional C kernels, built at install: the set codec's row loops (src/routereplay/codec/set_kernel.c),
strict base64 for engine payloads (src/routereplay/wire/base64_kernel.c) and the bounded JSON parser's
pre-check (src/routereplay/json_scan.c).

Everything else is declared in pyproject.toml. Both extensions are optional: where no C compiler or
Python headers exist, pip installs the package without them and the numpy / binascii paths run
(`routereplay env` says which are in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "routereplay.codec._set_kernel",
            sources=["src/routereplay/codec/set_kernel.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "routereplay.wire._base64_kernel",
            sources=["src/routereplay/wire/base64_kernel.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "routereplay._json_scan",
            sources=["src/routereplay/json_scan.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
