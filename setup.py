"""Builds zero.optim._adam_kernel, the C CPU-Adam steps (zero/optim/adam_kernel.c, the exact one; compact_kernel.c,
the compact state formats'); pyproject.toml holds the metadata.

The extension is optional: where it cannot be compiled (no C compiler) the install still succeeds, and
zero.optim.adam_math steps with torch's fused kernel instead.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "zero.optim._adam_kernel",
    ["zero/optim/adam_kernel.c", "zero/optim/compact_kernel.c"],
    depends=["zero/optim/adam_spans.h", "zero/optim/compact_codecs.h"],
    include_dirs=["zero/optim"],
    # -ffp-contract=off: the kernel writes out each FMA torch's kernel makes; the compiler must add none.
    extra_compile_args=["-O3", "-ffp-contract=off"],
    libraries=["m", "dl"],
    optional=True,
)])
