"""Builds the C extensions (pyproject.toml holds the metadata): zero.optim._adam_kernel, the CPU-Adam steps
(zero/optim/adam_kernel.c, the exact one; compact_kernel.c, the compact state formats'), and tiering._aio, the
kernel AIO queue the `libaio` engine runs on (tiering/_aio.c: submitted and reaped without the GIL).

Both are optional: where they cannot be compiled (no C compiler) the install still succeeds, zero.optim.adam_math
steps with torch's fused kernel instead, and the `auto` engine takes `threads`.
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension(
        "zero.optim._adam_kernel",
        ["zero/optim/adam_kernel.c", "zero/optim/compact_kernel.c"],
        depends=["zero/optim/adam_spans.h", "zero/optim/compact_codecs.h"],
        include_dirs=["zero/optim"],
        # -ffp-contract=off: the kernel writes out each FMA torch's kernel makes; the compiler must add none.
        extra_compile_args=["-O3", "-ffp-contract=off"],
        libraries=["m", "dl"],
        optional=True,
    ),
    Extension("tiering._aio", ["tiering/_aio.c"], extra_compile_args=["-O2", "-Wall"], libraries=["pthread"],
              optional=True),
])
