"""Build ``weightcache._views`` (client/csrc/views.cpp) in place, against the installed torch.

Run by ``make setup`` (``make native``); the SDK works without it (``weightcache._handles``
builds the views one ``torch.as_strided`` at a time), only slower per tensor.
"""

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

CLIENT = Path(__file__).resolve().parent

if __name__ == "__main__":
    setup(
        name="weightcache-native",
        ext_modules=[
            CppExtension(
                "weightcache._views",
                [str(CLIENT / "csrc" / "views.cpp")],
                extra_compile_args=["-O2"],
            )
        ],
        cmdclass={"build_ext": BuildExtension},
        package_dir={"": str(CLIENT)},
        script_args=[
            "--quiet",
            "build_ext",
            "--inplace",
            "--build-temp",
            str(CLIENT.parent / ".build" / "native"),
        ],
    )
