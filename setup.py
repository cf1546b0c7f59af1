"""The optional C kernel of the set codec (src/routereplay/codec/set_kernel.c), built at install.

Everything else is declared in pyproject.toml. The extension is optional: where no C compiler or
Python headers exist, pip installs the package without it and the codec runs its numpy paths
(`routereplay env` says which one is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "routereplay.codec._set_kernel",
            sources=["src/routereplay/codec/set_kernel.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
