"""Sphinx configuration for nbdist's site: ``bash scripts/docs.sh`` builds it into docs/_build/html.

Built offline with warnings as errors: no remote intersphinx, no link check. The notebooks in
notebooks/ are committed without outputs; myst-nb executes them here (CPU ranks) and keeps what
they printed in its jupyter-cache under docs/_build/.jupyter_cache, so a second build re-runs only
the notebooks that changed.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))  # nbdist_options: the magics' and CLI's options, generated
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's nbdist, whether installed or not

import nbdist  # noqa: E402

project = "nbdist"
author = "the nbdist developers"
copyright = "2026, the nbdist developers"
release = version = nbdist.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_nb",  # also loads myst_parser for the Markdown pages
    "nbdist_options",
]

# Sources: Markdown and reST pages, and the notebooks (docs/notebooks links to ../notebooks).
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
smartquotes = False  # option help says --flag and 'quoted args': keep them as typed

# ---- notebooks (myst-nb) ------------------------------------------------------------------------
# "cache": executed once per change of a notebook's code, the outputs kept in jupyter-cache.
nb_execution_mode = os.environ.get("NBDIST_DOCS_EXECUTE", "cache")
nb_execution_cache_path = os.path.join(HERE, "_build", ".jupyter_cache")
nb_execution_in_temp = True  # a notebook's checkpoints and files go to a temp folder, not into docs/
nb_execution_timeout = 300  # per cell, as tests/test_notebooks.py allows
nb_execution_allow_errors = False  # a failing cell fails the build; cells that fail on purpose are tagged
nb_execution_raise_on_error = True
nb_merge_streams = True

# ---- API reference (autodoc, autosummary, numpydoc) ----------------------------------------------
autosummary_generate = False  # api.rst names every entry itself: no stub pages to keep in git
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the numpydoc sections say the types, and the signature stays readable
numpydoc_show_class_members = False  # api.rst lists each class's members with autodoc's :members:
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = True
numpydoc_xref_param_type = False

# ---- HTML ----------------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"nbdist {version}"
html_static_path = ["_static"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version", "theme-version"],
}
html_sidebars = {"changelog": []}
html_show_sourcelink = False
