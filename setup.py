"""Build hook (everything else is in pyproject.toml): the wheel carries the repository's
top-level data folders (harness.resources.SHIPPED: ds_configs/, baselines/) as package data
under harness/_data/, where harness.resources finds them once installed. Each file stays once
in git, at the top of the repository; an editable install reads them there."""

import os
import runpy
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
RESOURCES = runpy.run_path(os.path.join(HERE, "harness", "resources.py"))  # standard library only


class build_py_with_data(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # editable: harness.resources reads the repository
            return
        for folder in RESOURCES["SHIPPED"]:
            dst = os.path.join(self.build_lib, "harness", RESOURCES["PACKAGED"], folder)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(os.path.join(HERE, folder), dst, ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))


setup(cmdclass={"build_py": build_py_with_data})
