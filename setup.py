"""Builds the paged decode kernel ahead of time, as a real extension inside the package, whenever torch is
importable at build time: `pip install --no-build-isolation .` (or `pip wheel`), as the image build does.
In an isolated build without torch the package installs without it, and pods build it at first use."""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

MODEL_PACKAGE = Path("shared", "engine", "model")


def _kernel_build():
    # Loaded by path: importing the package itself would pull in the engine.
    spec = importlib.util.spec_from_file_location("kernel_build", MODEL_PACKAGE / "kernel_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_extension_args() -> dict:
    if os.environ.get("PDSERVE_SKIP_KERNEL_BUILD") == "1":
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("setup.py: torch is not importable here, so the paged decode kernel is not prebuilt; pods will "
              "build it at first use (install with --no-build-isolation to prebuild it)", file=sys.stderr)
        return {}
    build = _kernel_build()
    extension = CppExtension(
        name=".".join([*MODEL_PACKAGE.parts, build.PREBUILT_MODULE]),
        sources=[str(MODEL_PACKAGE / "csrc" / name) for name in build.SOURCE_NAMES],
        extra_compile_args=list(build.CFLAGS),
        extra_link_args=list(build.LDFLAGS),
        py_limited_api=False,
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(**kernel_extension_args())
