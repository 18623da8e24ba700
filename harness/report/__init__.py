"""Reports from the results store: Markdown plus a single-file HTML with embedded SVG figures.

data.py holds records as rows (flattened by harness.store.fields, tolerating missing optional
metrics), analysis.py turns rows into sections (tables, figures, recommendations with their
evidence), plots.py draws with matplotlib's Agg backend, sections.py is what a section holds,
render.py writes one list of sections as Markdown and as HTML, published_figures.py reads the
published figures in baselines/, build.py puts a sweep report together. compare.py is the report of
one `harness compare` (sections too; drift.py: what drifted from an earlier comparison's report,
--baseline), summary.py the lines printed at the end of one run. Nothing
in a report is written in advance: every sentence that judges a layout is computed from the
rows it cites.
"""
