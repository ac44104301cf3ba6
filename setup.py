"""Build script: the pure-Python package plus the optional `overlap._C` extension.

Packages are found, not listed: `overlap/` and every directory below it (packages, and
package data such as overlap/data), and the top-level `kernels/` installed as
`overlap.kernels`; in the checkout `overlap/kernels` is a link to it (see kernels/backends.py
for why it is a namespace package).

The extension (csrc/) is built against the torch importable at build time (so build with
`--no-build-isolation` next to the torch you will run) when a C++ compiler works; its CUDA
half is added when torch has CUDA and nvcc is found. Without torch, without a compiler, or
when the build fails, one warning says so and the install goes on without the extension:
the torch and Triton kernel backends need no compiled code.
"""
import glob
import os
import shutil
import warnings

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext


def _packages(directory, name):
    """`name` for `directory`, and a subpackage for every directory below it."""
    found = find_namespace_packages(directory, exclude=["__pycache__", "*.__pycache__"])
    return [name] + [f"{name}.{sub}" for sub in found]


# Machine code for the GPUs the CUDA kernels are written for (A100, H100/H200: sm_80 and
# sm_90), and PTX for compute_90, which the driver compiles on first use on any newer GPU;
# without it a later GPU finds "no kernel image is available" at the first launch.
CUDA_ARCH_FLAGS = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                   "-gencode=arch=compute_90,code=compute_90"]


def _skip_extension(reason):
    warnings.warn(f"overlap: installing without the overlap._C extension: {reason}. The torch and Triton "
                  "kernel backends remain available; the `ext` backend needs a reinstall that builds it.")


def _extension_modules():
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not cpp_sources:
        return [], {}
    try:
        with warnings.catch_warnings():
            # torch warns on import when NumPy is missing; building the extension does not use NumPy.
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import torch
            from torch.utils import cpp_extension
    except ImportError:
        # Declared all the same, so that only building it (not an sdist) reports the skip.
        reason = "torch is not importable at build time (install torch first, build with --no-build-isolation)"
        return [Extension("overlap._C", cpp_sources)], {"build_ext": _optional(build_ext, unavailable=reason)}
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    define_macros = [("OVERLAP_WITH_CUDA", "1")] if use_cuda else []
    # -ffp-contract=off: `a + b * s` must round twice, as torch's separate ops do (no FMA).
    # -fno-math-errno: lets the compiler vectorise sqrt (the AdamW step), which never sets errno
    # for the non-negative values it is given.
    # -g0: Python's own flags ask for debug information, which for torch's headers is a third
    # of each file's compile time (measured: 69 s against 47 s for the five CPU sources).
    extra = {"cxx": ["-O3", "-g0", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]}
    # csrc/flat_launch.cu includes the kernels the CuPy backend also compiles at run time.
    include_dirs = [os.path.abspath("csrc"), os.path.abspath("kernels")]
    if use_cuda:
        extra["nvcc"] = ["-O3", *CUDA_ARCH_FLAGS]
        ext = cpp_extension.CUDAExtension(
            "overlap._C", cpp_sources + cuda_sources, define_macros=define_macros, include_dirs=include_dirs,
            extra_compile_args=extra, extra_link_args=["-fopenmp"],
        )
    else:
        # The *_cuda.cpp sources hold only CUDA code (empty without OVERLAP_WITH_CUDA).
        cpu_sources = [source for source in cpp_sources if not source.endswith("_cuda.cpp")]
        ext = cpp_extension.CppExtension(
            "overlap._C", cpu_sources, include_dirs=include_dirs, extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": _optional(cpp_extension.BuildExtension, group_sources=not use_cuda)}


# [Note: sources compiled in groups]
# torch's headers (torch/library.h) take about 4 s of each C++ source's 5-9 s on the machine
# the tests run on; compiled one source at a time, the five CPU sources parsed them five times.
# A CPU build compiles them in as many groups as it runs compilers at once (MAX_JOBS, else the
# cores), each group one file that includes its sources: the headers are parsed once per
# group, and the groups still keep every core busy. The sources share one namespace per group,
# so names at file scope must differ between them. A CUDA build (a GPU machine, many cores)
# compiles every source alone.
def _source_groups(sources, groups, directory):
    """`sources` as `groups` files in `directory`, each including its share of them (the
    largest first, each to the group with the fewest bytes so far)."""
    groups = max(1, min(groups, len(sources)))
    members, sizes = [[] for _ in range(groups)], [0] * groups
    for source in sorted(sources, key=os.path.getsize, reverse=True):
        lightest = sizes.index(min(sizes))
        members[lightest].append(source)
        sizes[lightest] += os.path.getsize(source)
    os.makedirs(directory, exist_ok=True)
    grouped = []
    for index, group in enumerate(members):
        path = os.path.join(directory, f"sources_{index}.cpp")
        text = "".join(f'#include "{os.path.abspath(source)}"\n' for source in sorted(group))
        with open(path, "a+") as f:          # unchanged: ninja keeps its object
            f.seek(0)
            if f.read() != text:
                f.seek(0)
                f.truncate()
                f.write(text)
        grouped.append(path)
    return grouped


def _optional(build_ext_class, unavailable=None, group_sources=False):
    """Wrap a build_ext so that a missing prerequisite or a failed build warns instead of
    failing; with `group_sources`, its C++ sources compile in groups (see the note above)."""

    class OptionalBuildExtension(build_ext_class):
        def build_extensions(self):
            if group_sources:
                jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
                for ext in self.extensions:
                    ext.sources = _source_groups(ext.sources, jobs, os.path.join(self.build_temp, "grouped"))
            compiler = (getattr(self.compiler, "compiler_cxx", None) or [os.environ.get("CXX", "c++")])[0]
            if unavailable is not None:
                reason = unavailable
            elif shutil.which(compiler) is None:
                reason = f"no C++ compiler found ({compiler!r}; set CXX to use another)"
            else:
                try:
                    return super().build_extensions()
                except Exception as exc:  # noqa: BLE001 - any build failure must not fail the install
                    reason = f"building it failed ({exc}; `pip install -v` shows the compiler's output)"
            _skip_extension(reason)
            # Later steps (an editable install's copy into the tree) must not look for it.
            self.extensions = []

    return OptionalBuildExtension


ext_modules, cmdclass = _extension_modules()

setup(
    # overlap.kernels named from kernels/ itself too: an sdist carries no link.
    packages=sorted(set(_packages("overlap", "overlap") + _packages("kernels", "overlap.kernels"))),
    package_dir={"overlap": "overlap", "overlap.kernels": "kernels"},
    package_data={"overlap.data": ["*"], "overlap.kernels": ["*.cu"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
