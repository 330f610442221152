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
    # -fno-math-errno lets the compiler vectorise sqrt in the Adam/AdaGrad loops; -O3 turns on the vectoriser.
    compile_args = ["-O0", "-g"] if debug else ["-O3", "-fno-math-errno"]

ext = Extension(
    "psrt._core",
    ["psrt/_core.pyx"],
    extra_compile_args=compile_args,
)

setup(ext_modules=cythonize([ext], compiler_directives=directives))
