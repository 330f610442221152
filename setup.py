"""Build the one compiled extension, ``psrt._core``.

Set ``PSRT_DEBUG_BUILD=1`` to compile with bounds and initialization checks turned back on.
"""

import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("PSRT_DEBUG_BUILD", "") not in ("", "0")
directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": True,
    "embedsignature": True,
}
compile_args = []
if sys.platform != "win32":
    # -O3 turns on the vectoriser; -fno-math-errno lets it vectorise sqrt in the Adam/AdaGrad loops;
    # -ffp-contract=off keeps a*b+c from being fused into an FMA in the AVX2 variants of the kernels (see
    # psrt/_core.pyx), so every variant rounds exactly like the baseline build and like NumPy.
    compile_args = ["-O0", "-g"] if debug else ["-O3", "-fno-math-errno", "-ffp-contract=off"]

ext = Extension(
    "psrt._core",
    ["psrt/_core.pyx"],
    extra_compile_args=compile_args,
)

setup(ext_modules=cythonize([ext], compiler_directives=directives))
