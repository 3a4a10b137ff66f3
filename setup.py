"""Build hook for the optional C speedups (everything else is in pyproject.toml).

``protocol._speedups`` is one module built from every ``protocol/_speedups*.c`` (C
versions of the packers, the digest's terms, the steady lane's and the same-batch
step's lists and frames; each file's header says what it holds).  ``optional=True``:
where no C compiler is found, the install goes on and deltacast runs on its
pure-Python paths (same bytes, slower); ``python -m protocol.speedups`` says which one
is in use.
"""

from glob import glob

from setuptools import Extension, setup

setup(ext_modules=[Extension("protocol._speedups", sorted(glob("protocol/_speedups*.c")),
                             depends=["protocol/_speedups.h"], extra_compile_args=["-O2"],
                             optional=True)])
