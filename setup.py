"""Build hook for the optional C kernels (everything else is in pyproject.toml).

``protocol._kernels`` is one module built from every ``protocol/_kernels*.c`` (generic
kernels: integer packers, row scans of integer arrays, list kernels; each file's header
says what it holds, ``protocol/kernels.py`` is their typed facade).  ``optional=True``:
where no C compiler is found, the install goes on and deltacast runs on its
pure-Python paths (same bytes, slower); ``python -m protocol.kernels`` says which one is
in use.
"""

from glob import glob

from setuptools import Extension, setup

setup(ext_modules=[Extension("protocol._kernels", sorted(glob("protocol/_kernels*.c")),
                             depends=["protocol/_kernels.h"], extra_compile_args=["-O2"],
                             optional=True)])
