"""Print the include directory of an installed onednn-devel package (for CMakeLists.txt).

The onednn-devel-cpu-gomp wheel puts oneDNN's headers in its install scheme's data directory
(``<prefix>/include``), wherever pip installed it: a virtual environment, a user site, or the
isolated environment of a PEP 517 build. Prints nothing when none is installed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os

for name in ("onednn-devel-cpu-gomp", "onednn-devel"):
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith("oneapi/dnnl/dnnl.h"):
            header = os.path.abspath(str(dist.locate_file(f)))
            print(os.path.dirname(os.path.dirname(os.path.dirname(header))))
            raise SystemExit(0)
