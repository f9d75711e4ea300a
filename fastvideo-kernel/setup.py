"""fastvideo-kernel wheel: setuptools plus one nvcc call (build_lib.py) during build_py.

The library is a plain C ABI loaded with ctypes, so neither torch nor CMake is needed to build it,
and the wheel does not depend on torch's C++ ABI. The wheel is platform-specific (it carries a
compiled .so), hence the distribution that reports extension modules.
"""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_lib


class BuildPyWithKernel(build_py):
    def run(self) -> None:
        super().run()
        if not self.dry_run:
            # The product library only: the test library (build_lib.py --testing) never ships.
            build_lib.build(Path(self.build_lib) / "fastvideo_kernel" / "lib")


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithKernel}, distclass=BinaryDistribution)
