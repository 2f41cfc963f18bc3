"""Sphinx settings for jupyter_ring's documentation: the pages in docs/ and the API reference.

Built by scripts/test.sh (``sphinx-build -W``: a warning, such as a broken reference or a
docstring Sphinx cannot read, fails CI); by hand: ``.venv/bin/sphinx-build -W docs build/docs``.
"""

project = "jupyter_ring"
author = "the jupyter_ring developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.intersphinx"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
# Code fences with the notebook's own syntax (%%distributed, In [1]:) are not Python to Pygments.
suppress_warnings = ["misc.highlighting_failure"]
autodoc_default_options = {"undoc-members": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# Annotations by the names their modules give them (``from __future__ import annotations``), not
# numpy's long expansion of ArrayLike (a union of private protocols) or NDArray's generic form
autodoc_type_aliases = {"npt.ArrayLike": "numpy.typing.ArrayLike", "Array": "numpy.ndarray"}
# cupy needs a GPU wheel; its adapter is documented from its source without it
autodoc_mock_imports = ["cupy", "tensorflow", "keras", "tf_keras"]
intersphinx_mapping = {}
html_theme = "alabaster"
html_title = "jupyter_ring"
