"""The built-in gradient rules, one module per op family.

Every module in this package is imported here, which registers its rules. Each
module's docstring states its rules as formulas.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
