# Sphinx configuration of the course's website (`make book`, pcourse.tools.book.build).
# The pages are laid out by pcourse.tools.book.build; this file only says how to render them.
project = "pcourse"
html_title = "pcourse · data-parallel training from scratch"
extensions = ["myst_nb"]
# The stored outputs are the pages' outputs: a website must not need engines or MPI.
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3  # the README's and the guide's links to #sections resolve
root_doc = "index"
exclude_patterns = ["**/.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,  # a lesson is run from a clone (the page says how)
    "home_page_in_toc": True,
}
html_copy_source = False  # the pages are the site; the notebooks are in the repository
