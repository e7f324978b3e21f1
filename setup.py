"""Compiles the MQTT codec (src/wrenmq/mqtt/codec.py), the writer's batch encoder
(src/wrenmq/store/_encode.py) and the log's per-message steps (src/wrenmq/store/_epoch.py,
typed by _epoch.pxd) with Cython.

Everything else is in pyproject.toml. The extension is optional: without a C compiler
the install still succeeds and wrenmq runs the Python source (slower, same behaviour);
the list is wrenmq._compiled.COMPILED_MODULES, which also says when the source runs instead.
"""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # building without Cython: pure Python only
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension("wrenmq.mqtt.codec", ["src/wrenmq/mqtt/codec.py"]),
         Extension("wrenmq.store._encode", ["src/wrenmq/store/_encode.py"]),
         Extension("wrenmq.store._epoch", ["src/wrenmq/store/_epoch.py"])],
        compiler_directives={"language_level": 3},
        quiet=True,
    )
    # After cythonize, which makes new Extensions without it: a compiler that is missing
    # or fails leaves the module to its Python source instead of failing the install.
    for ext in ext_modules:
        ext.optional = True

setup(ext_modules=ext_modules)
