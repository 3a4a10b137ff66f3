"""Build hook for the optional C speedups (everything else is in pyproject.toml).

``protocol._speedups`` holds C versions of the small-list packers and the digest's
block terms.  ``optional=True``: where no C compiler is found, the install goes on
and deltacast runs on its pure-Python paths (same bytes, slower);
``python -m protocol.speedups`` says which one is in use.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("protocol._speedups",
                             ["protocol/_speedups.c", "protocol/_speedups_step.c",
                              "protocol/_speedups_output.c", "protocol/_speedups_lane.c",
                              "protocol/_speedups_counts.c", "protocol/_speedups_fused.c",
                              "protocol/_speedups_frame.c", "protocol/_speedups_view.c",
                              "protocol/_speedups_absorb.c"],
                             depends=["protocol/_speedups.h"], extra_compile_args=["-O2"],
                             optional=True)])
