"""Build ``weightcache._views`` (client/csrc/views.cpp) in place, against the installed torch.

Run by ``make setup`` (``make native``; ``--check``: exit 1 when Python's headers are
missing, and build nothing); the SDK works without it (``weightcache._handles``
builds the views one ``torch.as_strided`` at a time), only slower per tensor.
"""

import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

CLIENT = Path(__file__).resolve().parent


def has_headers() -> bool:
    """Whether this Python's C headers are installed (Debian: the python3-dev package)."""
    return (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()


if __name__ == "__main__" and sys.argv[1:] == ["--check"]:
    sys.exit(0 if has_headers() else 1)
elif __name__ == "__main__":
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
