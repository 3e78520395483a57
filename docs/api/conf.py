"""Sphinx configuration of daskpipe's API reference, generated from the docstrings.

Build it (warnings are errors, as in CI): ``sphinx-build -W -b html docs/api build/api``.
"""

import importlib.metadata

project = "daskpipe"
release = importlib.metadata.version("daskpipe")
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# The docstrings are NumPy-style where they have sections ("Parameters", "Raises").
napoleon_google_docstring = False
napoleon_numpy_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"  # deploy's defaults are whole option objects: types below, not in the signature line
autodoc_class_signature = "separated"
html_theme = "alabaster"
