"""Packaging shim: metadata lives in setup.cfg.

The C++ ops are not built here: they are compiled on first use (or by `fp8kv build`) for the machine they
run on, so one source tree serves CPU, CUDA and ROCm installs. The csrc/ tree is shipped inside the
package so that a non-editable install can still compile it.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithSources(build_py):
    def run(self) -> None:
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        target = os.path.join(self.build_lib, "fp8cache", "csrc")
        if os.path.isdir(os.path.join(here, "csrc")):
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(os.path.join(here, "csrc"), target)


setup(cmdclass={"build_py": BuildPyWithSources})
