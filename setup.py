"""Build script: the pure-Python package plus the optional `overlap._C` extension.

The extension (csrc/) is built when torch is importable at build time and a C++ compiler
works; its CUDA half is added when torch has CUDA and nvcc is found. Any failure to build
it is reported once as a warning and the install goes on without it: the torch and Triton
kernel backends need no compiled code.
"""
import glob
import os
import warnings

from setuptools import setup



def _extension_modules():
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not cpp_sources:
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        warnings.warn("overlap: torch is not importable at build time; skipping the overlap._C extension")
        return [], {}
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    define_macros = [("OVERLAP_WITH_CUDA", "1")] if use_cuda else []
    # -ffp-contract=off: `a + b * s` must round twice, as torch's separate ops do (no FMA).
    extra = {"cxx": ["-O3", "-fopenmp", "-ffp-contract=off"]}
    # csrc/flat_launch.cu includes the kernels the CuPy backend also compiles at run time.
    include_dirs = [os.path.abspath("csrc"), os.path.abspath("kernels")]
    if use_cuda:
        extra["nvcc"] = ["-O3", "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
        ext = cpp_extension.CUDAExtension(
            "overlap._C", cpp_sources + cuda_sources, define_macros=define_macros, include_dirs=include_dirs,
            extra_compile_args=extra, extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "overlap._C", cpp_sources, include_dirs=include_dirs, extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": _optional(cpp_extension.BuildExtension)}


def _optional(build_ext_class):
    """Wrap torch's BuildExtension so that a failed compile warns instead of failing the install."""

    class OptionalBuildExtension(build_ext_class):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - any build failure must not fail the install
                warnings.warn(f"overlap: building {ext.name} failed ({exc}); "
                              "the torch and Triton kernel backends remain available")

    return OptionalBuildExtension


ext_modules, cmdclass = _extension_modules()

setup(
    packages=["overlap", "overlap.kernels"],
    package_dir={"overlap": "overlap", "overlap.kernels": "kernels"},
    package_data={"overlap": ["data/*.txt"], "overlap.kernels": ["*.cu", "*.cuh"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
